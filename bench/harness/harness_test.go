package harness

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/bench/internal/benchtest"
	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/xds/translate"
)

// testMode is an sni mode with direct and HAProxy only: package sni's own
// Mode would import this package.
var testMode = Mode{
	Name:    "test",
	Targets: []string{TargetDirect, TargetHAProxy},
	Peer: func(string, Config) Peer {
		return Peer{Peer: peers.HAProxy{Job: peers.JobSNI}, Static: true}
	},
}

// to is a target that reaches every shoot at addr.
func to(addr string, p Preamble) *target {
	return &target{name: "test", addr: func(int) string { return addr }, preamble: p}
}

func reasonOf(err error) string {
	var ce *connError
	if !errors.As(err, &ce) {
		return "none"
	}
	return ce.reason.String()
}

func testRoutes(n int) []peers.Route {
	var rs []peers.Route
	for i := range n {
		rs = append(rs, peers.Route{Name: ShootName(i), Host: ShootHost(i), Upstream: "127.0.0.1:1", Advertised: ShootAdvertised(i)})
	}
	return rs
}

// TestRunCancel checks that cancelling a run stops it promptly, stops the
// peers and returns the measurements completed so far.
func TestRunCancel(t *testing.T) {
	benchtest.LeakCheck(t)
	targets, _ := testMode.Installed(context.Background(), Config{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Cancel as soon as the first measurement has reported its result (its line carries
	// "conn/s,"), so the second is interrupted however slow the machine is.
	progress := cancelOn{w: benchtest.Log{T: t}, marker: "conn/s,", cancel: cancel}
	cfg := Config{Targets: targets, Concurrency: []int{2}, Duration: 400 * time.Millisecond,
		Warmup: 50 * time.Millisecond, Progress: &progress}
	start := time.Now()
	rep, err := Run(ctx, testMode, cfg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	t.Logf("Run returned %v after it started", time.Since(start)) // timings belong in benchmarks
	if rep == nil || !rep.Partial || rep.Note == "" {
		t.Fatalf("report not marked partial: %+v", rep)
	}
	if len(rep.Rate) == 0 {
		t.Errorf("no completed measurement in the partial report (note: %s)", rep.Note)
	}
}

// cancelOn passes progress lines on and calls cancel at the first one containing marker.
type cancelOn struct {
	w      io.Writer
	marker string
	cancel context.CancelFunc
	once   sync.Once
}

func (c *cancelOn) Write(p []byte) (int, error) {
	if strings.Contains(string(p), c.marker) {
		c.once.Do(c.cancel)
	}
	return c.w.Write(p)
}

// TestClientVerifies checks the client's error classification: an untrusted
// CA and a certificate for another host fail verification, a ClientHello for
// another shoot is refused by the upstream and counted as misrouted.
func TestClientVerifies(t *testing.T) {
	benchtest.LeakCheck(t)
	hosts := []string{ShootHost(0), ShootHost(1)}
	p, err := newPKI(hosts)
	if err != nil {
		t.Fatal(err)
	}
	other, err := newPKI(hosts)
	if err != nil {
		t.Fatal(err)
	}
	ups, err := startUpstreams(p, hosts, 64, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer ups.Close()
	ctx := context.Background()
	buf := make([]byte, 65)

	good := newClient(p, testRoutes(2), 64, 1)
	var s inflight.Slot
	if _, err := good.fetchSmall(ctx, to(ups[1].addr(), PreambleNone), 1, &s, buf, nil); err != nil {
		t.Fatalf("good client: %v", err)
	}

	untrusted := newClient(other, testRoutes(2), 64, 1)
	if _, err := untrusted.fetchSmall(ctx, to(ups[0].addr(), PreambleNone), 0, &s, buf, nil); reasonOf(err) != "verify" {
		t.Errorf("untrusted CA: %v, want a verify error", err)
	}

	// Shoot 1's name sent to shoot 0's upstream: refused at the handshake.
	if _, err := good.fetchSmall(ctx, to(ups[0].addr(), PreambleNone), 1, &s, buf, nil); reasonOf(err) != "handshake" {
		t.Errorf("misrouted ClientHello: %v, want a handshake error", err)
	}
	if n := ups[0].misrouted.Load(); n != 1 {
		t.Errorf("upstream 0 counted %d misrouted ClientHellos, want 1", n)
	}

	// A server that answers any name with shoot 0's certificate: the
	// client asking for shoot 1 must reject the certificate's host name.
	addr := serveOnce(t, func(c net.Conn) {
		tls.Server(c, &tls.Config{Certificates: []tls.Certificate{p.certs[0]}}).Handshake()
	})
	if _, err := good.fetchSmall(ctx, to(addr, PreambleNone), 1, &s, buf, nil); reasonOf(err) != "verify" ||
		!strings.Contains(err.Error(), ShootHost(1)) {
		t.Errorf("certificate for another host: %v, want a verify error naming %s", err, ShootHost(1))
	}
}

// serveOnce accepts one connection on a fresh loopback port and hands it to
// handle, which returns before the test ends; the connection is closed
// afterwards.
func serveOnce(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	ln := testnet.Listen(t)
	served := make(chan struct{})
	go func() {
		defer close(served)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		handle(c)
	}()
	t.Cleanup(func() { ln.Close(); <-served })
	return ln.Addr().String()
}

// TestPreambles checks what the client sends before TLS: the PROXY v2
// header names the shoot's advertised address:443, the CONNECT names the
// shoot in X-Gardener-Destination, and TLS follows each.
func TestPreambles(t *testing.T) {
	benchtest.LeakCheck(t)
	hosts := []string{ShootHost(0), ShootHost(1)}
	p, err := newPKI(hosts)
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(p, testRoutes(2), 64, 1)
	answer := smallPayload(1, 64)
	// serveTLS completes shoot 1's side of the exchange after the preamble.
	serveTLS := func(conn net.Conn, br *bufio.Reader) {
		tc := tls.Server(readerConn{conn, br}, &tls.Config{Certificates: []tls.Certificate{p.certs[1]}})
		var req [1]byte
		if _, err := io.ReadFull(tc, req[:]); err != nil {
			t.Errorf("request: %v", err)
			return
		}
		tc.Write(answer)
		tc.Close()
	}
	buf := make([]byte, 65)
	var s inflight.Slot

	addr := serveOnce(t, func(conn net.Conn) {
		br := bufio.NewReader(conn)
		h, err := proxyproto.Read(br)
		if err != nil {
			t.Errorf("PROXY header: %v", err)
			return
		}
		if h.Version != 2 || h.DestinationAddr.String() != "240.0.0.2:443" || h.TransportProtocol != proxyproto.TCPv4 {
			t.Errorf("PROXY header v%d %v → %v (%v), want v2 to 240.0.0.2:443", h.Version, h.SourceAddr, h.DestinationAddr, h.TransportProtocol)
		}
		serveTLS(conn, br)
	})
	if _, err := c.fetchSmall(context.Background(), to(addr, PreambleProxyV2), 1, &s, buf, nil); err != nil {
		t.Errorf("through a PROXY header: %v", err)
	}

	addr = serveOnce(t, func(conn net.Conn) {
		br := bufio.NewReader(conn)
		req, err := http.ReadRequest(br)
		if err != nil {
			t.Errorf("CONNECT request: %v", err)
			return
		}
		if want := "outbound|443||kube-apiserver.shoot--bench--s1.svc.cluster.local"; req.Method != http.MethodConnect ||
			req.Host != ShootHost(1)+":443" || req.Header.Get("X-Gardener-Destination") != want {
			t.Errorf("request %s %s, X-Gardener-Destination %q; want CONNECT %s:443, %q", req.Method, req.Host,
				req.Header.Get("X-Gardener-Destination"), ShootHost(1), want)
		}
		io.WriteString(conn, "HTTP/1.1 200 Connection established\r\n\r\n")
		serveTLS(conn, br)
	})
	if _, err := c.fetchSmall(context.Background(), to(addr, PreambleConnect), 1, &s, buf, nil); err != nil {
		t.Errorf("through CONNECT: %v", err)
	}
}

// readerConn is a connection whose reads come from a buffered reader that
// may hold bytes read past a preamble.
type readerConn struct {
	net.Conn
	r io.Reader
}

func (c readerConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// TestConnectAnswers checks how the client classifies answers to CONNECT.
func TestConnectAnswers(t *testing.T) {
	benchtest.LeakCheck(t)
	for _, tc := range []struct {
		answer, reason, text string
	}{
		{"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nConnection: close\r\n\r\nnope\n", "status", `"HTTP/1.1 503 Service Unavailable"`},
		{"HTTP/1.1 400 Bad Request\r\n", "status", "400"},                          // closed inside the header
		{"HTTP/1.1 200 Connection established\r\n\r\nextra", "connect", "5 bytes"}, // bytes before the ClientHello
		{"HTTP/1.1 200 Conn", "connect", "after 17 bytes"},                         // cut short
		{"SSH-2.0-OpenSSH\r\n\r\n", "connect", "malformed"},
		{"", "connect", "EOF"},
		{"HTTP/1.1 200 Connection established\r\n\r\n", "handshake", ""}, // then the server closes
	} {
		addr := serveOnce(t, func(c net.Conn) {
			bufio.NewReader(c).ReadString('\n') // the request line
			io.WriteString(c, tc.answer)
		})
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		cl := newClient(&pki{}, testRoutes(1), 64, 1)
		cl.shoots[0].tls = &tls.Config{ServerName: ShootHost(0)}
		err = cl.sendPreamble(c, PreambleConnect, 0)
		if err == nil && tc.reason == "handshake" {
			err = fail(reasonHandshake, tls.Client(c, cl.shoots[0].tls).Handshake())
		}
		c.Close()
		if reasonOf(err) != tc.reason || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("answer %q: %v, want a %s error containing %q", tc.answer, err, tc.reason, tc.text)
		}
	}
	for line, want := range map[string]int{"HTTP/1.1 200 Connection established": 200, "HTTP/1.0 502": 502, "HTTP/1.1 503 x\r": 503,
		"HTTP/2 200": 0, "HTTP/1.1 20": 0, "HTTP/1.1 2000 x": 0, "http/1.1 200 x": 0} {
		if got, ok := statusCode(line); got != want || ok != (want != 0) {
			t.Errorf("statusCode(%q) = %d, %v; want %d", line, got, ok, want)
		}
	}
}

// TestNames checks the run's names against tendril's own: the CONNECT header
// value is the cluster tendril's xDS translation makes for the shoot.
func TestNames(t *testing.T) {
	if got, want := peers.GardenerDestination(ShootName(3)), translate.APIServerWireName(ShootName(3)); got != want {
		t.Errorf("GardenerDestination = %q, tendril's wire name %q", got, want)
	}
	if peers.GardenerDestinationHeader != translate.GardenerDestinationHeader || peers.APIServerPort != translate.APIServerPort {
		t.Errorf("header %s port %d, tendril's %s %d", peers.GardenerDestinationHeader, peers.APIServerPort,
			translate.GardenerDestinationHeader, translate.APIServerPort)
	}
	for i, want := range map[int]string{0: "240.0.0.1", 254: "240.0.0.255", 255: "240.0.1.0", 999: "240.0.3.232"} {
		if got := ShootAdvertised(i); got != netip.MustParseAddr(want) {
			t.Errorf("ShootAdvertised(%d) = %v, want %s", i, got, want)
		}
	}
}

func TestSmallPayloadNamesShoot(t *testing.T) {
	a, b := smallPayload(1, 64), smallPayload(12, 64)
	if len(a) != 64 || len(b) != 64 || bytes.Equal(a, b) || !bytes.HasPrefix(b, []byte("tendril-bench upstream s12\n")) {
		t.Errorf("payloads %q, %q", a, b)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{
		{Targets: []string{"envoy"}},
		{Targets: []string{TargetNginx}}, // not a target of testMode
		{Targets: []string{TargetDirect, TargetDirect}},
		{Concurrency: []int{0}},
		{Concurrency: []int{16, 16}},
		{Modes: []string{"latency"}},
		{Payload: 8},
	} {
		c.setDefaults(testMode)
		if err := c.validate(testMode); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
	var c Config
	c.setDefaults(testMode)
	if err := c.validate(testMode); err != nil {
		t.Errorf("defaults rejected: %v", err)
	}
	if c.Warmup != time.Second || c.Shoots != 4 || c.BulkBytes != 64<<20 || len(c.Targets) != 2 {
		t.Errorf("defaults: %+v", c)
	}
}

// TestProxyHeaderIPv6 checks the header for an IPv6 advertised address: the
// source is of the same family, which PROXY v2 requires.
func TestProxyHeaderIPv6(t *testing.T) {
	r := testRoutes(1)
	r[0].Advertised = netip.MustParseAddr("fd00:240::a")
	c := newClient(&pki{}, r, 64, 1)
	h, err := proxyproto.Read(bufio.NewReader(bytes.NewReader(c.shoots[0].proxyHeader)))
	if err != nil {
		t.Fatal(err)
	}
	if h.TransportProtocol != proxyproto.TCPv6 || h.DestinationAddr.String() != "[fd00:240::a]:443" {
		t.Errorf("header %v → %v (%v), want TCPv6 to [fd00:240::a]:443", h.SourceAddr, h.DestinationAddr, h.TransportProtocol)
	}
}
