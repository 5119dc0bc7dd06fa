package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/translate"
)

// TestGardenerVPNThroughIngress runs Gardener's own VPN, OpenVPN over TCP through an HTTP proxy
// as vpn-shoot does, through tendril-ingress's unified port beside tendril's reversed VPN. On the
// seed (the host): tendril-seed with a route file and --gardener-gateway, tendril-ingress,
// tendril-server, a stand-in for Gardener's istio ingress gateway (in this process: no Envoy
// here) and three OpenVPN servers standing for vpn-seed-server (single) and vpn-seed-server-0
// and -1 (HA). In a "shoot" network namespace that reaches the seed only through the ingress's
// unified port: tendril's agent (its own X-Gardener-Destination name) and one OpenVPN client
// per Gardener name, configured as vpn2's client-config.template renders them (http-proxy to
// the unified port, CUSTOM-HEADER X-Gardener-Destination, proto tcp-client, remote <endpoint>
// with OpenVPN's default port 1194, HTTP/1.0 CONNECT). Each tunnel comes up and carries bytes;
// the gateway got each client's request with its one header; tendril's own path reaches the pod
// meanwhile; a name no gateway cluster serves gets the gateway's 503 and breaks nothing.
func TestGardenerVPNThroughIngress(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces, veth pairs and tun devices (run make test as root, as CI does)")
	}
	for _, bin := range []struct{ name, pkg string }{{"ip", "iproute2"}, {"curl", "curl"}, {"openvpn", "openvpn"}} {
		if _, err := exec.LookPath(bin.name); err != nil {
			t.Fatalf("%s is not on PATH (Debian package %s)", bin.name, bin.pkg)
		}
	}
	ovpn := peers.OpenVPN{}
	if err := ovpn.Check(context.Background()); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	id := strconv.Itoa(os.Getpid() % 100000)

	// seed ⇄ shoot: 10.223.0.1/30 ⇄ .2; shoot ⇄ pod: 10.224.0.1/24 ⇄ .2. OpenVPN's tunnel
	// networks: 10.225.N.0/24 (the server .1, its client .2). The single server routes the pod
	// network, as vpn-seed-server routes the shoot's networks; sharing one network namespace, the
	// HA servers cannot route it too, so each routes a "node" address of its own on the shoot's
	// lo (10.226.N.1/32).
	shoot, pod := shootNetworks(t, "gv", "10.223.0", "10.224.0")
	startPod(t, pod, "10.224.0.2:8080")
	startPod(t, shoot, "0.0.0.0:8081") // answers on the shoot's "node" addresses
	if err := netns.In(shoot, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644) }); err != nil {
		t.Fatal(err) // vpn-shoot forwards its tun into the shoot's networks
	}
	ip(t, "-n", pod, "route", "add", "10.225.0.0/24", "via", "10.224.0.1") // the pod answers the VPN's seed side
	for _, a := range []string{"10.226.0.1/32", "10.226.1.1/32"} {
		ip(t, "-n", shoot, "addr", "add", a, "dev", "lo")
	}
	podNet := netip.MustParsePrefix("10.224.0.0/24")

	const ns = "shoot--e2e--gvpn"
	type tunnel struct {
		name       string       // X-Gardener-Destination
		label      string       // in messages and device names
		network    netip.Prefix // OpenVPN's own
		routed     netip.Prefix // what the server routes through the client
		target     string       // an HTTP server the routed network reaches, host:port
		serverDev  string
		clientArgs []string // vpn-shoot's command line, in the shoot's namespace
		client     *openvpnProc
	}
	tunnels := []*tunnel{
		{name: wire.GardenerVPNWireName(ns, -1), label: "s", routed: podNet, target: "10.224.0.2:8080"},
		{name: wire.GardenerVPNWireName(ns, 0), label: "0", routed: netip.MustParsePrefix("10.226.0.1/32"), target: "10.226.0.1:8081"},
		{name: wire.GardenerVPNWireName(ns, 1), label: "1", routed: netip.MustParsePrefix("10.226.1.1/32"), target: "10.226.1.1:8081"},
	}
	// A name of Gardener's grammar (the ingress relays it) that no cluster of the gateway serves.
	unknown := &tunnel{name: wire.GardenerVPNWireName(ns, 3), label: "3", routed: netip.MustParsePrefix("10.226.3.1/32")}

	// The ingress's unified port, on the seed's side of the shoot's veth: the shoot reaches the
	// seed only there (everything else of the seed's listens on loopback: the OpenVPN servers, the
	// gateway, tendril-server). vpn2's "remote <endpoint>" has no port: OpenVPN's default, 1194, is the
	// CONNECT's authority.
	proxyAddr := bindAddr(t, "10.223.0.1:0")
	endpoint := "10.223.0.1:1194"

	vpnCA, err := testpki.NewCA("Gardener VPN CA (stand-in)")
	if err != nil {
		t.Fatal(err)
	}
	routes := map[string]string{} // the gateway's clusters: X-Gardener-Destination → server
	for i, tn := range append(slices.Clone(tunnels), unknown) {
		d := filepath.Join(dir, "openvpn-"+tn.label)
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := vpnCA.WriteCA(filepath.Join(d, "ca.pem")); err != nil {
			t.Fatal(err)
		}
		clientName := "vpn-shoot"
		if tn.label != "s" {
			clientName += "-" + tn.label
		}
		for file, cn := range map[string]string{"server": "vpn-seed-server", "client": clientName} {
			c, err := vpnCA.Leaf(cn)
			if err != nil {
				t.Fatal(err)
			}
			if err := testpki.WritePair(c, filepath.Join(d, file+".pem"), filepath.Join(d, file+"-key.pem")); err != nil {
				t.Fatal(err)
			}
		}
		// OpenVPN cannot inherit a socket: a reserved port (internal/host/reserve) it binds itself.
		listen := testnet.Reserve(t, "127.0.0.1")
		tn.network = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 225, byte(i), 0}), 24)
		tn.serverDev = "gvs" + tn.label + id
		cfg := peers.OpenVPNConfig{Dir: d, Listen: listen, Remote: endpoint, HTTPProxy: proxyAddr,
			ProxyHeader: wire.GardenerDestinationHeader, ProxyHeaderValue: tn.name,
			Network: tn.network, ShootCIDRs: []netip.Prefix{tn.routed},
			ServerDev: tn.serverDev, ClientDev: "gvc" + tn.label + id, ClientName: clientName}
		srvArgs, cliArgs, err := ovpn.WriteOpenVPN(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// vpn2's client config sets no http-proxy-option VERSION: OpenVPN's CONNECT is HTTP/1.0.
		cfgFile := cliArgs[len(cliArgs)-1]
		b, err := os.ReadFile(cfgFile)
		if err != nil {
			t.Fatal(err)
		}
		clientCfg := strings.Replace(string(b), "http-proxy-option VERSION 1.1\n", "", 1)
		if want := "http-proxy-option CUSTOM-HEADER " + wire.GardenerDestinationHeader + " " + tn.name + "\n"; !strings.Contains(clientCfg, want) {
			t.Fatalf("the client configuration lacks %q:\n%s", want, clientCfg)
		}
		writeFile(t, d, filepath.Base(cfgFile), clientCfg)
		tn.clientArgs = append(netns.Exec(shoot), cliArgs...)
		if tn == unknown {
			continue // nothing stands behind this name
		}
		routes[tn.name] = listen
		srv := startOpenVPN(t, "openvpn-server-"+tn.label, srvArgs...)
		if _, err := srv.waitLine(openvpnUp, 20*time.Second); err != nil {
			t.Fatalf("OpenVPN server %s: %v", tn.label, err)
		}
	}

	gw := startGatewayStandIn(t, routes)

	// tendril: seed, ingress (the unified port only), server, one agent on the unified port.
	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	serverKeyFile, serverPub, _ := writeKeys(t, dir, "server")
	agentKeyFile, agentPub, _ := writeKeys(t, dir, "agent")
	_, caFile, _ := shootPKI(t, dir)
	tunnelAddr, connectAddr, serverMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	routeFile := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.gvpn.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routeFile, "--xds-address", xdsAddr, "--metrics-address", "",
		"--gardener-gateway", gw.addr}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{proxyAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e",
		"--proxy-address", proxyAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	start(t, "tendril-server", []string{tunnelAddr, connectAddr, serverMetrics}, "--private-key-file", serverKeyFile, "--agent-public-key", "@"+agentPub,
		"--shoot-cidrs", podNet.String(), "--tunnel-address", tunnelAddr, "--connect-address", connectAddr, "--grpc-address", "",
		"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
		"--metrics-address", serverMetrics)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	startBinary(t, "tendril-agent", "ip", nil, "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
		"--private-key-file", agentKeyFile, "--server-public-key", "@"+serverPub, "--shoot-cidrs", podNet.String(),
		"--seed", proxyAddr, "--header", wire.GardenerDestinationHeader, "--destination", translate.TendrilServerWireName(ns),
		"--metrics-address", "")
	eventually(t, "tendril-server ready (tendril's tunnel up through the unified port)", func() error {
		_, err := get("http://" + serverMetrics + "/readyz")
		return err
	})

	// vpn-shoot, once per Gardener name, all at once.
	for _, tn := range tunnels {
		tn.client = startOpenVPN(t, "openvpn-client-"+tn.label, tn.clientArgs...)
	}
	for _, tn := range tunnels {
		up, err := tn.client.waitLine(openvpnUp, 20*time.Second)
		if err != nil {
			t.Fatalf("vpn-shoot %s: %v", tn.name, err)
		}
		tcp, _ := tn.client.lineAt("TCP connection established")
		answered, _ := tn.client.lineAt("HTTP proxy returned")
		var atGateway time.Time
		for _, r := range gw.taken() {
			if r.destination == tn.name {
				atGateway = r.at
				break
			}
		}
		ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
		// After the 200 OpenVPN's http-proxy reads on for stray bytes until 2 s pass in silence
		// (proxy.c, establish_http_proxy_passthru); the server waits for the client's first
		// packet, so the wait is always whole.
		t.Logf("OpenVPN tunnel %s through the ingress: Initialization Sequence Completed %v after the client's start: TCP to the ingress %v, "+
			"CONNECT at the gateway %v, the 200 at the client %v, then %v to the tunnel (OpenVPN's 2 s wait after the 200 included)",
			tn.label, ms(up.Sub(tn.client.started)), ms(tcp.Sub(tn.client.started)), ms(atGateway.Sub(tn.client.started)),
			ms(answered.Sub(tn.client.started)), ms(up.Sub(answered)))
	}

	// Bytes through each tunnel: a GET from the seed, its 1 MiB answer back from the shoot. The
	// seed routes the target only into the server's tun, and the bytes come out of it.
	const bulk = 1 << 20
	through := func(tn *tunnel) error {
		host, _, _ := net.SplitHostPort(tn.target)
		out, err := exec.Command("ip", "route", "get", host).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "dev "+tn.serverDev+" ") {
			return fmt.Errorf("the seed's route to %s is not the tunnel's (%s): %v %s", host, tn.serverDev, err, out)
		}
		before, err := tunRxBytes(tn.serverDev)
		if err != nil {
			return err
		}
		if err := fetchBytes(tn.target, bulk); err != nil {
			return err
		}
		after, err := tunRxBytes(tn.serverDev)
		if err != nil {
			return err
		}
		if after-before < bulk {
			return fmt.Errorf("%d bytes came out of %s, want at least %d", after-before, tn.serverDev, bulk)
		}
		return nil
	}
	for _, tn := range tunnels {
		if err := through(tn); err != nil {
			t.Fatalf("through vpn-shoot %s: %v", tn.label, err)
		}
	}

	// The gateway got each client's CONNECT as the client sent it: one request per name, one
	// X-Gardener-Destination each, the client's authority.
	checkRequests := func() {
		t.Helper()
		count := map[string]int{}
		for _, r := range gw.taken() {
			count[r.destination]++
			// The client's request line and its one header; no header added on the way.
			if r.method != http.MethodConnect || r.uri != endpoint || r.host != endpoint || len(r.destinations) != 1 || len(r.header) != 1 {
				t.Errorf("the gateway got %s %s, Host %s, headers %v:\n%s", r.method, r.uri, r.host, r.header, r.raw)
			}
		}
		for _, tn := range tunnels {
			if count[tn.name] != 1 {
				t.Errorf("the gateway got %d requests for %s, want 1", count[tn.name], tn.name)
			}
		}
	}
	checkRequests()
	for _, r := range gw.taken() {
		t.Logf("at the gateway from vpn-shoot:\n%s", r.raw)
	}

	// tendril's own path meanwhile: kube-apiserver's CONNECT through tendril-server, its tunnel
	// through the same unified port, the agent, the pod.
	curl := func(target string) (string, error) { return curlConnect(connectAddr, caFile, dir, target) }
	tendrilPath := func() error {
		got, err := curl("10.224.0.2:8080")
		if err == nil && got != "pod 10.224.0.2:8080" {
			err = fmt.Errorf("answered %q", got)
		}
		if err != nil {
			return fmt.Errorf("%v: %s", err, got)
		}
		return nil
	}
	eventually(t, "the pod through tendril's tunnel", tendrilPath)

	// A Gardener name that no gateway cluster serves: relayed, and the gateway's 503 reaches the
	// client unchanged; vpn-shoot with that name never comes up.
	status, body, err := rawConnect(proxyAddr, endpoint, unknown.name)
	if err != nil || status != http.StatusServiceUnavailable || body != "no cluster "+unknown.name+"\n" {
		t.Errorf("CONNECT for %s: %d %q %v, want the gateway's 503", unknown.name, status, body, err)
	}
	// Outside Gardener's grammar (vpn-seed-server-0 … -4): the ingress refuses it itself.
	n := len(gw.taken())
	if status, body, err := rawConnect(proxyAddr, endpoint, wire.GardenerVPNWireName(ns, 5)); err != nil || status != http.StatusBadRequest {
		t.Errorf("CONNECT for vpn-seed-server-5: %d %q %v, want the ingress's 400", status, body, err)
	}
	if len(gw.taken()) != n {
		t.Errorf("a name outside Gardener's grammar was relayed to the gateway")
	}
	bad := startOpenVPN(t, "openvpn-client-"+unknown.label, unknown.clientArgs...)
	if _, err := bad.waitLine("HTTP proxy returned bad status", 15*time.Second); err != nil {
		t.Errorf("vpn-shoot %s: %v", unknown.name, err)
	}
	if _, ok := bad.lineAt(openvpnUp); ok {
		t.Errorf("vpn-shoot %s came up with no server behind its name", unknown.name)
	}
	bad.stop()

	// Nothing else broke: every tunnel still carries bytes without having reconnected, and
	// tendril's path still answers.
	for _, tn := range tunnels {
		if err := through(tn); err != nil {
			t.Errorf("through vpn-shoot %s after the refused name: %v", tn.label, err)
		}
		if c := tn.client.count(openvpnUp); c != 1 || tn.client.exitedEarly() {
			t.Errorf("vpn-shoot %s initialised %d times (exited: %v)", tn.label, c, tn.client.exitedEarly())
		}
	}
	if err := tendrilPath(); err != nil {
		t.Errorf("the pod through tendril's tunnel after the refused name: %v", err)
	}
	// The unknown name's requests, the raw CONNECT's and the client's, all got the gateway's 503.
	var extra []gatewayRequest
	for _, r := range gw.taken() {
		if r.destination != unknown.name {
			continue
		}
		extra = append(extra, r)
		if r.status != http.StatusServiceUnavailable {
			t.Errorf("the gateway answered %s with %d", r.destination, r.status)
		}
	}
	if len(extra) < 2 {
		t.Errorf("the gateway got %d requests for %s, want the raw CONNECT's and the client's", len(extra), unknown.name)
	}
	checkRequests()
	if m, err := get("http://" + ingressMetrics + "/metrics"); err == nil {
		t.Logf("ingress metrics of the relay:\n%s", grepLines(m, translate.GardenerGatewayCluster))
	}
}

const openvpnUp = "Initialization Sequence Completed"

// fetchBytes GETs /bytes/n from the HTTP server at addr (startPod's), from the seed, and checks
// that n bytes came.
func fetchBytes(addr string, n int) error {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	resp, err := c.Get(fmt.Sprintf("http://%s/bytes/%d", addr, n))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	got, err := io.Copy(io.Discard, resp.Body)
	if err != nil || got != int64(n) || resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s, %d of %d bytes (%v)", addr, resp.Status, got, n, err)
	}
	return nil
}

// tunRxBytes is what the OpenVPN server wrote into its tun device so far: the bytes that came
// through its tunnel from the shoot.
func tunRxBytes(dev string) (int64, error) {
	b, err := os.ReadFile("/sys/class/net/" + dev + "/statistics/rx_bytes")
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// rawConnect sends the CONNECT OpenVPN's http-proxy sends (HTTP/1.0, Host, the custom header) to
// the unified port at proxy and returns the answer's status and body.
func rawConnect(proxy, authority, destination string) (int, string, error) {
	c, err := net.DialTimeout("tcp", proxy, 5*time.Second)
	if err != nil {
		return 0, "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	host, _, _ := net.SplitHostPort(authority)
	fmt.Fprintf(c, "CONNECT %s HTTP/1.0\r\nHost: %s\r\n%s: %s\r\n\r\n", authority, host, wire.GardenerDestinationHeader, destination)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, "", err
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1000))
	return resp.StatusCode, string(b), nil
}

// gatewayRequest is one CONNECT the gateway stand-in read.
type gatewayRequest struct {
	at                time.Time
	raw               string // the request's bytes as they came
	method, uri, host string
	proto             string
	header            http.Header
	destinations      []string // the X-Gardener-Destination values
	destination       string   // the first, or ""
	status            int      // what the stand-in answered
}

// gatewayStandIn stands in for Gardener's istio ingress gateway on its unified port: it reads one
// CONNECT per connection, records it, and for an X-Gardener-Destination it has a cluster for
// (exactly that value, sent once) answers 200 and splices the connection to that cluster's
// address (an OpenVPN server standing in for vpn-seed-server); anything else gets 503, as
// Istio's cluster_header routing does for a cluster it does not have.
type gatewayStandIn struct {
	addr   string
	routes map[string]string

	mu    sync.Mutex
	got   []gatewayRequest
	conns map[net.Conn]struct{}
}

func startGatewayStandIn(t *testing.T, routes map[string]string) *gatewayStandIn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gatewayStandIn{addr: ln.Addr().String(), routes: routes, conns: map[net.Conn]struct{}{}}
	testnet.Serve(t, ln, g.serve)
	// Before Serve's cleanup waits for the handlers: end the spliced connections still open.
	t.Cleanup(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		for c := range g.conns {
			c.Close()
		}
		g.conns = nil // and refuse the ones still to come
	})
	return g
}

func (g *gatewayStandIn) track(c net.Conn) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.conns == nil {
		return false
	}
	g.conns[c] = struct{}{}
	return true
}

func (g *gatewayStandIn) untrack(c net.Conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.conns, c)
}

func (g *gatewayStandIn) serve(c net.Conn) {
	if !g.track(c) {
		return
	}
	defer g.untrack(c)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	// The request's bytes as they came, then parsed.
	var raw strings.Builder
	for raw.Len() < 16<<10 {
		line, err := br.ReadString('\n')
		if err != nil {
			return
		}
		raw.WriteString(line)
		if line == "\r\n" || line == "\n" {
			break
		}
	}
	req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw.String())))
	if err != nil {
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	r := gatewayRequest{at: time.Now(), raw: raw.String(), method: req.Method, uri: req.RequestURI, host: req.Host, proto: req.Proto,
		header: req.Header, destinations: req.Header.Values(wire.GardenerDestinationHeader)}
	if len(r.destinations) > 0 {
		r.destination = r.destinations[0]
	}
	backend := ""
	if req.Method == http.MethodConnect && len(r.destinations) == 1 {
		backend = g.routes[r.destination]
	}
	var up net.Conn
	if backend != "" {
		up, err = net.DialTimeout("tcp", backend, 5*time.Second)
		if err != nil {
			backend = ""
		}
	}
	r.status = http.StatusOK
	if backend == "" {
		r.status = http.StatusServiceUnavailable
	}
	g.mu.Lock()
	g.got = append(g.got, r)
	g.mu.Unlock()
	if backend == "" {
		body := "no cluster " + r.destination + "\n"
		fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		return
	}
	defer up.Close()
	if !g.track(up) {
		return
	}
	defer g.untrack(up)
	if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, br); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
	c.Close()
	up.Close()
	<-done
}

func (g *gatewayStandIn) taken() []gatewayRequest {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]gatewayRequest(nil), g.got...)
}

// openvpnProc is an OpenVPN process whose output lines are timestamped as they arrive.
type openvpnProc struct {
	name    string
	cmd     *exec.Cmd
	started time.Time
	exited  chan struct{}
	read    chan struct{}
	stopped sync.Once

	mu    sync.Mutex
	lines []stampedLine
}

type stampedLine struct {
	at   time.Time
	text string
}

// startOpenVPN runs args (openvpn, possibly behind ip netns exec, which execs it in place) until
// stop or the test's end: SIGTERM, and SIGKILL after 5 s. Its log is printed if the test failed.
func startOpenVPN(t *testing.T, name string, args ...string) *openvpnProc {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &openvpnProc{name: name, cmd: exec.Command(args[0], args[1:]...), exited: make(chan struct{}), read: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	p.started = time.Now()
	err = p.cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		t.Fatal(err)
	}
	go func() {
		defer close(p.read)
		defer r.Close()
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, stampedLine{time.Now(), sc.Text()})
			p.mu.Unlock()
		}
	}()
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("%s log:\n%s", name, p.log())
		}
	})
	return p
}

func (p *openvpnProc) stop() {
	p.stopped.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(5 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		<-p.read
	})
}

func (p *openvpnProc) exitedEarly() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// lineAt is when the first line containing text arrived.
func (p *openvpnProc) lineAt(text string) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.lines {
		if strings.Contains(l.text, text) {
			return l.at, true
		}
	}
	return time.Time{}, false
}

func (p *openvpnProc) count(text string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, l := range p.lines {
		if strings.Contains(l.text, text) {
			n++
		}
	}
	return n
}

// waitLine waits up to timeout for a line containing text and returns when it arrived.
func (p *openvpnProc) waitLine(text string, timeout time.Duration) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	for {
		if at, ok := p.lineAt(text); ok {
			return at, nil
		}
		if p.exitedEarly() {
			<-p.read
			if at, ok := p.lineAt(text); ok {
				return at, nil
			}
			return time.Time{}, fmt.Errorf("%s exited (%v) before %q", p.name, p.cmd.ProcessState, text)
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("no %q from %s within %v", text, p.name, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (p *openvpnProc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, l := range p.lines {
		fmt.Fprintf(&b, "%s %s\n", l.at.Format("15:04:05.000"), l.text)
	}
	return b.String()
}
