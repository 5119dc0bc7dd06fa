package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// patternPodEnv makes the test binary a "pod" that answers /pattern/N with N bytes of
// patternByte, so a reader can tell a lost, duplicated or foreign byte from the right one
// (zeros could not).
const patternPodEnv = "TENDRIL_E2E_PATTERN_POD_ADDRESS"

// patternByte is byte i of a pattern answer. 251 is prime, so the pattern does not repeat in
// step with any power-of-two block a lost or doubled segment would shift it by.
func patternByte(i int64) byte { return byte(i % 251) }

func init() {
	addr := os.Getenv(patternPodEnv)
	if addr == "" {
		return
	}
	err := http.ListenAndServe(addr, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.ParseInt(strings.TrimPrefix(r.URL.Path, "/pattern/"), 10, 64)
		if err != nil {
			fmt.Fprintf(w, "pod %s", addr)
			return
		}
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		buf := make([]byte, 251*256) // a whole number of patterns, so every write starts at 0
		for i := range buf {
			buf[i] = patternByte(int64(i))
		}
		for n > 0 {
			k, err := w.Write(buf[:min(n, int64(len(buf)))])
			if err != nil {
				return
			}
			n -= int64(k)
		}
	}))
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

// startPatternPod runs this test binary as the pattern pod on addr in network namespace ns
// until the test ends.
func startPatternPod(t *testing.T, ns, addr string) { startSelf(t, ns, patternPodEnv, addr) }

// haRig is the seed (tendril-seed, tendril-ingress, one tendril-server) and a shoot with two
// tendril-agent processes reaching the server only through the ingress, all real binaries.
type haRig struct {
	t                        *testing.T
	shoot                    string
	serverArgs               []string
	serverListen             []string // the addresses tendril-server serves
	agentArgs                [2][]string
	agentPub                 [2]string
	agents                   [2]*exec.Cmd
	server                   *exec.Cmd
	connectAddr, metricsAddr string
	tlsConf                  *tls.Config
	// pod is the pattern pod's address (empty: haPod).
	pod string
}

// podAddr is the pattern pod's address and the answer to GET / from it.
func (r *haRig) podAddr() (addr, reply string) {
	if r.pod == "" {
		return haPod, haPodReply
	}
	return r.pod, "pod " + r.pod
}

const (
	haPod      = "10.222.0.2:8080"
	haPodReply = "pod " + haPod
)

func newHARig(t *testing.T) *haRig {
	t.Helper()
	dir := t.TempDir()
	shoot, pod := shootNetworks(t, "hf", "10.221.0", "10.222.0")
	startPatternPod(t, pod, haPod)

	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	serverKey, _ := wg.GenerateKey()
	serverPub := write("server.pub", serverKey.PublicKey().String())
	ca, caFile, apiCert := shootPKI(t, dir)
	r := &haRig{t: t, shoot: shoot, tlsConf: &tls.Config{Certificates: []tls.Certificate{apiCert}, RootCAs: ca.Pool, ServerName: "tendril-server"}}

	const ns = "shoot--e2e--ha"
	tunnelAddr, grpcAddr := loopbackAddr(t), loopbackAddr(t)
	r.connectAddr, r.metricsAddr = loopbackAddr(t), loopbackAddr(t)
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.ha.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	ingressTunnel := bindAddr(t, "10.221.0.1:0") // the shoot's side of its veth reaches it
	_, port, _ := net.SplitHostPort(ingressTunnel)
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{ingressTunnel, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e-ha", "--tunnel-address", ingressTunnel, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })

	r.serverListen = []string{tunnelAddr, r.connectAddr, grpcAddr, r.metricsAddr}
	r.serverArgs = []string{"--private-key-file", write("server.key", serverKey.String()),
		"--shoot-cidrs", "10.222.0.0/24", "--tunnel-address", tunnelAddr, "--connect-address", r.connectAddr, "--grpc-address", grpcAddr,
		"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
		"--metrics-address", r.metricsAddr}
	for i := range 2 {
		k, _ := wg.GenerateKey()
		r.agentPub[i] = k.PublicKey().String()
		r.serverArgs = append(r.serverArgs, "--agent-public-key", r.agentPub[i])
		// The extension's addresses: ::2 for agent 0, ::3 for agent 1 (the server's defaults too).
		r.agentArgs[i] = []string{"netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
			"--private-key-file", write(fmt.Sprintf("agent%d.key", i), k.String()), "--address", fmt.Sprintf("fd8f:6d53:b97a:1::%d", 2+i),
			"--server-public-key", "@" + serverPub, "--shoot-cidrs", "10.222.0.0/24",
			"--seed", "10.221.0.1:" + port, "--destination", translate.TendrilServerWireName(ns), "--metrics-address", ""}
	}
	r.startServer()
	for i := range 2 {
		r.startAgent(i)
	}
	// The pod is this test binary started in the pod's namespace: under load (a CI run, -race)
	// it may listen only after the tunnel is up, and a first CONNECT then got 502 (connection
	// refused by the pod's namespace).
	eventually(t, "the pod answers through the tunnel", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		c, _, err := r.connect(ctx)
		if err != nil {
			return err
		}
		return c.Close()
	})
	return r
}

func (r *haRig) startServer() {
	r.server = startKillable(r.t, "tendril-server", filepath.Join(binDir, "tendril-server"), r.serverListen, r.serverArgs...)
}

// restartServer starts tendril-server again on its addresses once they can be bound again: a
// killed server's sockets may hold its ports for a moment (a real restart is a new pod with its
// own address). The test binds them and the new server inherits the sockets, as at the start.
func (r *haRig) restartServer() {
	r.t.Helper()
	for _, a := range r.serverListen {
		eventually(r.t, "tendril-server's port "+a+" bound again", func() error {
			_, err := tryBind(r.t, a)
			return err
		})
	}
	r.startServer()
}

func (r *haRig) startAgent(i int) {
	r.agents[i] = startKillable(r.t, fmt.Sprintf("tendril-agent-%d", i), "ip", nil, r.agentArgs[i]...)
}

// kill SIGKILLs p and returns when it was sent and when the process was dead (a zombie or
// gone: runBinary's waiter reaps it, so Wait here would race it).
func kill(t *testing.T, p *exec.Cmd) (sent, dead time.Time) {
	t.Helper()
	sent = time.Now()
	if err := p.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	stat := fmt.Sprintf("/proc/%d/stat", p.Process.Pid)
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		b, err := os.ReadFile(stat)
		// The state follows the command name in parentheses: "pid (comm) Z ...".
		if _, rest, ok := strings.Cut(string(b), ") "); err != nil || ok && strings.HasPrefix(rest, "Z") {
			return sent, time.Now()
		}
	}
	t.Fatalf("process %d still runs 5 s after SIGKILL", p.Process.Pid)
	return sent, time.Time{}
}

// bothLive waits until both agents are live and returns the active one.
func (r *haRig) bothLive() int {
	r.t.Helper()
	active := -1
	eventually(r.t, "both agents live", func() error {
		m, err := get("http://" + r.metricsAddr + "/metrics")
		if err != nil {
			return err
		}
		active, err = seedserver.ActiveAgent(m, r.agentPub[:])
		return err
	})
	return active
}

// connect opens kube-apiserver's egress to the pod: HTTP CONNECT over mutual TLS to
// tendril-server, which dials through the tunnel before it answers 200.
func (r *haRig) connect(ctx context.Context) (net.Conn, *bufio.Reader, error) {
	d := &tls.Dialer{Config: r.tlsConf}
	c, err := d.DialContext(ctx, "tcp", r.connectAddr)
	if err != nil {
		return nil, nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	pod, _ := r.podAddr()
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", pod, pod)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	if resp.StatusCode != http.StatusOK {
		c.Close()
		return nil, nil, fmt.Errorf("CONNECT: %s", resp.Status)
	}
	return c, br, nil
}

// dialResult is one dial of the loop: when it started and ended, and how it went.
type dialResult struct {
	start, end time.Time
	ok         bool
	// established is when tendril-server answered 200 (zero if it did not): it had dialed the
	// pod through the tunnel.
	established time.Time
	err         error
}

// dialLoop starts a dial to the pod every 20 ms (each with its own 3 s deadline, at most 64 in
// flight, so a hanging dial does not hide the next successful one) until stop is closed.
func (r *haRig) dialLoop(stop <-chan struct{}) (results func() []dialResult) {
	var (
		mu  sync.Mutex
		out []dialResult
		wg  sync.WaitGroup
	)
	slots := make(chan struct{}, 64)
	every(&wg, stop, 20*time.Millisecond, func() {
		select {
		case slots <- struct{}{}:
		default:
			return // 64 dials hang already; the next tick tries again
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			res := dialResult{start: time.Now()}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, br, err := r.connect(ctx)
			if err == nil {
				res.established = time.Now()
				// The pod's answer gets its own deadline: a 200 late in the dial's must
				// not count as a 200 the pod never answered.
				_ = c.SetDeadline(res.established.Add(3 * time.Second))
				fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
				resp, err := http.ReadResponse(br, nil)
				var body []byte
				if err == nil {
					body, err = io.ReadAll(resp.Body)
				}
				_, reply := r.podAddr()
				res.ok = err == nil && string(body) == reply
				if !res.ok {
					res.err = fmt.Errorf("after 200: body %q, %w", body, err)
				}
				c.Close()
			}
			res.end = time.Now()
			mu.Lock()
			out = append(out, res)
			mu.Unlock()
		}()
	})
	return func() []dialResult {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return out
	}
}

// transfer reads /pattern/N through the tunnel at about 10 MB/s and checks every byte; it runs
// until the pod's answer ends, the connection breaks or stop is closed.
type transfer struct {
	verified atomic.Int64
	corrupt  atomic.Int64 // offset+1 of the first wrong byte
	done     chan error
}

func (r *haRig) startTransfer(stop <-chan struct{}) *transfer {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, br, err := r.connect(ctx)
	if err != nil {
		r.t.Fatalf("long transfer: %v", err)
	}
	_ = c.SetDeadline(time.Time{})
	const size = 1 << 40 // longer than any test: the transfer ends by a break or stop
	fmt.Fprintf(c, "GET /pattern/%d HTTP/1.1\r\nHost: pod\r\n\r\n", int64(size))
	tr := &transfer{done: make(chan error, 1)}
	go func() {
		defer c.Close()
		tr.done <- func() error {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return err
			}
			buf := make([]byte, 64<<10)
			var off int64
			for {
				select {
				case <-stop:
					return nil
				default:
				}
				// A read deadline so a connection that went silent ends too.
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				n, err := resp.Body.Read(buf)
				for i := range n {
					if buf[i] != patternByte(off+int64(i)) {
						tr.corrupt.CompareAndSwap(0, off+int64(i)+1)
						return fmt.Errorf("byte %d is %d, want %d", off+int64(i), buf[i], patternByte(off+int64(i)))
					}
				}
				off += int64(n)
				tr.verified.Store(off)
				if err != nil {
					return err
				}
				time.Sleep(5 * time.Millisecond) // 64 KiB per ≥5 ms: at most ~13 MB/s
			}
		}()
	}()
	go func() { <-stop; c.SetReadDeadline(time.Now()) }()
	return tr
}

// recovery is the time from kill to the end of the first successful dial started after it.
// A dial answered 200 that then never reached the pod was broken by the kill if it started
// before the process was dead (its tunnel handshake may have gone through the dying process),
// and answered without a tunnel if it started later.
func recovery(t *testing.T, what string, kill, dead time.Time, rs []dialResult) (d time.Duration, broken, bad int) {
	best := time.Duration(-1)
	for _, r := range rs {
		switch {
		case r.ok || r.established.IsZero():
		case r.start.Before(dead):
			broken++
		default:
			bad++
			t.Logf("%s: dial started %v after the death, 200 after %v, then %v", what, r.start.Sub(dead), r.established.Sub(r.start), r.err)
		}
		if r.ok && r.start.After(kill) {
			if d := r.end.Sub(kill); best < 0 || d < best {
				best = d
			}
		}
	}
	return best, broken, bad
}

func summary(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	return fmt.Sprintf("p50 %v, worst %v, all %v", s[len(s)/2], s[len(s)-1], s)
}

// TestHAFailoverTimes measures, with the real binaries, how long kube-apiserver's dials fail when
// (a) the active agent is killed and (b) tendril-server is killed and restarted (the design has
// one server: docs/design-notes/ha.md), while a dial loop runs and a long transfer reads a
// checked pattern. Each kind is repeated haRepetitions times; p50 and worst are logged, not
// asserted (only a deadline per recovery). Asserted: a standby agent's death leaves the transfer
// through the active one running and intact; no connection ever delivers a wrong byte; no dial
// is answered 200 by a server that then cannot reach the pod.
func TestHAFailoverTimes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatal("ip is not on PATH (Debian package iproute2; see .ci/run)")
	}
	const haRepetitions = 10
	r := newHARig(t)
	waitRecovered := func(what string, kill, dead time.Time, results func() []dialResult, stop chan struct{}) time.Duration {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			// The loop's own results are only complete once it stopped; poll with a probe dial
			// instead, then stop the loop and take its first success.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			c, _, err := r.connect(ctx)
			cancel()
			if err == nil {
				c.Close()
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no successful dial within 30 s of the kill: %v", what, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond) // the loop's dials started after the kill finish
		close(stop)
		d, broken, bad := recovery(t, what, kill, dead, results())
		if broken > 0 {
			t.Logf("%s: %d dials established before the kill broke", what, broken)
		}
		if bad > 0 {
			t.Errorf("%s: %d dials answered 200 without reaching the pod", what, bad)
		}
		if d < 0 {
			t.Fatalf("%s: the dial loop saw no success after the kill", what)
		}
		return d
	}
	checkTransfer := func(what string, tr *transfer) {
		t.Helper()
		if off := tr.corrupt.Load(); off > 0 {
			t.Errorf("%s: the long transfer delivered a wrong byte at offset %d", what, off-1)
		}
	}

	var agentTimes []time.Duration
	for rep := range haRepetitions {
		active := r.bothLive()
		standby := 1 - active
		trStop := make(chan struct{})
		tr := r.startTransfer(trStop)
		eventually(t, "the transfer moves", func() error {
			if tr.verified.Load() < 1<<20 {
				return errors.New("less than 1 MiB yet")
			}
			return nil
		})

		// The standby agent dies: the transfer through the active one carries on, intact.
		_, _ = kill(t, r.agents[standby])
		before := tr.verified.Load()
		time.Sleep(1500 * time.Millisecond) // longer than the server's failover grace
		select {
		case err := <-tr.done:
			t.Fatalf("rep %d: the transfer through the active agent ended when the standby died: %v", rep, err)
		default:
		}
		if tr.verified.Load() <= before {
			t.Fatalf("rep %d: the transfer through the active agent stalled when the standby died", rep)
		}
		r.startAgent(standby)
		if got := r.bothLive(); got != active {
			t.Fatalf("rep %d: agent %d active after the standby's restart, want %d", rep, got, active)
		}

		// The active agent dies while the loop dials.
		stop := make(chan struct{})
		results := r.dialLoop(stop)
		time.Sleep(200 * time.Millisecond)
		at, dead := kill(t, r.agents[active])
		d := waitRecovered(fmt.Sprintf("rep %d, agent", rep), at, dead, results, stop)
		agentTimes = append(agentTimes, d)
		// The transfer went through the dead agent: it ends (a reset from the other agent, or
		// the read deadline), never with a wrong byte.
		close(trStop)
		<-tr.done
		checkTransfer(fmt.Sprintf("rep %d, agent", rep), tr)
		r.startAgent(active)
	}
	t.Logf("active agent killed → next successful dial, %d repetitions: %s", haRepetitions, summary(agentTimes))

	var serverTimes []time.Duration
	for rep := range haRepetitions {
		r.bothLive()
		trStop := make(chan struct{})
		tr := r.startTransfer(trStop)
		stop := make(chan struct{})
		results := r.dialLoop(stop)
		time.Sleep(200 * time.Millisecond)
		at, dead := kill(t, r.server)
		r.restartServer() // what the Deployment's controller and kubelet do, at once
		d := waitRecovered(fmt.Sprintf("rep %d, server", rep), at, dead, results, stop)
		serverTimes = append(serverTimes, d)
		close(trStop)
		<-tr.done
		checkTransfer(fmt.Sprintf("rep %d, server", rep), tr)
	}
	t.Logf("tendril-server killed and restarted at once → next successful dial, %d repetitions: %s", haRepetitions, summary(serverTimes))
}
