package vpn

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/model"
	xdsserver "github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ns = "shoot--t--vpn"

var (
	serverAddr = netip.MustParseAddr("fd8f:6d53:b97a:1::1")
	agentAddr  = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
)

func listen(t *testing.T, addr string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// startIngress runs the xDS server and an ingress with the tunnel listener on addr, routing
// the shoot's vpn server to vpn; the returned func stops both.
func startIngress(t *testing.T, addr string, vpn netip.AddrPort) func() {
	t.Helper()
	xs := xdsserver.New(xdsserver.Config{Log: testr.New(t).WithName("xds")})
	if _, err := xs.Apply([]model.Shoot{{Name: ns, Hosts: []string{"api.vpn.test"}, APIServer: netip.MustParseAddrPort("127.0.0.1:1"), VPNServer: vpn}}); err != nil {
		t.Fatal(err)
	}
	xl := listen(t, "127.0.0.1:0")
	tl := listen(t, addr)
	in := ingress.New(ingress.Config{Listeners: map[string]string{"tunnel": tl.Addr().String()}, Log: testr.New(t).WithName("ingress")})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = xs.Serve(ctx, xl) }()
	go func() {
		defer wg.Done()
		_ = in.Serve(ctx, map[string]net.Listener{"tunnel": tl}, xdsclient.Config{Address: xl.Addr().String(), NodeID: "t", MinBackoff: 10 * time.Millisecond})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !in.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("ingress not ready")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The route's cluster arrives with the listener or just after it.
	time.Sleep(50 * time.Millisecond)
	return func() { cancel(); wg.Wait() }
}

// TestThroughIngress: the agent dials out through the ingress's Reversed-VPN CONNECT to the
// server; the server reaches the agent through the tunnel; after the ingress restarts the agent
// reconnects and dials succeed again.
func TestThroughIngress(t *testing.T) {
	serverKey, _ := wg.GenerateKey()
	agentKey, _ := wg.GenerateKey()
	ctx, cancel := context.WithCancel(context.Background())
	var wgr sync.WaitGroup
	defer func() { cancel(); wgr.Wait() }()
	// startServer runs a tendril-server end on addr until the returned func is called.
	startServer := func(addr string) (*seedserver.Server, net.Listener, func()) {
		srv, err := seedserver.New(seedserver.Config{
			Tunnel: wg.Config{PrivateKey: serverKey, LocalAddresses: []netip.Addr{serverAddr},
				Peers: []wg.Peer{{PublicKey: agentKey.PublicKey(), AllowedIPs: []netip.Prefix{netip.PrefixFrom(agentAddr, 128)}}}},
			ShootCIDRs: []netip.Prefix{netip.PrefixFrom(agentAddr, 128)},
			Log:        testr.New(t).WithName("server"),
		})
		if err != nil {
			t.Fatal(err)
		}
		l := listen(t, addr)
		sctx, scancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.ServeTunnel(sctx, l) }()
		return srv, l, func() { scancel(); <-done; srv.Close() }
	}
	srv, sl, stopServer := startServer("127.0.0.1:0")
	defer func() { stopServer() }()

	// The ingress restarts on the same address, reserved for it (testnet.Reserve).
	ingressAddr := testnet.Reserve(t, "127.0.0.1")
	stopIngress := startIngress(t, ingressAddr, netip.MustParseAddrPort(sl.Addr().String()))
	defer func() { stopIngress() }()

	if _, err := New(Config{PrivateKey: agentKey, ServerPublicKey: serverKey.PublicKey(), Destination: "x"}); err == nil {
		t.Fatal("an agent without a seed address was accepted")
	}
	a, err := New(Config{PrivateKey: agentKey, ServerPublicKey: serverKey.PublicKey(), Address: agentAddr, ServerAddresses: []netip.Addr{serverAddr},
		Seed: ingressAddr, Destination: translate.TendrilServerWireName(ns), MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		Log: testr.New(t).WithName("agent")})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	echo, err := a.Tunnel().ListenTCP(netip.AddrPortFrom(agentAddr, 7))
	if err != nil {
		t.Fatal(err)
	}
	testnet.Serve(t, echo, testnet.Echo)
	wgr.Add(1)
	go func() { defer wgr.Done(); _ = a.Run(ctx) }()

	// srv: the current server.
	roundTrip := func() error { return pingThrough(ctx, srv, netip.AddrPortFrom(agentAddr, 7)) }
	eventually(t, "the first round trip", roundTrip)
	if ok, why := a.Ready(); !ok {
		t.Errorf("agent not ready with a working tunnel: %s", why)
	}
	if ok, why := srv.Ready(); !ok {
		t.Errorf("server not ready with a working tunnel: %s", why)
	}

	// The ingress goes away and comes back: the agent's stream ends, it reconnects, and a new
	// dial succeeds within 2 s of the ingress being back.
	stopIngress()
	stopIngress = startIngress(t, ingressAddr, netip.MustParseAddrPort(sl.Addr().String()))
	back := time.Now()
	eventually(t, "a round trip after the ingress restart", roundTrip)
	if n := srv.Tunnel().BindStats().StreamsAttached; n < 2 {
		t.Errorf("the server saw %d streams, want a second one after the ingress restart", n)
	}
	// How fast is measured, not asserted (timings belong in benchmarks); the backoff bounds it.
	t.Logf("tunnel back %v after the ingress", time.Since(back))

	// The server restarts (same keys, same address): the ingress's upstream ends, so does the
	// agent's stream; the agent reconnects to the new server.
	addr := sl.Addr().String()
	stopServer()
	srv, _, stopServer = startServer(addr)
	back = time.Now()
	eventually(t, "a round trip after the server restart", roundTrip)
	t.Logf("tunnel back %v after the server", time.Since(back))
}

// eventually polls f for up to 20 s: room for a failover or a dead path (5 s of silence) under
// -race on a loaded machine; no test asserts how fast.
// pingThrough dials echo through srv's tunnel and checks that a line comes back.
func pingThrough(ctx context.Context, srv *seedserver.Server, echo netip.AddrPort) error {
	dctx, dcancel := context.WithTimeout(ctx, 2*time.Second)
	defer dcancel()
	c, err := srv.Tunnel().DialContext(dctx, "tcp", echo.String())
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintln(c, "ping")
	l, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || l != "ping\n" {
		return fmt.Errorf("echo %q, %v", l, err)
	}
	return nil
}

// eventually polls f every 20 ms until it returns nil (testwait.Every).
func eventually(t *testing.T, what string, f func() error) {
	t.Helper()
	testwait.Every(t, 20*time.Millisecond, what, f)
}

// TestKeepaliveIsTheServers: tendril-server's live window is built on the agent's persistent
// keepalive (seedserver.AgentKeepalive); the agent's default must be that value.
func TestKeepaliveIsTheServers(t *testing.T) {
	key, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(Config{PrivateKey: key, ServerPublicKey: key.PublicKey(), Seed: "127.0.0.1:1", Direct: true, Address: netip.MustParseAddr("fd8f:6d53:b97a:1::2"),
		ShootCIDRs: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.cfg.Keepalive != seedserver.AgentKeepalive {
		t.Errorf("agent keepalive %v, seedserver.AgentKeepalive %v", a.cfg.Keepalive, seedserver.AgentKeepalive)
	}
}
