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
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// podServeEnv makes the test binary an HTTP "pod" instead of running tests: run inside a network
// namespace with ip netns exec, it answers every request with its address, and /bytes/N with N
// zero bytes.
const podServeEnv = "TENDRIL_E2E_POD_ADDRESS"

func init() {
	addr := os.Getenv(podServeEnv)
	if addr == "" {
		return
	}
	zeros := make([]byte, 256<<10)
	err := http.ListenAndServe(addr, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, err := strconv.ParseInt(strings.TrimPrefix(r.URL.Path, "/bytes/"), 10, 64); err == nil {
			w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
			for n > 0 {
				k, err := w.Write(zeros[:min(n, int64(len(zeros)))])
				if err != nil {
					return
				}
				n -= int64(k)
			}
			return
		}
		fmt.Fprintf(w, "pod %s", addr)
	}))
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

// startPod runs the test binary as the HTTP "pod" on addr inside network namespace netns until
// the test ends.
func startPod(t *testing.T, netns, addr string) { startSelf(t, netns, podServeEnv, addr) }

// startSelf runs this test binary in network namespace ns with env=addr set (TestMain makes it
// the "pod" that env names) until the test ends.
func startSelf(t *testing.T, ns, env, addr string) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, self)
	cmd.Env = append(os.Environ(), env+"="+addr)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
}

// TestReversedVPN runs the reversed VPN with the real binaries: tendril-seed, tendril-ingress,
// tendril-server on the host (the seed); tendril-agent vpn in a "shoot" network namespace that
// reaches the seed only through the ingress's tunnel port; a "pod" HTTP server in a third
// namespace reachable only from the shoot. curl, as kube-apiserver would, asks tendril-server for
// an HTTP CONNECT over mutual TLS to the pod and gets the pod's answer through server → tunnel →
// agent. A target outside the shoot's networks is refused.
func TestReversedVPN(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	for _, bin := range []string{"ip", "curl"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not on PATH (Debian packages iproute2, curl; see .ci/run)", bin)
		}
	}
	dir := t.TempDir()
	// seed ⇄ shoot: 10.215.0.1/30 ⇄ .2; shoot ⇄ pod: 10.216.0.1/24 ⇄ .2 (the "pod network").
	shoot, pod := shootNetworks(t, "tv", "10.215.0", "10.216.0")

	startPod(t, pod, "10.216.0.2:8080")

	// Keys and certificates, as the extension would put them into Secrets.
	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	serverKeyFile, serverPub, _ := writeKeys(t, dir, "server")
	agentKeyFile, agentPub, agentKey := writeKeys(t, dir, "agent")
	agentKeyFile2, agentPub2, agentKey2 := writeKeys(t, dir, "agent2") // a second replica (HA)
	ca, caFile, _ := shootPKI(t, dir)

	const ns = "shoot--e2e--vpn"
	tunnelAddr, connectAddr, grpcAddr, serverMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.vpn.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	ingressTunnel := bindAddr(t, "10.215.0.1:0") // the shoot's side of its veth reaches it
	_, port, _ := net.SplitHostPort(ingressTunnel)
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{ingressTunnel, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--tunnel-address", ingressTunnel, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	start(t, "tendril-server", []string{tunnelAddr, connectAddr, grpcAddr, serverMetrics}, "--private-key-file", serverKeyFile, "--agent-public-key", "@"+agentPub, "--agent-public-key", "@"+agentPub2,
		"--shoot-cidrs", "10.216.0.0/24", "--tunnel-address", tunnelAddr, "--connect-address", connectAddr, "--grpc-address", grpcAddr,
		"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
		"--metrics-address", serverMetrics)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	// Two replicas of the agent, each with its own key and inner address (the server's defaults:
	// ::2 for the first key, ::3 for the second).
	agents := map[string]*exec.Cmd{}
	// Their metrics in the shoot's namespace, which the host reaches over the veth.
	agentMetrics := []string{"10.215.0.2:9101", "10.215.0.2:9102"}
	for i, a := range []struct{ key, pub, address string }{
		{agentKeyFile, agentKey.PublicKey().String(), "fd8f:6d53:b97a:1::2"},
		{agentKeyFile2, agentKey2.PublicKey().String(), "fd8f:6d53:b97a:1::3"},
	} {
		agents[a.pub] = startKillable(t, fmt.Sprintf("tendril-agent-%d", i+1), "ip", nil, "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
			"--private-key-file", a.key, "--address", a.address, "--server-public-key", "@"+serverPub, "--shoot-cidrs", "10.216.0.0/24",
			"--seed", "10.215.0.1:"+port, "--destination", translate.TendrilServerWireName(ns), "--metrics-address", agentMetrics[i])
	}
	eventually(t, "server ready (tunnel up)", func() error { _, err := get("http://" + serverMetrics + "/readyz"); return err })

	curl := func(target string) (string, error) { return curlConnect(connectAddr, caFile, dir, target) }
	eventually(t, "the pod through the tunnel", func() error {
		got, err := curl("10.216.0.2:8080")
		if err == nil && got != "pod 10.216.0.2:8080" {
			err = fmt.Errorf("answered %q", got)
		}
		if err != nil {
			return fmt.Errorf("%v: %s", err, got)
		}
		return nil
	})
	if got, err := curl("10.215.0.1:" + port); err == nil {
		t.Errorf("a target outside the shoot's networks answered %q", got)
	}

	// holds checks a buffer gauge, summed over the processes whose metrics are at addrs
	// (tendril-server's by default).
	holds := func(gauge string, want int, addrs ...string) func() error {
		if len(addrs) == 0 {
			addrs = []string{serverMetrics}
		}
		return func() error {
			sum := 0
			for _, addr := range addrs {
				m, err := get("http://" + addr + "/metrics")
				if err != nil {
					return err
				}
				found := false
				for _, l := range strings.Split(m, "\n") {
					if v, ok := strings.CutPrefix(l, gauge+" "); ok {
						var n int
						if _, err := fmt.Sscan(v, &n); err != nil {
							return err
						}
						sum, found = sum+n, true
					}
				}
				if !found {
					return fmt.Errorf("no %s in the metrics of %s", gauge, addr)
				}
			}
			if sum != want {
				return fmt.Errorf("%s %d, want %d", gauge, sum, want)
			}
			return nil
		}
	}

	// The same through konnectivity's gRPC protocol, with konnectivity-client as kube-apiserver
	// uses it (one single-use tunnel per connection).
	clientCert, err := tls.LoadX509KeyPair(filepath.Join(dir, "api.pem"), filepath.Join(dir, "api-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{clientCert}, RootCAs: ca.Pool, ServerName: "tendril-server"})
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			tun, err := konnectivity.CreateSingleUseGrpcTunnel(ctx, grpcAddr, grpc.WithTransportCredentials(creds))
			if err != nil {
				return nil, err
			}
			return tun.DialContext(ctx, network, addr)
		},
	}}
	resp, err := hc.Get("http://10.216.0.2:8080/")
	if err != nil {
		t.Fatalf("the pod through konnectivity: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "pod 10.216.0.2:8080" {
		t.Errorf("the pod through konnectivity answered %q", body)
	}
	// The connection stays open in hc's pool, idle: its reader waits for the pod's bytes
	// without a buffer (it held one until the pod spoke again).
	eventually(t, "no gRPC buffer for the idle tunnel", holds("tendril_server_grpc_buffers", 0))

	// Head-of-line through the whole path (CONNECT over mutual TLS → server → tunnel → ingress →
	// agent → pod): one connection's reader stalls with the pod's answer piling up behind it,
	// and a second connection moves 100 MiB beside it. How fast is logged, not asserted.
	egress := func(path string) (net.Conn, *bufio.Reader) {
		t.Helper()
		c, err := tls.Dial("tcp", connectAddr, &tls.Config{Certificates: []tls.Certificate{clientCert}, RootCAs: ca.Pool, ServerName: "tendril-server"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(60 * time.Second))
		fmt.Fprintf(c, "CONNECT 10.216.0.2:8080 HTTP/1.1\r\nHost: 10.216.0.2:8080\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("CONNECT to the pod: %v %v", resp, err)
		}
		fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: pod\r\n\r\n", path)
		return c, br
	}
	egress("/bytes/1073741824") // never read
	const bulk = 100 << 20
	c, br := egress(fmt.Sprintf("/bytes/%d", bulk))
	begin := time.Now()
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != bulk {
		t.Fatalf("beside a stalled connection, the second moved %d of %d bytes (%v)", n, bulk, err)
	}
	t.Logf("100 MiB beside a stalled connection in %v", time.Since(begin))
	c.Close()

	// Idle connections hold no copy buffer: each direction waits for bytes without one (an
	// idle connection held 2 × 128 KiB, plus 128 KiB read ahead from kube-apiserver's socket).
	// The stalled connection holds one, in its direction from the shoot, blocked writing.
	// On the agents (the active one carries them) likewise: the stalled connection's direction
	// from the pod is blocked writing into the tunnel.
	eventually(t, "the stalled connection's buffer", holds("tendril_server_relay_buffers", 1))
	eventually(t, "the stalled connection's buffer on the agent", holds("tendril_agent_vpn_relay_buffers", 1, agentMetrics...))
	const idleConns = 8
	for range idleConns {
		_, br := egress("/")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	eventually(t, "no buffer for the idle connections", holds("tendril_server_relay_buffers", 1))
	eventually(t, "no buffer for the idle connections on the agent", holds("tendril_agent_vpn_relay_buffers", 1, agentMetrics...))

	// HA: both agents are live; the active one dies (SIGKILL); the shoot's networks move to the
	// other, and the pod answers again through it.
	var active string
	eventually(t, "both agents live", func() error {
		m, err := get("http://" + serverMetrics + "/metrics")
		if err != nil {
			return err
		}
		states := seedserver.AgentStates(m)
		for key := range agents {
			if !states[key].Live {
				return fmt.Errorf("agent %s not live", key)
			}
			if states[key].Active {
				active = key
			}
		}
		if active == "" {
			return fmt.Errorf("no active agent")
		}
		return nil
	})
	_ = agents[active].Process.Kill()
	eventually(t, "the pod through the other agent", func() error {
		got, err := curl("10.216.0.2:8080")
		if err != nil || got != "pod 10.216.0.2:8080" {
			return fmt.Errorf("%v: %s", err, got)
		}
		return nil
	})
	m, err := get("http://" + serverMetrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if states := seedserver.AgentStates(m); states[active].Active || !strings.Contains(m, "tendril_server_agent_failovers_total 1") {
		t.Errorf("after killing the active agent: %v, metrics:\n%s", states, grepLines(m, "tendril_server_agent"))
	}
}

// writeFile writes content to dir/name (mode 0600) and returns the path.
func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// writeKeys makes a WireGuard key and writes it to dir, the private key to name.key and the
// public one to name.pub; it returns both paths and the key.
func writeKeys(t *testing.T, dir, name string) (keyFile, pubFile string, key wg.Key) {
	t.Helper()
	key, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, dir, name+".key", key.String()), writeFile(t, dir, name+".pub", key.PublicKey().String()), key
}

// curlConnect fetches http://target/ with curl through tendril-server's CONNECT front-end at
// connectAddr, as kube-apiserver with its certificate from shootPKI in dir; it returns the
// answer, trimmed.
func curlConnect(connectAddr, caFile, dir, target string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "curl", "-sS", "--fail", "--noproxy", "", "-p",
		"--proxy", "https://"+connectAddr, "--proxy-cacert", caFile,
		"--proxy-cert", filepath.Join(dir, "api.pem"), "--proxy-key", filepath.Join(dir, "api-key.pem"),
		"http://"+target+"/").CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// shootCA makes the shoot's CA, which signs tendril-server's and kube-apiserver's certificates,
// and writes it to dir/ca.pem.
func shootCA(t *testing.T, dir string) (*testpki.CA, string) {
	t.Helper()
	ca, err := testpki.NewCA("shoot CA")
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "ca.pem")
	if err := ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	return ca, caFile
}

// shootPKI is shootCA with tendril-server's certificate (tendril-server, 127.0.0.1) written to
// dir/srv.pem and dir/srv-key.pem and kube-apiserver's client certificate to dir/api.pem and
// dir/api-key.pem, which it also returns.
func shootPKI(t *testing.T, dir string) (ca *testpki.CA, caFile string, apiCert tls.Certificate) {
	t.Helper()
	ca, caFile = shootCA(t, dir)
	srvCert, err := ca.Leaf("tendril-server", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	if apiCert, err = ca.Leaf("kube-apiserver"); err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		c         tls.Certificate
		cert, key string
	}{{srvCert, "srv.pem", "srv-key.pem"}, {apiCert, "api.pem", "api-key.pem"}} {
		if err := testpki.WritePair(w.c, filepath.Join(dir, w.cert), filepath.Join(dir, w.key)); err != nil {
			t.Fatal(err)
		}
	}
	return ca, caFile, apiCert
}

// shootNetworks creates a "shoot" network namespace linked to the host over seed.0/30 (the host
// seed.1, the shoot seed.2) and a "pod" namespace behind it on pods.0/24 (the shoot pods.1, the
// pod pods.2), which only the shoot reaches. tag (two letters) keeps the names of the
// namespaces and links apart from other tests'. Everything is removed when t ends.
func shootNetworks(t *testing.T, tag, seed, pods string) (shoot, pod string) {
	t.Helper()
	id := fmt.Sprintf("%d", os.Getpid()%100000)
	shoot, pod = tag+"s-"+id, tag+"p-"+id
	for _, ns := range []string{shoot, pod} {
		ip(t, "netns", "add", ns)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	}
	hostLink, shootUp, shootDown, podLink := tag+"s"+id, tag+"sn"+id, tag+"p"+id, tag+"pn"+id
	ip(t, "link", "add", hostLink, "type", "veth", "peer", "name", shootUp)
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", hostLink).Run() })
	ip(t, "link", "set", shootUp, "netns", shoot)
	ip(t, "addr", "add", seed+".1/30", "dev", hostLink)
	ip(t, "link", "set", hostLink, "up")
	ip(t, "-n", shoot, "addr", "add", seed+".2/30", "dev", shootUp)
	ip(t, "-n", shoot, "link", "set", shootUp, "up")
	ip(t, "-n", shoot, "link", "set", "lo", "up")
	ip(t, "-n", shoot, "link", "add", shootDown, "type", "veth", "peer", "name", podLink)
	ip(t, "-n", shoot, "link", "set", podLink, "netns", pod)
	ip(t, "-n", shoot, "addr", "add", pods+".1/24", "dev", shootDown)
	ip(t, "-n", shoot, "link", "set", shootDown, "up")
	ip(t, "-n", pod, "addr", "add", pods+".2/24", "dev", podLink)
	ip(t, "-n", pod, "link", "set", podLink, "up")
	ip(t, "-n", pod, "link", "set", "lo", "up")
	return shoot, pod
}

func grepLines(text, substr string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// startKillable runs path like startBinary, but the test may kill it: at the end a process that
// still runs gets SIGTERM and must exit cleanly; one the test killed is only reaped.
func startKillable(t *testing.T, name, path string, listen []string, args ...string) *exec.Cmd {
	t.Helper()
	return runBinary(t, name, path, true, listen, args...)
}

func killed(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}
