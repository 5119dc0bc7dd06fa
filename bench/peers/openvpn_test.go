package peers

import (
	"net/netip"
	"strings"
	"testing"
)

func TestRenderOpenVPN(t *testing.T) {
	c := OpenVPNConfig{Dir: "/tmp/x", Listen: "127.0.0.1:1194", Remote: "127.0.0.1:1194", HTTPProxy: "10.0.0.1:8132",
		ProxyHeader: "Reversed-VPN", ProxyHeaderValue: "outbound|1194||vpn-seed-server.shoot--a--b.svc.cluster.local",
		Network: netip.MustParsePrefix("10.234.1.0/24"), ShootCIDRs: []netip.Prefix{netip.MustParsePrefix("10.232.1.0/24")},
		ServerDev: "tbvs1", ClientDev: "tbvc1", ClientName: "openvpn-client"}
	srv, err := RenderOpenVPNServer(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"server 10.234.1.0 255.255.255.0\n", "proto tcp-server\n", "lport 1194\n", "route 10.232.1.0 255.255.255.0\n", "dh none\n"} {
		if !strings.Contains(srv, want) {
			t.Errorf("server configuration lacks %q:\n%s", want, srv)
		}
	}
	cl, err := RenderOpenVPNClient(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"http-proxy 10.0.0.1 8132\n", "http-proxy-option CUSTOM-HEADER Reversed-VPN outbound|1194||vpn-seed-server.shoot--a--b.svc.cluster.local\n", "remote-cert-tls server\n"} {
		if !strings.Contains(cl, want) {
			t.Errorf("client configuration lacks %q:\n%s", want, cl)
		}
	}
	for _, bad := range []func(*OpenVPNConfig){
		func(c *OpenVPNConfig) { c.ProxyHeaderValue = "two words" },
		func(c *OpenVPNConfig) { c.ServerDev = "a-very-long-device-name" },
		func(c *OpenVPNConfig) { c.Network = netip.MustParsePrefix("10.234.1.0/30") },
		func(c *OpenVPNConfig) { c.Dir = "relative" },
	} {
		b := c
		bad(&b)
		if _, err := RenderOpenVPNServer(b); err == nil {
			t.Errorf("rendered an invalid configuration %+v", b)
		}
	}
}
