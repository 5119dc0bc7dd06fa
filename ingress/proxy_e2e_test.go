package ingress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/pires/go-proxyproto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// inClusterWorldWith is inClusterWorld behind a load balancer that sends its own PROXY header.
func inClusterWorldWith(t *testing.T, trusted []netip.Prefix) *world {
	t.Helper()
	w := newWorldWith(t, translate.Options{LBProxyProtocol: true, ProxyProtocol: true}, trusted)
	u := startUpstream(t, w.ca, "shoot--t--alpha", "api.alpha.test")
	w.upstreams["shoot--t--alpha"] = u
	w.route(model.Shoot{Name: "shoot--t--alpha", Hosts: []string{"api.alpha.test"}, APIServer: u.addr, AdvertisedAddress: netip.MustParseAddr("240.0.0.1")})
	testwait.Until(t, "proxy cluster", func() bool {
		return w.in.current.Load().clusters[translate.ProxyCluster(netip.MustParseAddr("240.0.0.1"))] != nil
	})
	return w
}

// inClusterWorld has two shoots with advertised addresses and vpn servers (plain TCP echo
// servers that prefix their name), and a third shoot without either.
func inClusterWorld(t *testing.T) (*world, map[string]string) {
	t.Helper()
	return inClusterWorldConfig(t, Config{})
}

// inClusterWorldConfig is inClusterWorld with an ingress configured by cfg.
func inClusterWorldConfig(t *testing.T, cfg Config) (*world, map[string]string) {
	t.Helper()
	w := newWorldConfig(t, translate.Options{ProxyProtocol: true}, cfg)
	vpn := map[string]string{}
	for i, n := range []string{"alpha", "beta"} {
		name := "shoot--t--" + n
		u := startUpstream(t, w.ca, name, "api."+n+".test")
		w.upstreams[name] = u
		v := startEcho(t, "vpn-"+n)
		vpn[name] = v.String()
		w.route(model.Shoot{Name: name, Hosts: []string{"api." + n + ".test"}, APIServer: u.addr,
			AdvertisedAddress: netip.AddrFrom4([4]byte{240, 0, 0, byte(i + 1)}), VPNServer: v})
	}
	w.addShoot("shoot--t--gamma", "api.gamma.test")
	testwait.Until(t, "vpn clusters", func() bool {
		c := w.in.current.Load()
		return c.clusters[translate.TendrilServerWireName("shoot--t--beta")] != nil && c.clusters[translate.ProxyCluster(netip.MustParseAddr("240.0.0.2"))] != nil
	})
	return w, vpn
}

// startEcho serves plain TCP: each connection gets "<name>\n" and then its own bytes back; a
// request line starting with GET gets an HTTP answer with the name, for real HTTP clients.
func startEcho(t *testing.T, name string) netip.AddrPort {
	t.Helper()
	l := testnet.Listen(t)
	testnet.Serve(t, l, func(c net.Conn) {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		// A client that speaks first with GET is an HTTP client; anyone else is greeted.
		br := bufio.NewReader(c)
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		first, err := br.Peek(3)
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if err == nil && string(first) == "GET" {
			req, err := http.ReadRequest(br)
			if err == nil {
				req.Body.Close()
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(name), name)
			}
			return
		}
		fmt.Fprintln(c, name)
		_, _ = io.Copy(c, br)
	})
	return netip.MustParseAddrPort(l.Addr().String())
}

// whoVia completes TLS for host over c (already routed by the caller) and asks who answers.
func (w *world) whoVia(c net.Conn, host string) (string, error) {
	tc := tls.Client(c, &tls.Config{ServerName: host, RootCAs: w.ca.Pool})
	if err := tc.Handshake(); err != nil {
		return "", err
	}
	fmt.Fprintln(tc, "who")
	b, err := io.ReadAll(tc)
	return strings.TrimSpace(string(b)), err
}

func dialProxy(t *testing.T, w *world, version byte, dst string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", w.proxy, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	h := proxyproto.HeaderProxyFromAddrs(version, &net.TCPAddr{IP: net.ParseIP("10.250.0.7"), Port: 40000}, net.TCPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
	if _, err := h.WriteTo(c); err != nil {
		t.Fatal(err)
	}
	return c
}

func TestProxyProtocolRoutesByDestination(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	for _, tc := range []struct {
		version byte
		dst     string
		host    string
		want    string
	}{
		{2, "240.0.0.1:443", "api.alpha.test", "shoot--t--alpha"},
		{1, "240.0.0.2:443", "api.beta.test", "shoot--t--beta"},
		{2, "240.0.0.2:443", "api.beta.test", "shoot--t--beta"},
		// An advertised address no shoot has, and one on another port: refused.
		{2, "240.0.0.9:443", "api.alpha.test", ""},
		{2, "240.0.0.1:80", "api.alpha.test", ""},
	} {
		c := dialProxy(t, w, tc.version, tc.dst)
		got, err := w.whoVia(c, tc.host)
		c.Close()
		if tc.want == "" {
			if err == nil {
				t.Errorf("v%d to %s reached %q, want refused", tc.version, tc.dst, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("v%d to %s: %q, %v; want %s", tc.version, tc.dst, got, err, tc.want)
		}
	}
	if n := promtestConn(t, w, "proxy", outcomeUnknownRoute); n != 1 {
		t.Errorf("unknown_route: %v, want 1 (the unknown advertised address)", n)
	}
}

// connectRequest sends a CONNECT with the given headers and returns the response and the
// connection positioned after it.
func connectRequest(t *testing.T, addr string, headers ...string) (*http.Response, net.Conn) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	var b strings.Builder
	b.WriteString("CONNECT kube-apiserver:443 HTTP/1.1\r\nHost: kube-apiserver:443\r\n")
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("\r\n")
	if _, err := io.WriteString(c, b.String()); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("CONNECT with %q: %v", headers, err)
	}
	if resp.StatusCode == http.StatusOK && br.Buffered() > 0 {
		t.Fatalf("the ingress sent %d bytes after its 200", br.Buffered())
	}
	return resp, c
}

func TestConnectStatusCodes(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	gd := translate.GardenerDestinationHeader + ": "
	rv := translate.ReversedVPNHeader + ": "
	deadAddr := netip.MustParseAddrPort(testnet.RefusedAddr(t)) // a vpn server that refuses
	w.route(model.Shoot{Name: "shoot--t--delta", Hosts: []string{"api.delta.test"}, APIServer: deadAddr, VPNServer: deadAddr})

	for _, tc := range []struct {
		name    string
		addr    string
		headers []string
		status  int
	}{
		{"no header", w.proxy, nil, 400},
		{"malformed", w.proxy, []string{gd + "sni|api.alpha.test"}, 400},
		{"another listener's cluster", w.proxy, []string{gd + "proxy|240.0.0.1:443"}, 400},
		{"header twice", w.proxy, []string{gd + translate.APIServerWireName("shoot--t--alpha"), gd + translate.APIServerWireName("shoot--t--beta")}, 400},
		{"unknown shoot", w.proxy, []string{gd + translate.APIServerWireName("shoot--t--nope")}, 503},
		{"vpn of a shoot without one", w.proxy, []string{gd + translate.TendrilServerWireName("shoot--t--gamma")}, 503},
		{"upstream refuses", w.proxy, []string{gd + translate.APIServerWireName("shoot--t--delta")}, 502},
		{"tunnel: wrong header", w.tunnel, []string{gd + translate.TendrilServerWireName("shoot--t--alpha")}, 400},
		{"tunnel: kube-apiserver", w.tunnel, []string{rv + translate.APIServerWireName("shoot--t--alpha")}, 400},
		{"tunnel: refused vpn server", w.tunnel, []string{rv + translate.TendrilServerWireName("shoot--t--delta")}, 502},
	} {
		resp, c := connectRequest(t, tc.addr, tc.headers...)
		c.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: %s, want %d", tc.name, resp.Status, tc.status)
		}
	}
	// Not CONNECT at all.
	r, err := http.Get("http://" + w.proxy + "/")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %s, want 405", r.Status)
	}
}

func TestConnectReachesShoots(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	gd := translate.GardenerDestinationHeader + ": "
	// kube-apiserver through the unified port: TLS end to end.
	resp, c := connectRequest(t, w.proxy, gd+translate.APIServerWireName("shoot--t--beta"))
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT to beta's kube-apiserver: %s", resp.Status)
	}
	if got, err := w.whoVia(c, "api.beta.test"); err != nil || got != "shoot--t--beta" {
		t.Fatalf("through CONNECT: %q, %v", got, err)
	}
	c.Close()
	// The vpn server through both ports, with both header generations.
	for addr, header := range map[string]string{w.proxy: translate.GardenerDestinationHeader, w.tunnel: translate.ReversedVPNHeader} {
		resp, c := connectRequest(t, addr, header+": "+translate.TendrilServerWireName("shoot--t--alpha"))
		if resp.StatusCode != 200 {
			t.Fatalf("%s to alpha's vpn server: %s", header, resp.Status)
		}
		br := bufio.NewReader(c)
		if line, _ := br.ReadString('\n'); line != "vpn-alpha\n" {
			t.Fatalf("%s reached %q, want vpn-alpha", header, line)
		}
		payload := bytes.Repeat([]byte("tendril"), 100000)
		go func() { _, _ = c.Write(payload) }()
		got := make([]byte, len(payload))
		if _, err := io.ReadFull(br, got); err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("%s: echo through the tunnel differs (%v)", header, err)
		}
		c.Close()
	}
}

// TestCurlProxyTunnel drives the CONNECT listeners with curl, a real HTTP proxy client, and both
// header generations.
func TestCurlProxyTunnel(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl is not on PATH; install it (Debian package curl, see .ci/run)")
	}
	w, _ := inClusterWorld(t)
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := w.ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "curl", append([]string{"-sS", "--fail", "--noproxy", ""}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("curl %q: %v\n%s", args, err, out)
		}
		return string(out)
	}
	got := run("-p", "-x", "http://"+w.proxy, "--proxy-header", translate.GardenerDestinationHeader+": "+translate.APIServerWireName("shoot--t--alpha"),
		"--cacert", caFile, "https://api.alpha.test/")
	if got != "shoot--t--alpha" {
		t.Errorf("curl via X-Gardener-Destination: %q", got)
	}
	got = run("-p", "-x", "http://"+w.tunnel, "--proxy-header", translate.ReversedVPNHeader+": "+translate.TendrilServerWireName("shoot--t--beta"), "http://vpn.test/")
	if got != "vpn-beta" {
		t.Errorf("curl via Reversed-VPN: %q", got)
	}
}

// TestProxyBadInput: each bad connection is closed at its limit and counted; good clients are
// served meanwhile.
func TestProxyBadInput(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	start := time.Now()

	// A PROXY v2 header sent byte by byte and never finished: closed at the 2 s header deadline.
	slow, err := net.Dial("tcp", w.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	for _, b := range proxyproto.SIGV2[:8] {
		if _, err := slow.Write([]byte{b}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A v2 header claiming 65535 bytes of addresses and TLVs: refused at once.
	huge, err := net.Dial("tcp", w.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer huge.Close()
	_, _ = huge.Write(append(append([]byte{}, proxyproto.SIGV2...), 0x21, 0x11, 0xff, 0xff))
	// A CONNECT with 1 MB of headers: 431 at the 16 KiB limit.
	big, err := net.Dial("tcp", w.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer big.Close()
	go func() {
		_, _ = io.WriteString(big, "CONNECT x:443 HTTP/1.1\r\nX-Pad: "+strings.Repeat("a", 1<<20)+"\r\n\r\n")
	}()
	// Garbage: not a PROXY header, not HTTP.
	garbage, err := net.Dial("tcp", w.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer garbage.Close()
	_, _ = garbage.Write([]byte{0x16, 0x03, 0x01, 0x00, 0x10, 0xde, 0xad, 0xbe, 0xef, '\r', '\n', '\r', '\n'})

	// Good clients meanwhile.
	c := dialProxy(t, w, 2, "240.0.0.1:443")
	if got, err := w.whoVia(c, "api.alpha.test"); err != nil || got != "shoot--t--alpha" {
		t.Fatalf("good client during bad input: %q, %v", got, err)
	}
	c.Close()

	readAll := func(c net.Conn) (string, time.Duration) {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(c)
		if err != nil && !isReset(err) {
			t.Errorf("want the ingress to close the connection, got %v", err)
		}
		return string(b), time.Since(start)
	}
	if b, d := readAll(slow); b != "" || d < translate.ProxyHeaderTimeout-200*time.Millisecond {
		t.Errorf("slow PROXY header: closed after %v with %q, want closed at the %v deadline with nothing", d, b, translate.ProxyHeaderTimeout)
	}
	if b, _ := readAll(huge); b != "" {
		t.Errorf("huge PROXY header answered %q", b)
	}
	if b, _ := readAll(big); !strings.HasPrefix(b, "HTTP/1.1 431 ") {
		t.Errorf("1 MB of headers answered %q, want 431", firstLine(b))
	}
	if b, _ := readAll(garbage); !strings.HasPrefix(b, "HTTP/1.1 400 ") {
		t.Errorf("garbage answered %q, want 400", firstLine(b))
	}
	for outcome, want := range map[string]float64{outcomeProxyTimeout: 1, outcomeBadProxyHeader: 1, outcomeHeadersTooBig: 1, outcomeBadRequest: 1} {
		if got := promtestConn(t, w, "proxy", outcome); got != want {
			t.Errorf("%s: %v, want %v", outcome, got, want)
		}
	}
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func promtestConn(t *testing.T, w *world, listener, outcome string) float64 {
	t.Helper()
	return metrictest.Sum(t, w.reg, "tendril_ingress_connections_total", map[string]string{"listener": listener, "outcome": outcome})
}

// TestRealProxySenders puts HAProxy (send-proxy-v2) and nginx stream (proxy_protocol on) in
// front of the PROXY listener, as an apiserver-proxy would be: each must reach the shoot whose
// advertised address it reports.
func TestRealProxySenders(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	t.Run("haproxy", func(t *testing.T) {
		if _, err := exec.LookPath("haproxy"); err != nil {
			t.Fatal("haproxy is not on PATH; install it (Debian package haproxy, see .ci/run)")
		}
		// HAProxy serves a socket this test bound (bind fd@3: HAProxy's way to take an inherited
		// one), so no other process can take the port before HAProxy binds it.
		sock, err := inherit.Bind("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		front := sock.Addr
		// HAProxy reports its own frontend address as the destination; set-dst makes it the
		// advertised address on 443, as an apiserver-proxy holding that address would send.
		cfg := fmt.Sprintf(`global
  maxconn 100
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend fe
  bind fd@3
  tcp-request connection set-dst ipv4(240.0.0.2)
  tcp-request connection set-dst-port int(443)
  default_backend be
backend be
  server ingress %s send-proxy-v2
`, w.proxy)
		runPeer(t, "haproxy", cfg, func(path string) []string { return []string{"-db", "-f", path} }, front, sock)
		c, err := net.DialTimeout("tcp", front, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if got, err := w.whoVia(c, "api.beta.test"); err != nil || got != "shoot--t--beta" {
			t.Fatalf("through HAProxy: %q, %v", got, err)
		}
	})
	t.Run("nginx", func(t *testing.T) {
		if _, err := exec.LookPath("nginx"); err != nil {
			t.Fatal("nginx is not on PATH; install it (Debian packages nginx libnginx-mod-stream, see .ci/run)")
		}
		if os.Geteuid() != 0 {
			t.Skip("nginx sends its own listening address as the PROXY destination, which must be port 443: needs root")
		}
		// Advertise a loopback address of its own, so nginx can hold it on 443.
		w.route(model.Shoot{Name: "shoot--t--alpha", Hosts: []string{"api.alpha.test"}, APIServer: w.upstreams["shoot--t--alpha"].addr,
			AdvertisedAddress: netip.MustParseAddr("127.77.0.1")})
		testwait.Until(t, "the new advertised address", func() bool {
			return w.in.current.Load().clusters[translate.ProxyCluster(netip.MustParseAddr("127.77.0.1"))] != nil
		})
		front := "127.77.0.1:443"
		dir := t.TempDir()
		cfg := fmt.Sprintf(`%s
error_log %s/error.log;
pid %s/nginx.pid;
events {}
stream {
  server {
    listen %s;
    proxy_pass %s;
    proxy_protocol on;
  }
}
`, nginxStreamModule(), dir, dir, front, w.proxy)
		runPeer(t, "nginx", cfg, func(path string) []string { return []string{"-c", path, "-g", "daemon off;", "-p", dir} }, front)
		c, err := net.DialTimeout("tcp", front, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if got, err := w.whoVia(c, "api.alpha.test"); err != nil || got != "shoot--t--alpha" {
			t.Fatalf("through nginx: %q, %v", got, err)
		}
	})
}

// nginxStreamModule loads Debian's stream module unless nginx has it built in.
func nginxStreamModule() string {
	const mod = "/usr/lib/nginx/modules/ngx_stream_module.so"
	if _, err := os.Stat(mod); err == nil {
		return "load_module " + mod + ";"
	}
	return ""
}

// runPeer writes cfg, starts the peer until the test ends, and waits until addr accepts.
func runPeer(t *testing.T, bin, cfg string, args func(path string) []string, addr string, socks ...*inherit.Socket) {
	t.Helper()
	path := filepath.Join(t.TempDir(), bin+".conf")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	// Output goes to a file, not a pipe: nginx's workers inherit it and would keep a pipe (and
	// Wait) open after the master is gone. The peer runs in its own process group so that the
	// whole group can be killed.
	logPath := filepath.Join(t.TempDir(), bin+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	output := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	cmd := exec.Command(bin, args(path)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	inherit.Pass(cmd, socks...) // the first is descriptor 3
	err = cmd.Start()
	inherit.Close(socks...)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		if t.Failed() {
			t.Logf("%s output:\n%s", bin, output())
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-done:
			t.Fatalf("%s exited: %s", bin, output())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not accept on %s: %v\n%s", bin, addr, err, output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dialWith connects to addr and sends the given PROXY headers first.
func dialWith(t *testing.T, addr string, headers ...[]byte) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	for _, h := range headers {
		if _, err := c.Write(h); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// TestLoadBalancerProxyHeader: behind a load balancer that prepends its own PROXY header, the
// inner header still routes and the outer one is read only from a trusted peer; an untrusted
// peer sending two headers is refused.
func TestLoadBalancerProxyHeader(t *testing.T) {
	t.Parallel()
	lb := testnet.ProxyHeader(t, "203.0.113.7:51000", "192.0.2.10:8443") // the client as the LB saw it
	inner := testnet.ProxyHeader(t, "10.250.0.7:40000", "240.0.0.1:443") // from the apiserver-proxy
	lbSNI := testnet.ProxyHeader(t, "203.0.113.7:51001", "192.0.2.10:443")

	trusted := inClusterWorldWith(t, []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")})
	c := dialWith(t, trusted.proxy, lb, inner)
	if got, err := trusted.whoVia(c, "api.alpha.test"); err != nil || got != "shoot--t--alpha" {
		t.Errorf("outer + inner header from a trusted LB: %q, %v", got, err)
	}
	c.Close()
	c = dialWith(t, trusted.sni, lbSNI)
	if got, err := trusted.whoVia(c, "api.alpha.test"); err != nil || got != "shoot--t--alpha" {
		t.Errorf("SNI behind a trusted LB: %q, %v", got, err)
	}
	c.Close()
	resp, c := connectRequestWith(t, trusted.tunnel, lb)
	c.Close()
	if resp.StatusCode != 400 { // no Reversed-VPN header: the CONNECT chain answered, so the LB header was consumed
		t.Errorf("tunnel behind a trusted LB: %s, want 400 from the CONNECT chain", resp.Status)
	}

	untrusted := inClusterWorldWith(t, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")})
	c = dialWith(t, untrusted.proxy, lb, inner)
	if got, err := untrusted.whoVia(c, "api.alpha.test"); err == nil {
		t.Errorf("two headers from an untrusted peer reached %q", got)
	}
	c.Close()
	if n := promtestConn(t, untrusted, "proxy", outcomeUntrustedProxy); n != 1 {
		t.Errorf("untrusted_proxy_header: %v, want 1", n)
	}
	// From an untrusted peer, one header is the inner one, as without a load balancer.
	c = dialWith(t, untrusted.proxy, inner)
	if got, err := untrusted.whoVia(c, "api.alpha.test"); err != nil || got != "shoot--t--alpha" {
		t.Errorf("inner header alone from an untrusted peer: %q, %v", got, err)
	}
	c.Close()
	c = dialWith(t, untrusted.sni, lbSNI)
	if got, err := untrusted.whoVia(c, "api.alpha.test"); err == nil {
		t.Errorf("a PROXY header on the SNI listener from an untrusted peer reached %q", got)
	}
	c.Close()
}

// connectRequestWith sends PROXY headers, then a CONNECT without destination header.
func connectRequestWith(t *testing.T, addr string, headers ...[]byte) (*http.Response, net.Conn) {
	t.Helper()
	c := dialWith(t, addr, headers...)
	if _, err := io.WriteString(c, "CONNECT x:1194 HTTP/1.1\r\nHost: x:1194\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp, c
}

// TestLoadBalancerHeaderNeedsTrust: a listener that reads the load balancer's header is refused
// while no trusted proxy is configured.
func TestLoadBalancerHeaderNeedsTrust(t *testing.T) {
	in := New(Config{Listeners: map[string]string{"sni": "127.0.0.1:0"}})
	a, err := anypb.New(translate.Constant(translate.Options{LBProxyProtocol: true}).Listeners[0])
	if err != nil {
		t.Fatal(err)
	}
	err = in.Apply(xdsclient.Update{TypeURL: resourcev3.ListenerType, Resources: []*discoveryv3.Resource{{Name: "sni", Resource: a}}})
	if err == nil || !strings.Contains(err.Error(), "trusted proxy") {
		t.Fatalf("Apply = %v, want a NACK about the missing trusted proxy CIDR", err)
	}
}
