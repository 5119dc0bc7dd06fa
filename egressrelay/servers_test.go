package egressrelay

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// HA: the relay given two tendril-servers. The tests bound each tunnel generously (haBound, with
// HandshakeTimeout 1 s): what they prove is that no tunnel waits for a dead server's timeouts.
const (
	haHandshake = time.Second
	haBound     = 5 * time.Second
)

// replica is an HA tendril-server replica's own address in front of the test's real
// tendril-server (both replicas carry the same certificate, so one server with its agent stands
// for both): it forwards TCP connections until stop (a pod killed on a live node: its
// connections end, new ones are refused) or hold (its node lost: connections stay open and
// nothing passes, new ones are accepted and held, as a SYN answered by nobody would be, only
// without the kernel's retries). testnet.Proxy has hold (Cut) but cannot stop listening.
type replica struct {
	addr string
	ln   net.Listener
	held atomic.Bool

	mu      sync.Mutex
	conns   []net.Conn
	stopped bool
	wg      sync.WaitGroup
}

func newReplica(t *testing.T, target string) *replica {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &replica{addr: ln.Addr().String(), ln: ln}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !p.track(c) {
				return
			}
			if p.held.Load() {
				p.wg.Add(1)
				go func() { defer p.wg.Done(); _, _ = io.Copy(io.Discard, c) }()
				continue
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			if !p.track(up) {
				return
			}
			p.wg.Add(2)
			go func() { defer p.wg.Done(); p.pipe(up, c) }()
			go func() { defer p.wg.Done(); p.pipe(c, up) }()
		}
	}()
	t.Cleanup(p.stop)
	return p
}

// track remembers c for stop; after stop it closes c and says so.
func (p *replica) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		c.Close()
		return false
	}
	p.conns = append(p.conns, c)
	return true
}

// pipe copies src to dst, discarding what it reads while held; at the end it closes both.
func (p *replica) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.held.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *replica) hold() { p.held.Store(true) }

func (p *replica) stop() {
	p.ln.Close()
	p.mu.Lock()
	p.stopped = true
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// Stand-in modes: how a tendril-server stand-in answers a dial.
const (
	standInRefuses     = "refuses"     // a DIAL_RSP with an error, as a server that cannot dial into the shoot
	standInUnavailable = "unavailable" // the stream's status UNAVAILABLE, as a server shutting down
	standInSilent      = "silent"      // nothing: TLS and gRPC work, the dial is never answered
)

// standIn is a tendril-server stand-in with the real one's certificate and client CA: mutual
// TLS and konnectivity's ProxyService as tendril-server serves them, but its answer to every
// dial is its mode's. It returns the address.
func newStandIn(t *testing.T, b *backend, mode string) string {
	t.Helper()
	cert, err := b.ca.Leaf(serverName)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert},
		ClientCAs: b.ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert})))
	client.RegisterProxyServiceServer(g, &standInService{mode: mode})
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(ln) }()
	t.Cleanup(func() { g.Stop(); <-done })
	return ln.Addr().String()
}

type standInService struct {
	client.UnimplementedProxyServiceServer
	mode string
}

func (s *standInService) Proxy(stream client.ProxyService_ProxyServer) error {
	for {
		pkt, err := stream.Recv()
		if err != nil {
			return nil
		}
		if pkt.GetType() != client.PacketType_DIAL_REQ {
			continue
		}
		switch s.mode {
		case standInRefuses:
			_ = stream.Send(&client.Packet{Type: client.PacketType_DIAL_RSP, Payload: &client.Packet_DialResponse{
				DialResponse: &client.DialResponse{Random: pkt.GetDialRequest().GetRandom(), Error: "no tunnel to the shoot"}}})
		case standInUnavailable:
			return status.Error(codes.Unavailable, "no tunnel to the shoot")
		}
	}
}

// startHA runs a relay with both sockets on servers.
func startHA(t *testing.T, b *backend, servers ...string) *running {
	t.Helper()
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	return startRelay(t, Config{Servers: servers, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca,
		HandshakeTimeout: haHandshake})
}

func (r *running) attempts(server, outcome string) float64 {
	return testutil.ToFloat64(r.relay.metrics.attempts.WithLabelValues(server, outcome))
}

func (r *running) failovers() float64 { return testutil.ToFloat64(r.relay.metrics.failovers) }

// within opens n CONNECTs and n konnectivity tunnels through r, one after another, each echoing
// 1 KiB, and fails the test for any that fails or takes longer than haBound.
func within(t *testing.T, r *running, n int) {
	t.Helper()
	for i := range n {
		start := time.Now()
		c, _, err := r.connectVia(echoTarget, http.MethodConnect, "")
		if err != nil {
			t.Fatalf("CONNECT %d: %v", i, err)
		}
		echo(t, c, 1<<10)
		c.Close()
		if d := time.Since(start); d > haBound {
			t.Errorf("CONNECT %d took %v, more than %v", i, d, haBound)
		}

		start = time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 2*haBound)
		k, err := r.dial(ctx, echoTarget)
		if err != nil {
			cancel()
			t.Fatalf("konnectivity tunnel %d: %v", i, err)
		}
		echo(t, k, 1<<10)
		k.Close()
		cancel()
		if d := time.Since(start); d > haBound {
			t.Errorf("konnectivity tunnel %d took %v, more than %v", i, d, haBound)
		}
	}
}

// failedLines counts the relay's log lines saying that server failed.
func failedLines(r *running, server string) int {
	n := 0
	for _, l := range strings.Split(r.logs.String(), "\n") {
		if strings.Contains(l, "tendril-server failing") && strings.Contains(l, `"`+server+`"`) {
			n++
		}
	}
	return n
}

// TestServersShareTunnels: with both replicas up, every tunnel (CONNECT and konnectivity, one
// after another and at once) succeeds, the replicas take turns, and each carries its tunnels on
// one TCP connection.
func TestServersShareTunnels(t *testing.T) {
	b := newBackend(t)
	p0, p1 := testnet.NewProxy(t, b.grpc), testnet.NewProxy(t, b.grpc)
	r := startHA(t, b, p0.Addr, p1.Addr)
	within(t, r, 6)
	echoAtOnce(t, 4, func() (net.Conn, error) {
		c, _, err := r.connectVia(echoTarget, http.MethodConnect, "")
		return c, err
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	echoAtOnce(t, 4, func() (net.Conn, error) { return r.dial(ctx, echoTarget) })

	a0, a1 := r.attempts(p0.Addr, attemptAnswered), r.attempts(p1.Addr, attemptAnswered)
	t.Logf("answered: %v by replica 0, %v by replica 1; %v failovers", a0, a1, r.failovers())
	if a0+a1 != 20 {
		t.Errorf("%v tunnels answered, want 20", a0+a1)
	}
	// Both take turns, unless one lost a race to the other (slower than attemptDelay on a busy
	// machine) and was put last for avoidFor: that shows as a failover.
	if (a0 == 0 || a1 == 0) && r.failovers() == 0 {
		t.Errorf("one replica carried every tunnel")
	}
	if got := r.count(outcomeRelayed); got != 20 {
		t.Errorf("relayed %v, want 20", got)
	}
	if p0.Accepted() != 1 || p1.Accepted() != 1 {
		t.Errorf("TCP connections to the replicas: %d and %d, want one each", p0.Accepted(), p1.Accepted())
	}
	if got := r.relay.up.connections(); got != 2 {
		t.Errorf("relay holds %d connections, want 2", got)
	}
}

// TestServerDown: a replica that refuses connections, from the start or after it carried
// tunnels (its pod killed, its node alive): every new tunnel succeeds through the other in time,
// and the relay logs the failing one once, not per tunnel.
func TestServerDown(t *testing.T) {
	t.Run("never up", func(t *testing.T) {
		b := newBackend(t)
		down, up := testnet.RefusedAddr(t), newReplica(t, b.grpc)
		r := viaLive(t, b, down, up)
		// The first tunnel tries the first server first (then it is tried last: its connection
		// failed); its failure is logged once.
		if r.failovers() < 1 {
			t.Errorf("no failover counted")
		}
		if got := failedLines(r, down); got != 1 {
			t.Errorf("%d log lines for the refusing replica, want 1:\n%s", got, r.logs.String())
		}
	})
	t.Run("stopped", func(t *testing.T) {
		r, p0 := loseAfterUse(t, "stopped", (*replica).stop)
		if got := failedLines(r, p0.addr); got > 1 {
			t.Errorf("%d log lines for the stopped replica, want at most 1:\n%s", got, r.logs.String())
		}
	})
}

// viaLive relays 6 tunnels over the replica at failing, which fails in the test's way, and live:
// every tunnel must be answered by live, within the bound.
func viaLive(t *testing.T, b *backend, failing string, live *replica) *running {
	t.Helper()
	r := startHA(t, b, failing, live.addr)
	within(t, r, 6)
	if got := r.attempts(live.addr, attemptAnswered); got != 12 {
		t.Errorf("the live replica answered %v tunnels, want 12", got)
	}
	return r
}

// loseAfterUse relays 2 tunnels over two replicas, applies lose to the first replica and relays
// 6 more, none of which the lost replica (named by what) may answer; it returns the relay and the
// lost replica.
func loseAfterUse(t *testing.T, what string, lose func(*replica)) (*running, *replica) {
	t.Helper()
	b := newBackend(t)
	p0, p1 := newReplica(t, b.grpc), newReplica(t, b.grpc)
	r := startHA(t, b, p0.addr, p1.addr)
	within(t, r, 2)
	lose(p0)
	answered := r.attempts(p0.addr, attemptAnswered)
	within(t, r, 6)
	if got := r.attempts(p0.addr, attemptAnswered); got != answered {
		t.Errorf("the %s replica answered %v tunnels", what, got-answered)
	}
	return r, p0
}

// TestServerBlackholed: the lost node. A replica that accepts TCP and then answers nothing —
// not the TLS handshake, or, after a working TLS and gRPC connection, not the dial; or one that
// carried tunnels and then went silent with its connection open (a node gone without a FIN,
// its connection still READY to gRPC) — does not hold up a tunnel: each succeeds through the
// other replica within the bound.
func TestServerBlackholed(t *testing.T) {
	t.Run("TLS never answered", func(t *testing.T) {
		b := newBackend(t)
		hole, up := newReplica(t, b.grpc), newReplica(t, b.grpc)
		hole.hold()
		r := viaLive(t, b, hole.addr, up)
		if r.failovers() < 1 { // the first tunnel tried the hole first
			t.Errorf("no failover counted")
		}
	})
	t.Run("dial never answered", func(t *testing.T) {
		b := newBackend(t)
		silent, up := newStandIn(t, b, standInSilent), newReplica(t, b.grpc)
		r := viaLive(t, b, silent, up)
		if r.failovers() < 1 || r.attempts(silent, attemptCancelled) < 1 {
			t.Errorf("failovers %v, attempts on the silent stand-in cancelled %v: want both", r.failovers(), r.attempts(silent, attemptCancelled))
		}
	})
	t.Run("node lost while in use", func(t *testing.T) {
		r, _ := loseAfterUse(t, "held", (*replica).hold)
		// Its connection still looks READY, so the order puts it first now and then: the race
		// moves on to the other replica.
		if r.failovers() < 1 {
			t.Errorf("no failover counted")
		}
	})
}

// TestServerRefuses: a replica that refuses the dial (a DIAL_RSP with an error) or fails the
// stream (UNAVAILABLE) has the other one tried at once, and every tunnel succeeds; a dial that
// every replica refuses (a target outside the shoot) reaches kube-apiserver with the reason.
func TestServerRefuses(t *testing.T) {
	for _, mode := range []string{standInRefuses, standInUnavailable} {
		t.Run(mode, func(t *testing.T) {
			b := newBackend(t)
			refusing, up := newStandIn(t, b, mode), newReplica(t, b.grpc)
			r := viaLive(t, b, refusing, up)
			want := attemptRefused
			if mode == standInUnavailable {
				want = attemptUnavailable
			}
			if got := r.attempts(refusing, want); got < 1 {
				t.Errorf("no %s attempt counted for the refusing stand-in", want)
			}
		})
	}
	t.Run("by every server", func(t *testing.T) {
		b := newBackend(t)
		p0, p1 := newReplica(t, b.grpc), newReplica(t, b.grpc)
		r := startHA(t, b, p0.addr, p1.addr)
		_, resp, err := r.connectVia("10.0.0.1:443", http.MethodConnect, "")
		if resp == nil || resp.StatusCode != http.StatusBadGateway || !strings.Contains(err.Error(), "outside the shoot") {
			t.Errorf("CONNECT outside the shoot's networks: %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*haBound)
		defer cancel()
		if _, err := r.dial(ctx, "10.0.0.1:443"); err == nil || !strings.Contains(err.Error(), "outside the shoot") {
			t.Errorf("dial outside the shoot's networks: %v", err)
		}
		if got := r.attempts(p0.addr, attemptRefused) + r.attempts(p1.addr, attemptRefused); got != 4 {
			t.Errorf("%v refusals counted, want 4 (both replicas, two dials)", got)
		}
		if got := r.count(outcomeDialFailed); got != 1 {
			t.Errorf("dial_failed: %v, want 1 (the CONNECT)", got)
		}
	})
}

// TestAllServersDown: with one replica refusing connections and the other holding them, a
// tunnel fails within the bound with an error that names both, and is counted.
func TestAllServersDown(t *testing.T) {
	b := newBackend(t)
	down, hole := testnet.RefusedAddr(t), newReplica(t, b.grpc)
	hole.hold()
	r := startHA(t, b, down, hole.addr)
	for i := range 2 {
		start := time.Now()
		_, resp, err := r.connectVia(echoTarget, http.MethodConnect, "")
		if resp == nil || resp.StatusCode != http.StatusServiceUnavailable ||
			!strings.Contains(err.Error(), down) || !strings.Contains(err.Error(), hole.addr) {
			t.Errorf("CONNECT %d with every replica down: %v, want 503 naming both", i, err)
		}
		if d := time.Since(start); d > haBound {
			t.Errorf("CONNECT %d failed after %v, more than %v", i, d, haBound)
		}
		start = time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 2*haBound)
		if c, err := r.dial(ctx, echoTarget); err == nil {
			c.Close()
			t.Errorf("konnectivity tunnel %d with every replica down succeeded", i)
		}
		cancel()
		if d := time.Since(start); d > haBound {
			t.Errorf("konnectivity tunnel %d failed after %v, more than %v", i, d, haBound)
		}
	}
	if got := r.count(outcomeUnavailable) + r.count(outcomeTimeout); got != 4 {
		t.Errorf("%v failures counted, want 4", got)
	}
	if got := r.attempts(down, attemptUnavailable); got < 1 {
		t.Errorf("no failed attempt counted for the refusing replica")
	}
	if got := r.attempts(hole.addr, attemptTimeout) + r.attempts(hole.addr, attemptUnavailable); got < 1 {
		t.Errorf("no failed attempt counted for the holding replica")
	}
	if logs := r.logs.String(); !strings.Contains(logs, "no tendril-server answered") {
		t.Errorf("the log does not say that no server answered:\n%s", logs)
	}
}
