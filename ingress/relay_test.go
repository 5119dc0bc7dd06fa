package ingress

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// gatewayStandIn stands in for Gardener's istio gateway on its unified port: it reads a CONNECT,
// records it, answers 200 for the destinations it knows (greeting with the destination's name,
// then echoing) and 503 for the others, as Istio's cluster_header routing does for a cluster it
// does not have.
type gatewayStandIn struct {
	mu       sync.Mutex
	requests []*http.Request
}

func startGatewayStandIn(t *testing.T, known ...string) (*gatewayStandIn, string) {
	t.Helper()
	g := &gatewayStandIn{}
	l := testnet.Listen(t)
	testnet.Serve(t, l, func(c net.Conn) {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		g.mu.Lock()
		g.requests = append(g.requests, req)
		g.mu.Unlock()
		dst := req.Header.Get(wire.GardenerDestinationHeader)
		for _, k := range known {
			if dst == k {
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\n\r\n%s\n", dst)
				_, _ = io.Copy(c, br)
				return
			}
		}
		body := "no cluster " + dst + "\n"
		fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	})
	_, port, _ := net.SplitHostPort(l.Addr().String())
	// By name: the relay is a DNS cluster (Gardener's gateway Service on a seed).
	return g, "localhost:" + port
}

func (g *gatewayStandIn) taken() []*http.Request {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*http.Request(nil), g.requests...)
}

// TestGardenerGatewayRelayed: the CONNECTs only Gardener's gateway serves on the unified port
// (its VPN, single and HA names, and the kube-apiserver socket of IstioTLSTermination) go on to
// Gardener's gateway with the request as the client sent it, the gateway's answer reaches the
// client unchanged and bytes flow both ways; tendril's own destinations stay the ingress's; the
// legacy port is gone with RemoveHTTPProxyLegacyPort.
func TestGardenerGatewayRelayed(t *testing.T) {
	t.Parallel()
	const ns = "shoot--t--alpha"
	single, ha0, ha1 := wire.GardenerVPNWireName(ns, -1), wire.GardenerVPNWireName(ns, 0), wire.GardenerVPNWireName(ns, 1)
	socket := ns + "--kube-apiserver-socket"
	gw, gwAddr := startGatewayStandIn(t, single, ha0, ha1, socket)
	host, port, _ := net.SplitHostPort(gwAddr)
	var p uint16
	fmt.Sscan(port, &p)
	w := newWorldWith(t, translate.Options{GardenerGateway: translate.HostPort{Host: host, Port: p}, RemoveHTTPProxyLegacyPort: true}, nil)
	echo := startEcho(t, "tendril-server")
	w.route(model.Shoot{Name: ns, Hosts: []string{"api.alpha.test"}, APIServer: echo, VPNServer: echo})
	testwait.Until(t, "relay and tunnel clusters", func() bool {
		c := w.in.current.Load()
		return c.clusters[translate.GardenerGatewayCluster] != nil && c.clusters[translate.TendrilServerWireName(ns)] != nil
	})
	if w.in.current.Load().listeners[translate.TunnelListener] != nil {
		t.Error("the legacy tunnel listener is configured with RemoveHTTPProxyLegacyPort")
	}

	dial := func(dst string) (*http.Response, net.Conn, *bufio.Reader) {
		t.Helper()
		c, err := net.DialTimeout("tcp", w.proxy, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		// As OpenVPN's http-proxy with CUSTOM-HEADER sends it (vpn-shoot's client config).
		fmt.Fprintf(c, "CONNECT api.alpha.internal:8443 HTTP/1.1\r\nHost: api.alpha.internal:8443\r\nUser-Agent: OpenVPN\r\nProxy-Connection: keep-alive\r\n%s: %s\r\n\r\n", wire.GardenerDestinationHeader, dst)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("CONNECT %s: %v", dst, err)
		}
		return resp, c, br
	}
	for _, dst := range []string{single, ha0, ha1, socket} {
		resp, c, br := dial(dst)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %s, want the gateway's 200", dst, resp.Status)
		}
		if line, _ := br.ReadString('\n'); line != dst+"\n" {
			t.Fatalf("%s reached %q", dst, line)
		}
		payload := bytes.Repeat([]byte("openvpn"), 50000)
		go func() { _, _ = c.Write(payload) }()
		got := make([]byte, len(payload))
		if _, err := io.ReadFull(br, got); err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("%s: echo through the relay differs (%v)", dst, err)
		}
	}
	reqs := gw.taken()
	if len(reqs) != 4 {
		t.Fatalf("the gateway got %d requests, want 4", len(reqs))
	}
	for i, r := range reqs {
		if r.Method != http.MethodConnect || r.RequestURI != "api.alpha.internal:8443" || r.Host != "api.alpha.internal:8443" ||
			len(r.Header.Values(wire.GardenerDestinationHeader)) != 1 || r.Header.Get("User-Agent") != "OpenVPN" || r.Header.Get("Proxy-Connection") != "" {
			t.Errorf("request %d as relayed: %s %s Host %s, headers %v", i, r.Method, r.RequestURI, r.Host, r.Header)
		}
	}

	// A name the gateway does not route: its own status and body reach the client.
	resp, _, br := dial(wire.GardenerVPNWireName("shoot--t--other", -1))
	body, _ := io.ReadAll(io.LimitReader(br, 100))
	if resp.StatusCode != 503 || !strings.HasPrefix(string(body), "no cluster ") {
		t.Errorf("unknown to the gateway: %s %q, want its 503", resp.Status, body)
	}
	// tendril's own tunnel name is routed by the ingress, not relayed.
	resp, c := connectRequest(t, w.proxy, wire.GardenerDestinationHeader+": "+translate.TendrilServerWireName(ns))
	if resp.StatusCode != 200 {
		t.Fatalf("tendril-server through the unified port: %s", resp.Status)
	}
	line, _ := bufio.NewReader(c).ReadString('\n')
	c.Close()
	if line != "tendril-server\n" {
		t.Errorf("tendril's name reached %q", line)
	}
	if n := len(gw.taken()); n != 5 {
		t.Errorf("the gateway got %d requests, want 5 (tendril's own went to the gateway)", n)
	}
}

// TestGardenerGatewayUnset: without a gateway to relay to, Gardener's VPN names get a 503 that
// says so and never reach a tendril-server; on the legacy port the single name is the one
// tendril's earlier agents dial, and reaches their tendril-server, while the HA names get 503.
func TestGardenerGatewayUnset(t *testing.T) {
	t.Parallel()
	w, _ := inClusterWorld(t)
	for _, tc := range []struct {
		addr, header string
		index        int
	}{
		{w.proxy, wire.GardenerDestinationHeader, -1},
		{w.proxy, wire.GardenerDestinationHeader, 0},
		{w.tunnel, wire.ReversedVPNHeader, 1},
	} {
		resp, c := connectRequest(t, tc.addr, tc.header+": "+wire.GardenerVPNWireName("shoot--t--alpha", tc.index))
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		c.Close()
		if resp.StatusCode != 503 || !strings.Contains(string(body), "Gardener's gateway") {
			t.Errorf("%s %d: %s %q, want 503 naming Gardener's gateway", tc.header, tc.index, resp.Status, body)
		}
	}
	resp, c := connectRequest(t, w.tunnel, wire.ReversedVPNHeader+": "+wire.GardenerVPNWireName("shoot--t--alpha", -1))
	defer c.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("an earlier agent's name on the legacy port: %s", resp.Status)
	}
	if line, _ := bufio.NewReader(c).ReadString('\n'); line != "vpn-alpha\n" {
		t.Errorf("an earlier agent's name on the legacy port reached %q, want alpha's tendril-server", line)
	}
}

// TestGardenerGatewayDown: a relay that refuses is a 502 from the ingress, as any upstream.
func TestGardenerGatewayDown(t *testing.T) {
	t.Parallel()
	host, port, _ := net.SplitHostPort(testnet.RefusedAddr(t))
	var p uint16
	fmt.Sscan(port, &p)
	w := newWorldWith(t, translate.Options{GardenerGateway: translate.HostPort{Host: host, Port: p}}, nil)
	testwait.Until(t, "relay cluster", func() bool { return w.in.current.Load().clusters[translate.GardenerGatewayCluster] != nil })
	resp, c := connectRequest(t, w.proxy, wire.GardenerDestinationHeader+": "+wire.GardenerVPNWireName("shoot--t--alpha", -1))
	c.Close()
	if resp.StatusCode != 502 {
		t.Errorf("relay refusing: %s, want 502", resp.Status)
	}
}
