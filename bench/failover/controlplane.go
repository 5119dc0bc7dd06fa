package failover

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/xds/translate"
)

// controlPlane measures the kill of the xDS server the ingress is connected to. Two
// tendril-seed replicas serve xDS from route files (file mode: no leader election), behind a
// "Service" that sends each new connection to the first replica that accepts it; one
// tendril-ingress connects through it. The replica the ingress is not connected to knows one
// shoot more, as a new leader that took over with the current routes would: the time is from
// the kill until the ingress routes that shoot (its CONNECT for the shoot's tunnel gets past
// 503, "no such cluster"). What it leaves out is the leader election of Kubernetes mode (see
// Row.Recovers): a SIGKILLed leader's Lease must expire before another replica serves xDS.
func (r *runner) controlPlane(ctx context.Context) (*Row, error) {
	row := &Row{Kind: KindControlPlane, Stack: "tendril",
		Killed: "the tendril-seed (of two, file mode) whose xDS the ingress is connected to (SIGKILL), started again after the measurement",
		Recovers: "tendril-ingress reconnects through the Service to the other replica and takes its routes, one shoot newer " +
			"(its backoff doubles from 0.1 s and starts over only after a stream that lived 10 s: kills seconds apart find it further up); " +
			"excludes Kubernetes mode's leader election (a SIGKILLed leader's Lease expires after 15 s, a stopped one is released at once)"}
	for _, b := range []string{"tendril-seed", "tendril-ingress"} {
		if _, err := os.Stat(r.bin(b)); err != nil {
			return nil, fmt.Errorf("failover: %s not found (make build)", r.bin(b))
		}
	}
	dir := filepath.Join(r.tmp, "controlplane")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// Every process inherits its sockets (peers.StartWithSockets); a replica started again
	// gets its address bound again (seedSocket).
	socks, err := peers.Bind(4)
	if err != nil {
		return nil, err
	}
	seedAddr := [2]string{socks[0].Addr, socks[1].Addr}
	seedSocks := [2]*inherit.Socket{socks[0], socks[1]}
	ingressSocks := socks[2:]
	tunnel, ingressMetrics := ingressSocks[0].Addr, ingressSocks[1].Addr
	defer func() { // those not handed over
		for _, s := range append(ingressSocks, seedSocks[:]...) {
			if s != nil {
				s.Close()
			}
		}
	}()
	// seedSocket is replica i's socket: the first, or its address bound again once the
	// killed replica's socket is gone.
	seedSocket := func(i int) (*inherit.Socket, error) {
		s := seedSocks[i]
		seedSocks[i] = nil
		if s != nil {
			return s, nil
		}
		err := until(ctx, 10*time.Second, func() (err error) {
			s, err = inherit.Bind(seedAddr[i])
			return err
		})
		return s, err
	}

	var seeds [2]*peers.Process
	defer func() {
		for _, s := range seeds {
			if s != nil {
				_ = s.Stop()
			}
		}
	}()
	starts := 0
	// startSeed runs replica i with shoots 0..n-1 in its route file.
	startSeed := func(i, n int) error {
		routes := filepath.Join(dir, fmt.Sprintf("routes-%d.yaml", i))
		if err := os.WriteFile(routes, []byte(routeFile(n)), 0o644); err != nil {
			return err
		}
		starts++
		sock, err := seedSocket(i)
		if err != nil {
			return fmt.Errorf("tendril-seed-%d's address: %w", i, err)
		}
		s, err := peers.StartWithSockets(fmt.Sprintf("tendril-seed-%d", i), filepath.Join(dir, fmt.Sprintf("tendril-seed-%d.%d.log", i, starts)),
			[]*inherit.Socket{sock}, r.bin("tendril-seed"), "--routes", routes, "--xds-address", seedAddr[i], "--xds-insecure", "--metrics-address", "")
		if err != nil {
			return err
		}
		s.KillAtOnce = true
		seeds[i] = s
		return waitProcs(ctx, 10*time.Second, func() error {
			c, err := net.DialTimeout("tcp", seedAddr[i], time.Second)
			if err == nil {
				c.Close()
			}
			return err
		}, s)
	}
	fwd, err := newForwarder("127.0.0.1:0", seedAddr[:])
	if err != nil {
		return nil, err
	}
	defer fwd.Close()
	svc := fwd.l.Addr().String()

	// Replica 0 is the one the ingress connects to first (the forwarder tries it first).
	connected, shoots := 0, 1
	if err := startSeed(0, shoots); err != nil {
		return nil, err
	}
	if err := startSeed(1, shoots+1); err != nil {
		return nil, err
	}
	ing, err := peers.StartWithSockets("tendril-ingress", filepath.Join(dir, "tendril-ingress.log"), ingressSocks, r.bin("tendril-ingress"),
		"--xds", svc, "--xds-insecure", "--node-id", "bench-failover-cp", "--tunnel-address", tunnel, "--metrics-address", ingressMetrics)
	if err != nil {
		return nil, err
	}
	ing.KillAtOnce = true
	defer ing.Stop()

	var target atomic.Int64 // the shoot the probe asks for
	probe := func(ctx context.Context) error { return routed(ctx, tunnel, int(target.Load())) }
	// Throughout, once the ingress synced, shoot 0 (every replica has it) must stay routed: the
	// ingress keeps its last configuration while it has no xDS server.
	var checks, withdrawn atomic.Int64
	wctx, stopWatch := context.WithCancel(ctx)
	var watch sync.WaitGroup
	watchRoutes := func() {
		for wctx.Err() == nil {
			dctx, cancel := context.WithTimeout(wctx, dialTimeout)
			err := routed(dctx, tunnel, 0)
			cancel()
			if wctx.Err() != nil {
				return
			}
			checks.Add(1)
			if err != nil && strings.Contains(err.Error(), "503") {
				withdrawn.Add(1)
			}
			time.Sleep(dialEvery)
		}
	}
	defer func() {
		stopWatch()
		watch.Wait()
		row.Note = fmt.Sprintf("shoot 0, routed by every replica, asked for %d times during the kills: %d answered 503 (route withdrawn)", checks.Load(), withdrawn.Load())
	}()
	for i := range r.cfg.Repetitions {
		// The ingress holds the connected replica's newest shoot: it is connected and synced.
		target.Store(int64(shoots - 1))
		if err := waitProcs(ctx, 30*time.Second, func() error { return probe(ctx) }, ing, seeds[0], seeds[1]); err != nil {
			return row, fmt.Errorf("failover: control plane: the ingress routes shoot %d: %w", shoots-1, err)
		}
		if i == 0 {
			watch.Go(watchRoutes)
		}
		killed := connected
		d, err := measureKill(ctx, probe, func() (time.Time, error) {
			target.Store(int64(shoots)) // only the other replica has it
			at := time.Now()
			return at, seeds[killed].Stop()
		})
		if err != nil {
			return row, fmt.Errorf("control-plane kill %d: %w", i+1, err)
		}
		row.Times = append(row.Times, d)
		r.logf("control-plane kill %d/%d: %v", i+1, r.cfg.Repetitions, d.Round(time.Millisecond))
		// The ingress is on the other replica now, which has shoots+1; the restarted one gets
		// one more for the next kill.
		connected, shoots = 1-killed, shoots+1
		if err := startSeed(killed, shoots+1); err != nil {
			return row, err
		}
	}
	return row, nil
}

// routeFile is a route file with shoots 0..n-1, each with a tunnel server that refuses (the
// ingress answers 502 for a routed shoot, 503 for an unknown one).
func routeFile(n int) string {
	var b strings.Builder
	b.WriteString("shoots:\n")
	for i := range n {
		fmt.Fprintf(&b, "- name: %s\n  hosts: [api.cp%d.bench.tendril.local]\n  apiserver: \"127.0.0.1:1\"\n  vpnServer: \"127.0.0.1:1\"\n", cpShoot(i), i)
	}
	return b.String()
}

func cpShoot(i int) string { return fmt.Sprintf("shoot--bench--cp%d", i) }

// routed asks the ingress's tunnel listener for shoot i's server: nil once the answer is not
// 503 (no such cluster), that is once the ingress has the shoot's route.
func routed(ctx context.Context, tunnel string, i int) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", tunnel)
	if err != nil {
		return err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	fmt.Fprintf(c, "CONNECT 127.0.0.1:1194 HTTP/1.1\r\nHost: x\r\nReversed-VPN: %s\r\n\r\n", translate.TendrilServerWireName(cpShoot(i)))
	buf := make([]byte, 12)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if st := string(buf[9:12]); st == "503" {
		return fmt.Errorf("shoot %d: 503, no route yet", i)
	}
	return nil
}

// forwarder is the xDS Service: each new connection goes to the first backend that accepts it,
// as a Service whose endpoints list only live replicas would send it (kube-proxy's update after a
// pod's death is not modelled). A connection ends when either side does.
type forwarder struct {
	l        net.Listener
	mu       sync.Mutex
	backends []string // guarded by mu: setBackends changes them
	ns       string   // the namespace it listens and dials in; "": this process's
	conns    inflight.Set
	wg       sync.WaitGroup
}

func newForwarder(addr string, backends []string) (*forwarder, error) {
	return newForwarderIn("", addr, backends)
}

// newForwarderIn is a forwarder that listens on addr and dials its backends in the namespace ns.
func newForwarderIn(ns, addr string, backends []string) (*forwarder, error) {
	var l net.Listener
	err := inNS(ns, func() (err error) {
		l, err = net.Listen("tcp", addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("failover: forwarder: %w", err)
	}
	f := &forwarder{l: l, backends: backends, ns: ns}
	f.wg.Go(f.serve)
	return f, nil
}

// inNS runs f in the namespace ns, or in this process's if ns is empty.
func inNS(ns string, f func() error) error {
	if ns == "" {
		return f()
	}
	return netns.In(ns, f)
}

func (f *forwarder) serve() {
	for {
		c, err := f.l.Accept()
		if err != nil {
			return
		}
		var up net.Conn
		f.mu.Lock()
		backends := f.backends
		f.mu.Unlock()
		for _, b := range backends {
			if err = inNS(f.ns, func() (err error) { up, err = net.DialTimeout("tcp", b, time.Second); return err }); err == nil {
				break
			}
		}
		if up == nil {
			c.Close()
			continue
		}
		if !f.conns.Add(c, up) {
			c.Close()
			up.Close()
			return
		}
		f.wg.Go(func() { splice(c, up); f.conns.Remove(c, up) })
		f.wg.Go(func() { splice(up, c) })
	}
}

// setBackends replaces the backends new connections go to (a Service's endpoints changed).
func (f *forwarder) setBackends(b []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.backends = b
}

// splice copies src to dst, then closes both: the first side to end ends the connection.
func splice(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	dst.Close()
	src.Close()
}

func (f *forwarder) Close() error {
	err := f.l.Close()
	f.conns.Close()
	f.wg.Wait()
	return err
}
