package apiserverproxy

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/pires/go-proxyproto"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serveEcho accepts on l until it is closed; each connection is passed to check and then echoed.
func serveEcho(t *testing.T, l net.Listener, check func(c net.Conn) (net.Conn, bool)) {
	t.Helper()
	testnet.Serve(t, l, func(c net.Conn) {
		if rc, ok := check(c); ok {
			_, _ = io.Copy(rc, rc)
		}
	})
}

// startAgent serves the agent on a loopback listener until the test ends.
func startAgent(t *testing.T, cfg Config) (*Agent, string, context.CancelFunc, chan error) {
	t.Helper()
	l := testnet.Listen(t)
	cfg.AdvertisedAddress = netip.MustParseAddr("127.0.0.1")
	cfg.Log = testr.New(t)
	cfg.CheckInterval = 20 * time.Millisecond
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return a, l.Addr().String(), cancel, done
}

func roundTrip(t *testing.T, addr, msg string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	_ = c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestProxyProtocolMode checks the header go-proxyproto's own listener reads: the destination is
// the address the client dialled, the source the client.
func TestProxyProtocolMode(t *testing.T) {
	ingress := &proxyproto.Listener{Listener: testnet.Listen(t), ReadHeaderTimeout: 2 * time.Second}
	var mu sync.Mutex
	var headers []*proxyproto.Header
	serveEcho(t, ingress, func(c net.Conn) (net.Conn, bool) {
		pc := c.(*proxyproto.Conn)
		// The header is read on the first Read; Echo does that, then we record it.
		br := bufio.NewReader(pc)
		if _, err := br.Peek(1); err != nil {
			return nil, false
		}
		mu.Lock()
		headers = append(headers, pc.ProxyHeader())
		mu.Unlock()
		return readConn{Conn: c, r: br}, true
	})
	a, addr, _, _ := startAgent(t, Config{Ingress: ingress.Addr().String()})
	got, err := roundTrip(t, addr, "hello")
	if err != nil || got != "hello" {
		t.Fatalf("through the agent: %q, %v", got, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(headers) != 1 || headers[0] == nil || headers[0].Version != 2 {
		t.Fatalf("headers %v, want one v2 header", headers)
	}
	if dst := headers[0].DestinationAddr.String(); dst != addr {
		t.Errorf("header destination %s, want the advertised address %s", dst, addr)
	}
	waitReady(t, a)
}

// readConn reads through r (which buffers c) and writes to c.
type readConn struct {
	net.Conn
	r io.Reader
}

func (c readConn) Read(b []byte) (int, error) { return c.r.Read(b) }

func waitReady(t *testing.T, a *Agent) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !a.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("the agent never became ready though the ingress accepts")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestConnectMode serves CONNECT with net/http, as a real HTTP proxy would, and checks the
// header; a refusing ingress closes the client's connection and is counted.
func TestConnectMode(t *testing.T) {
	var mu sync.Mutex
	var dests []string
	ingress := testnet.ConnectProxy(t, func(r *http.Request) bool {
		d := r.Header.Get("X-Gardener-Destination")
		mu.Lock()
		dests = append(dests, d)
		mu.Unlock()
		return r.Method == http.MethodConnect && d == APIServerDestination("shoot--a--b")
	}, func(c net.Conn, rw *bufio.ReadWriter) {
		_ = rw.Flush()
		_, _ = io.Copy(c, rw)
	})

	_, addr, _, _ := startAgent(t, Config{Ingress: ingress, Mode: ModeConnect, Namespace: "shoot--a--b"})
	got, err := roundTrip(t, addr, "hello")
	if err != nil || got != "hello" {
		t.Fatalf("through the agent: %q, %v", got, err)
	}
	reg := prometheus.NewRegistry()
	_, addr2, _, _ := startAgent(t, Config{Ingress: ingress, Mode: ModeConnect, Namespace: "shoot--other--x", Registry: reg})
	if got, _ := roundTrip(t, addr2, "hello"); got != "" {
		t.Fatalf("a refused CONNECT passed %q", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(dests) != 2 || dests[1] != APIServerDestination("shoot--other--x") {
		t.Errorf("destinations sent: %q", dests)
	}
	if n := connections(t, reg, "dial_failed"); n != 1 {
		t.Errorf("dial_failed: %v, want 1", n)
	}
}

// connections returns the connections counted with outcome in reg.
func connections(t *testing.T, reg *prometheus.Registry, outcome string) float64 {
	t.Helper()
	return metrictest.Sum(t, reg, "tendril_apiserver_proxy_connections_total", map[string]string{"outcome": outcome})
}

// proxyEcho is an ingress that skips the PROXY header and echoes.
func proxyEcho(t *testing.T) net.Listener {
	ingress := testnet.Listen(t)
	serveEcho(t, ingress, func(c net.Conn) (net.Conn, bool) {
		// Skip the 28-byte PROXY v2 header for IPv4.
		if _, err := io.ReadFull(c, make([]byte, 28)); err != nil {
			return nil, false
		}
		return c, true
	})
	return ingress
}

// TestDrain: on shutdown the agent stops accepting, and an open connection keeps working until
// it ends.
func TestDrain(t *testing.T) {
	ingress := proxyEcho(t)
	_, addr, cancel, done := startAgent(t, Config{Ingress: ingress.Addr().String(), DrainTimeout: 10 * time.Second})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	if _, err := io.WriteString(c, "one\n"); err != nil {
		t.Fatal(err)
	}
	if l, _ := br.ReadString('\n'); l != "one\n" {
		t.Fatalf("before shutdown: %q", l)
	}
	cancel()
	// The listener closes as the context ends; from then on new connections are refused.
	deadline := time.Now().Add(5 * time.Second)
	for {
		nc, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			break
		}
		nc.Close()
		if time.Now().After(deadline) {
			t.Fatal("new connections are still accepted while draining")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := io.WriteString(c, "two\n"); err != nil {
		t.Fatal(err)
	}
	if l, _ := br.ReadString('\n'); l != "two\n" {
		t.Fatalf("while draining: %q", l)
	}
	c.Close()
	select {
	case err := <-done:
		done <- err // for the cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("the agent did not stop once its last connection ended")
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Ingress: "x:1"}, "advertised address"},
		{Config{AdvertisedAddress: netip.MustParseAddr("10.0.0.1")}, "ingress"},
		{Config{AdvertisedAddress: netip.MustParseAddr("10.0.0.1"), Ingress: "x:1", Mode: ModeConnect}, "namespace"},
		{Config{AdvertisedAddress: netip.MustParseAddr("10.0.0.1"), Ingress: "x:1", Mode: "bogus"}, "unknown mode"},
		{Config{AdvertisedAddress: netip.MustParseAddr("10.0.0.1"), Ingress: "x:1", Interface: "a-very-long-link-name"}, "15 characters"},
	} {
		if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want an error about %q", tc.cfg, err, tc.want)
		}
	}
}

// echoFrom sends a line from the source address src through the agent at addr and returns its
// echo; the connection stays open until the test ends.
func echoFrom(t *testing.T, addr, src string) (string, error) {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// TestSourceLimit: a pod at its bound has its next connection closed at once and counted, while
// another pod's connection is forwarded.
func TestSourceLimit(t *testing.T) {
	ingress := proxyEcho(t)
	reg := prometheus.NewRegistry()
	_, addr, _, _ := startAgent(t, Config{Ingress: ingress.Addr().String(), MaxConnectionsPerSource: 1, Registry: reg})
	if got, err := echoFrom(t, addr, "127.0.0.1"); got != "ping\n" { // held open until the test ends
		t.Fatalf("first connection of 127.0.0.1: %q, %v", got, err)
	}
	if got, err := echoFrom(t, addr, "127.0.0.1"); got != "" || err == nil {
		t.Errorf("second connection of 127.0.0.1: %q, %v; want it closed", got, err)
	}
	if got, err := echoFrom(t, addr, "127.0.0.2"); got != "ping\n" {
		t.Errorf("another pod's connection: %q, %v", got, err)
	}
	if n := connections(t, reg, "source_limit"); n != 1 {
		t.Errorf("source_limit: %v, want 1", n)
	}
}

// TestMaxConnections: at the agent's bound the next connection is closed at once and counted,
// whatever its source.
func TestMaxConnections(t *testing.T) {
	ingress := proxyEcho(t)
	reg := prometheus.NewRegistry()
	_, addr, _, _ := startAgent(t, Config{Ingress: ingress.Addr().String(), MaxConnections: 1, Registry: reg})
	if got, err := echoFrom(t, addr, "127.0.0.1"); got != "ping\n" {
		t.Fatalf("first connection: %q, %v", got, err)
	}
	if got, err := echoFrom(t, addr, "127.0.0.2"); got != "" || err == nil {
		t.Errorf("second connection (another source): %q, %v; want it closed", got, err)
	}
	if n := connections(t, reg, "too_many"); n != 1 {
		t.Errorf("too_many: %v, want 1", n)
	}
}

// TestNoSourceCap: a negative per-source bound lifts it. One source holds one connection more
// than DefaultMaxConnectionsPerSource, all forwarded (four descriptors each in this process:
// 4,004 of the 20,000 allowed).
func TestNoSourceCap(t *testing.T) {
	ingress := proxyEcho(t)
	reg := prometheus.NewRegistry()
	_, addr, _, _ := startAgent(t, Config{Ingress: ingress.Addr().String(), MaxConnectionsPerSource: -1, Registry: reg})
	for i := range DefaultMaxConnectionsPerSource + 1 {
		if got, err := echoFrom(t, addr, "127.0.0.1"); got != "ping\n" {
			t.Fatalf("connection %d of one source: %q, %v", i+1, got, err)
		}
	}
	if n := connections(t, reg, "source_limit"); n != 0 {
		t.Errorf("source_limit: %v, want 0", n)
	}
}
