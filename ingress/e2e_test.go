package ingress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
	xdsserver "github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// world is one loopback seed: the real xDS server, a tendril ingress subscribed to it over gRPC,
// and TLS upstreams standing in for shoots' kube-apiservers, each with its own certificate.
type world struct {
	t         *testing.T
	ca        *testpki.CA
	xds       *xdsserver.Server
	in        *Ingress
	reg       *prometheus.Registry
	sni       string // the ingress SNI listener address
	proxy     string // the ingress PROXY/CONNECT listener address
	tunnel    string // the ingress reversed-VPN CONNECT listener address
	upstreams map[string]*upstream
	mu        sync.Mutex
	shoots    map[string]model.Shoot
	// stop ends the ingress's Serve (it drains as cfg says); served is closed when Serve returns.
	stop   context.CancelFunc
	served chan struct{}
}

func newWorld(t *testing.T) *world {
	t.Helper()
	return newWorldWith(t, translate.Options{}, nil)
}

// newWorldWith is newWorld for a seed with opts and an ingress trusting trusted.
func newWorldWith(t *testing.T, opts translate.Options, trusted []netip.Prefix) *world {
	t.Helper()
	return newWorldConfig(t, opts, Config{TrustedProxies: trusted})
}

// newWorldConfig is newWorld for a seed with opts and an ingress with cfg (its listeners, log
// and registry are the world's).
func newWorldConfig(t *testing.T, opts translate.Options, cfg Config) *world {
	t.Helper()
	ca, err := testpki.NewCA("tendril test CA")
	if err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, ca: ca, upstreams: map[string]*upstream{}, shoots: map[string]model.Shoot{}, reg: prometheus.NewRegistry()}
	// xDS over mutual TLS, node IDs bound to the client certificate, as on a seed.
	xdsTLS := func(name string) *tlsreload.Store {
		c, err := ca.Leaf(name)
		if err != nil {
			t.Fatal(err)
		}
		var s tlsreload.Store
		s.Set(&tlsreload.Material{Cert: c, Roots: ca.Pool})
		return &s
	}
	w.xds = xdsserver.New(xdsserver.Config{Log: testr.New(t).WithName("xds"), Options: opts,
		TLS: tlsreload.ServerConfig(xdsTLS("127.0.0.1")), Authorize: xdsserver.NodeOfCertificate})
	if _, err := w.xds.Apply(nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ictx, stop := context.WithCancel(ctx)
	w.stop, w.served = stop, make(chan struct{})
	xl := testnet.Listen(t)
	lns := map[string]net.Listener{"sni": testnet.Listen(t), "proxy": testnet.Listen(t), "tunnel": testnet.Listen(t)}
	addrs := map[string]string{}
	for n, l := range lns {
		addrs[n] = l.Addr().String()
	}
	w.sni, w.proxy, w.tunnel = addrs["sni"], addrs["proxy"], addrs["tunnel"]
	cfg.Listeners, cfg.Log, cfg.Registry = addrs, testr.New(t).WithName("ingress"), w.reg
	w.in = New(cfg)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := w.xds.Serve(ctx, xl); err != nil {
			t.Error(err)
		}
	}()
	go func() {
		defer wg.Done()
		defer close(w.served)
		err := w.in.Serve(ictx, lns, xdsclient.Config{Address: xl.Addr().String(), NodeID: "ingress-" + t.Name(),
			TLS: tlsreload.ClientConfig(xdsTLS("ingress"), "127.0.0.1"), MinBackoff: 10 * time.Millisecond})
		if err != nil {
			t.Error(err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		for _, u := range w.upstreams {
			u.close()
		}
	})
	testwait.Until(t, "first configuration", w.in.Ready)
	return w
}

// addShoot starts an upstream for shoot name with server name host and routes it.
func (w *world) addShoot(name, host string) *upstream {
	w.t.Helper()
	u := w.upstreams[name]
	if u == nil {
		u = startUpstream(w.t, w.ca, name, host)
		w.upstreams[name] = u
	}
	w.route(model.Shoot{Name: name, Hosts: []string{host}, APIServer: u.addr})
	return u
}

// route adds or replaces a shoot's route and waits until the ingress serves it.
func (w *world) route(s model.Shoot) {
	w.t.Helper()
	w.mu.Lock()
	w.shoots[s.Name] = s
	w.mu.Unlock()
	w.apply()
	testwait.Until(w.t, "route to "+s.Name, func() bool {
		c := w.in.current.Load()
		cl := c.clusters[translate.SNICluster(s.Hosts[0])]
		return cl != nil && len(c.upstreams(cl)) == 1 && c.upstreams(cl)[0] == s.APIServer
	})
}

// unroute removes a shoot's route and waits until the ingress no longer has it.
func (w *world) unroute(name string) {
	w.t.Helper()
	w.mu.Lock()
	s := w.shoots[name]
	delete(w.shoots, name)
	w.mu.Unlock()
	w.apply()
	testwait.Until(w.t, "removal of "+name, func() bool {
		_, ok := w.in.current.Load().clusters[translate.SNICluster(s.Hosts[0])]
		return !ok
	})
}

func (w *world) apply() {
	w.t.Helper()
	w.mu.Lock()
	var set []model.Shoot
	for _, s := range w.shoots {
		set = append(set, s)
	}
	w.mu.Unlock()
	model.Sort(set)
	if _, err := w.xds.Apply(set); err != nil {
		w.t.Fatal(err)
	}
}

func (w *world) connections(outcome string) float64 {
	var total float64
	for _, cl := range []string{"", "sni|api.alpha.test", "sni|api.beta.test"} {
		total += promtest.ToFloat64(w.in.metrics.connections.WithLabelValues("sni", cl, outcome))
	}
	return total
}

// upstream is a TLS server for one shoot. Requests are one line: "who" answers the shoot's name;
// "bulk N" sends N pseudo-random bytes from a fixed seed, which the client regenerates to compare.
type upstream struct {
	name string
	addr netip.AddrPort
	l    net.Listener
	wg   sync.WaitGroup
}

func startUpstream(t *testing.T, ca *testpki.CA, name, host string) *upstream {
	t.Helper()
	cert, err := ca.Leaf(host)
	if err != nil {
		t.Fatal(err)
	}
	l := testnet.Listen(t)
	u := &upstream{name: name, addr: netip.MustParseAddrPort(l.Addr().String()), l: l}
	tl := tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}})
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			u.wg.Add(1)
			go func() {
				defer u.wg.Done()
				defer c.Close()
				u.serve(c)
			}()
		}
	}()
	return u
}

func (u *upstream) serve(c net.Conn) {
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	switch f := strings.Fields(line); {
	case len(f) == 3 && f[0] == "GET": // a real HTTP client, e.g. curl
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(u.name), u.name)
	case len(f) == 1 && f[0] == "who":
		fmt.Fprintln(c, u.name)
	case len(f) == 2 && f[0] == "bulk":
		n, _ := strconv.ParseInt(f[1], 10, 64)
		_, _ = io.Copy(c, io.LimitReader(pattern(), n))
	}
}

func (u *upstream) close() {
	u.l.Close()
	u.wg.Wait()
}

// pattern is the deterministic byte stream of bulk transfers.
func pattern() io.Reader { return &prng{r: rand.New(rand.NewPCG(1, 2))} }

type prng struct{ r *rand.Rand }

func (p *prng) Read(b []byte) (int, error) {
	for i := range b {
		b[i] = byte(p.r.Uint32())
	}
	return len(b), nil
}

// dial connects through the ingress with server name sni, verifying the certificate for host.
func (w *world) dial(sni, verifyHost string) (*tls.Conn, error) {
	c, err := net.DialTimeout("tcp", w.sni, 5*time.Second)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	// Verification is done by hand so that a hello without a server name can be sent at all
	// (Go's client refuses to verify without one); the certificate must match verifyHost.
	tc := tls.Client(c, &tls.Config{ServerName: sni, InsecureSkipVerify: true, VerifyConnection: func(cs tls.ConnectionState) error {
		if verifyHost == "" {
			return nil
		}
		inter := x509.NewCertPool()
		for _, ic := range cs.PeerCertificates[1:] {
			inter.AddCert(ic)
		}
		_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: w.ca.Pool, Intermediates: inter, DNSName: verifyHost})
		return err
	}})
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, err
	}
	return tc, nil
}

func (w *world) who(sni string) (string, error) {
	c, err := w.dial(sni, strings.ToLower(sni))
	if err != nil {
		return "", err
	}
	defer c.Close()
	fmt.Fprintln(c, "who")
	b, err := io.ReadAll(c)
	return strings.TrimSpace(string(b)), err
}

func TestSNIRoutesToTheRightShoot(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	w.addShoot("shoot--t--beta", "api.beta.test")

	for sni, want := range map[string]string{
		"api.alpha.test": "shoot--t--alpha",
		"api.beta.test":  "shoot--t--beta",
		// tendril-ingress matches server names lower-case.
		"API.Beta.TEST": "shoot--t--beta",
	} {
		got, err := w.who(sni)
		if err != nil || got != want {
			t.Errorf("%s: reached %q (%v), want %s", sni, got, err, want)
		}
	}
	// An unknown name and a hello without server name are refused: the connection is closed
	// before any upstream is dialled, so the handshake fails.
	if _, err := w.who("api.gamma.test"); err == nil {
		t.Error("unknown server name was proxied")
	}
	if c, err := w.dial("", ""); err == nil {
		c.Close()
		t.Error("a ClientHello without SNI was proxied")
	}
	if got := w.connections(outcomeUnknownRoute); got != 2 {
		t.Errorf("unknown_route connections: %v, want 2", got)
	}
	if got := w.connections(outcomeProxied); got != 3 {
		t.Errorf("proxied connections: %v, want 3", got)
	}
}

func TestOpenSSLClient(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Fatal("openssl is not on PATH; install it (Debian package openssl, see .ci/run)")
	}
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	w.addShoot("shoot--t--beta", "api.beta.test")
	caFile := t.TempDir() + "/ca.pem"
	if err := w.ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]string{"api.alpha.test": "shoot--t--alpha", "api.beta.test": "shoot--t--beta"} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		cmd := exec.CommandContext(ctx, "openssl", "s_client", "-connect", w.sni, "-servername", host,
			"-CAfile", caFile, "-verify_hostname", host, "-verify_return_error", "-quiet")
		cmd.Stdin = strings.NewReader("who\n")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		cancel()
		if err != nil {
			t.Fatalf("openssl s_client -servername %s: %v\n%s", host, err, stderr.String())
		}
		if got := strings.TrimSpace(string(out)); got != want {
			t.Errorf("openssl -servername %s reached %q, want %s", host, got, want)
		}
	}
}

// TestRouteChurnDuringTransfer adds and removes shoot B 100 times while a large transfer from
// shoot A is in flight; A's bytes must arrive complete and unchanged.
func TestRouteChurnDuringTransfer(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	const size = 64 << 20
	c, err := w.dial("api.alpha.test", "api.alpha.test")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "bulk %d\n", size)
	h := sha256.New()
	// Read a first part, then churn while most of the transfer is still unread.
	if _, err := io.CopyN(h, c, 1<<20); err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		w.addShoot("shoot--t--beta", "api.beta.test")
		if i%10 == 0 {
			if got, err := w.who("api.beta.test"); err != nil || got != "shoot--t--beta" {
				t.Fatalf("round %d: B reached %q (%v)", i, got, err)
			}
		}
		w.unroute("shoot--t--beta")
	}
	n, err := io.Copy(h, c)
	if err != nil {
		t.Fatal(err)
	}
	if n+1<<20 != size {
		t.Fatalf("A received %d bytes, want %d", n+1<<20, size)
	}
	want := sha256.New()
	_, _ = io.CopyN(want, pattern(), size)
	if !bytes.Equal(h.Sum(nil), want.Sum(nil)) {
		t.Fatal("A's transfer arrived changed")
	}
}

// TestRemovedRouteDrains removes a shoot while one of its connections is open: new connections
// are refused at once, the open one completes.
func TestRemovedRouteDrains(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	const size = 8 << 20
	c, err := w.dial("api.alpha.test", "api.alpha.test")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "bulk %d\n", size)
	if _, err := io.CopyN(io.Discard, c, 1<<20); err != nil {
		t.Fatal(err)
	}
	w.unroute("shoot--t--alpha")
	if _, err := w.who("api.alpha.test"); err == nil {
		t.Fatal("a removed shoot accepted a new connection")
	}
	n, err := io.Copy(io.Discard, c)
	if err != nil || n != size-1<<20 {
		t.Fatalf("the open connection got %d more bytes (%v), want %d", n, err, size-1<<20)
	}
}

// TestBadInput sends what a broken or hostile client sends; each connection is closed, and good
// clients are served throughout.
func TestBadInput(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	hello := captureHello(t, "api.alpha.test")

	for name, input := range map[string][]byte{
		"plain HTTP":          []byte("GET / HTTP/1.1\r\nHost: api.alpha.test\r\n\r\n"),
		"truncated hello":     hello[:len(hello)/2],
		"garbage":             bytes.Repeat([]byte{0x16, 0x03, 0x01, 0xff, 0xff}, 10),
		"hello, wrong type":   append([]byte{0x17}, hello[1:]...),
		"empty then close":    nil,
		"oversize record len": {0x16, 0x03, 0x01, 0x48, 0x01, 0x01},
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("tcp", w.sni)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_, _ = c.Write(input)
			_ = c.(*net.TCPConn).CloseWrite()
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			b, err := io.ReadAll(c)
			if len(b) != 0 || err != nil && !isReset(err) {
				t.Fatalf("got %d bytes and %v, want the connection closed", len(b), err)
			}
		})
	}
	if got, err := w.who("api.alpha.test"); err != nil || got != "shoot--t--alpha" {
		t.Fatalf("good client after bad input: %q, %v", got, err)
	}
}

// TestSlowHellos opens 1,000 connections that never finish their ClientHello. Good clients are
// served meanwhile; each slow one is closed at the ClientHello deadline (10 s), and nothing
// leaks (TestMain checks goroutines after all tests).
func TestSlowHellos(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	w.addShoot("shoot--t--alpha", "api.alpha.test")
	hello := captureHello(t, "api.alpha.test")
	const n = 1000
	start := time.Now()
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// The slow clients come from 127.0.0.2, the good ones from 127.0.0.1: 1,000 is one source's
	// whole pending limit (DefaultMaxPendingPerSource).
	slow := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	for range n {
		c, err := slow.Dial("tcp", w.sni)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write(hello[:20]); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 20 {
		if got, err := w.who("api.alpha.test"); err != nil || got != "shoot--t--alpha" {
			t.Fatalf("good client %d during the slow flood: %q, %v", i, got, err)
		}
	}
	var wg sync.WaitGroup
	closedAt := make([]time.Duration, n)
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			_, err := io.ReadAll(c)
			if err != nil && !isReset(err) {
				t.Errorf("slow connection %d: %v, want closed by the ingress", i, err)
			}
			closedAt[i] = time.Since(start)
		}()
	}
	wg.Wait()
	for i, d := range closedAt {
		if d < translate.ClientHelloTimeout-time.Second {
			t.Fatalf("slow connection %d closed after %v, before the %v deadline", i, d, translate.ClientHelloTimeout)
		}
	}
	if got := w.connections(outcomeHelloTimeout); got != n {
		t.Errorf("client_hello_timeout connections: %v, want %d", got, n)
	}
	testwait.Until(t, "pending count back to zero", func() bool { return w.in.pending.count() == 0 })
}

func isReset(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "connection reset") || strings.Contains(err.Error(), "broken pipe"))
}

// captureHello returns the ClientHello Go's TLS client sends for host.
func captureHello(t *testing.T, host string) []byte {
	t.Helper()
	a, b := net.Pipe()
	go func() {
		_ = tls.Client(a, &tls.Config{ServerName: host}).Handshake()
		a.Close()
	}()
	_ = b.SetReadDeadline(time.Now().Add(5 * time.Second))
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(b, hdr); err != nil {
		t.Fatal(err)
	}
	body := make([]byte, int(hdr[3])<<8|int(hdr[4]))
	if _, err := io.ReadFull(b, body); err != nil {
		t.Fatal(err)
	}
	b.Close()
	return append(hdr, body...)
}

// TestDialMovesToTheNextEndpoint: of a shoot's two kube-apiserver endpoints one refuses
// connections (a replica that went away but is still listed): every connection reaches the other,
// each failed dial counted as a retry. A shoot whose endpoints all refuse gets its connection
// refused after translate.ConnectAttempts dials.
func TestDialMovesToTheNextEndpoint(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	// A dial is refused at once (testnet.RefusedAddr: bound, never listening).
	refusing := func() netip.AddrPort { return netip.MustParseAddrPort(testnet.RefusedAddr(t)) }
	const alpha, beta = "shoot--t--alpha", "shoot--t--beta"
	u := startUpstream(t, w.ca, alpha, "api.alpha.test")
	w.upstreams[alpha] = u
	w.mu.Lock()
	w.shoots[alpha] = model.Shoot{Name: alpha, Hosts: []string{"api.alpha.test"}, APIServers: []netip.AddrPort{u.addr, refusing()}}
	w.shoots[beta] = model.Shoot{Name: beta, Hosts: []string{"api.beta.test"}, APIServers: []netip.AddrPort{refusing(), refusing()}}
	w.mu.Unlock()
	w.apply()
	testwait.Until(t, "both shoots with two endpoints", func() bool {
		c := w.in.current.Load()
		for _, h := range []string{"api.alpha.test", "api.beta.test"} {
			if cl := c.clusters[translate.SNICluster(h)]; cl == nil || len(c.upstreams(cl)) != 2 {
				return false
			}
		}
		return true
	})

	const n = 10
	for i := range n {
		if got, err := w.who("api.alpha.test"); err != nil || got != alpha {
			t.Fatalf("connection %d: reached %q (%v), want %s", i, got, err, alpha)
		}
	}
	retries := func(host string) float64 {
		return promtest.ToFloat64(w.in.metrics.retries.WithLabelValues("sni", translate.SNICluster(host), outcomeDialFailed))
	}
	// Round robin over two endpoints: at least every other connection tried the refusing one
	// first (all of them, if each retry's step lines them up that way).
	if r := retries("api.alpha.test"); r < n/2 || r > n {
		t.Errorf("alpha: %v retries for %d connections, want %d to %d", r, n, n/2, n)
	}
	if got := w.connections(outcomeDialFailed); got != 0 {
		t.Errorf("alpha: %v connections refused, want none", got)
	}

	if _, err := w.who("api.beta.test"); err == nil {
		t.Fatal("beta: a connection got through although every endpoint refuses")
	}
	testwait.Until(t, "beta's refusal counted", func() bool { return w.connections(outcomeDialFailed) == 1 })
	if r := retries("api.beta.test"); r != translate.ConnectAttempts-1 {
		t.Errorf("beta: %v retries, want %d (one connection, %d attempts)", r, translate.ConnectAttempts-1, translate.ConnectAttempts)
	}
}
