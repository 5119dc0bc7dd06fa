package vpn

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/model"
	xdsserver "github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

// TestSetReachesEveryReplica: an agent given both replicas of an HA shoot's server keeps a
// tunnel to each through the ingress's unified port (each replica its own cluster, named as its
// pod); both servers, with the same key, reach the shoot; when one replica goes, the other's
// tunnel carries on untouched and the set stays ready.
func TestSetReachesEveryReplica(t *testing.T) {
	serverKey, _ := wg.GenerateKey()
	agentKey, _ := wg.GenerateKey()
	realEcho := testnet.EchoServer(t)
	echo := netip.MustParseAddrPort("10.99.0.1:7")
	shoot := []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}
	dialShoot := func(ctx context.Context, network, addr string) (net.Conn, error) {
		if network == "tcp" && addr == echo.String() {
			return (&net.Dialer{}).DialContext(ctx, network, realEcho)
		}
		return nil, fmt.Errorf("nothing at %s %s", network, addr)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wgr sync.WaitGroup
	defer func() { cancel(); wgr.Wait() }()

	type replica struct {
		srv  *seedserver.Server
		addr netip.AddrPort
		stop func()
	}
	var replicas [2]replica
	for i := range replicas {
		srv, err := seedserver.New(seedserver.Config{
			Tunnel: wg.Config{PrivateKey: serverKey, LocalAddresses: []netip.Addr{serverAddr, serverAddr4},
				Peers: []wg.Peer{{PublicKey: agentKey.PublicKey(), AllowedIPs: []netip.Prefix{netip.PrefixFrom(agentAddr, 128)}}}},
			ShootCIDRs: shoot,
			Log:        testr.New(t).WithName(fmt.Sprintf("server-%d", i)),
		})
		if err != nil {
			t.Fatal(err)
		}
		l := listen(t, "127.0.0.1:0")
		sctx, scancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.ServeTunnel(sctx, l) }()
		var once sync.Once
		replicas[i] = replica{srv: srv, addr: netip.MustParseAddrPort(l.Addr().String()), stop: func() {
			once.Do(func() { scancel(); <-done; srv.Close() })
		}}
		defer replicas[i].stop()
	}

	// The ingress's unified port with the shoot's two replicas.
	xs := xdsserver.New(xdsserver.Config{Log: testr.New(t).WithName("xds")})
	if _, err := xs.Apply([]model.Shoot{{Name: ns, Hosts: []string{"api.vpn.test"}, APIServer: netip.MustParseAddrPort("127.0.0.1:1"),
		VPNServers:  []netip.AddrPort{replicas[0].addr, replicas[1].addr},
		VPNReplicas: []model.VPNReplica{{Hostname: "tendril-server-0", Endpoint: replicas[0].addr}, {Hostname: "tendril-server-1", Endpoint: replicas[1].addr}},
	}}); err != nil {
		t.Fatal(err)
	}
	xl, pl := listen(t, "127.0.0.1:0"), listen(t, "127.0.0.1:0")
	in := ingress.New(ingress.Config{Listeners: map[string]string{"proxy": pl.Addr().String()}, Log: testr.New(t).WithName("ingress")})
	wgr.Add(2)
	go func() { defer wgr.Done(); _ = xs.Serve(ctx, xl) }()
	go func() {
		defer wgr.Done()
		_ = in.Serve(ctx, map[string]net.Listener{"proxy": pl}, xdsclient.Config{Address: xl.Addr().String(), NodeID: "t", MinBackoff: 10 * time.Millisecond})
	}()

	dests := []string{translate.TendrilServerReplicaWireName(ns, "tendril-server-0"), translate.TendrilServerReplicaWireName(ns, "tendril-server-1")}
	reg := prometheus.NewRegistry()
	cfg := Config{PrivateKey: agentKey, ServerPublicKey: serverKey.PublicKey(), Address: agentAddr, ServerAddresses: []netip.Addr{serverAddr, serverAddr4},
		ShootCIDRs: shoot, Dial: dialShoot, Seed: pl.Addr().String(), Header: wire.GardenerDestinationHeader,
		MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, Registry: reg, Log: testr.New(t).WithName("agent")}
	for _, bad := range []func(c *Config){func(c *Config) { c.Direct = true }, func(c *Config) { c.TUN = "tun9" }} {
		c := cfg
		c.Registry = nil
		bad(&c)
		if s, err := NewSet(c, dests); err == nil {
			s.Close()
			t.Errorf("a set of two with %+v was accepted", c)
		}
	}
	set, err := NewSet(cfg, dests)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	wgr.Add(1)
	go func() { defer wgr.Done(); _ = set.Run(ctx) }()

	roundTrip := func(srv *seedserver.Server) error { return pingThrough(ctx, srv, echo) }
	for i, r := range replicas {
		eventually(t, fmt.Sprintf("the shoot through replica %d", i), func() error { return roundTrip(r.srv) })
	}
	if ok, why := set.Ready(); !ok {
		t.Fatalf("set not ready with both tunnels up: %s", why)
	}
	// Each replica's tunnel is its own stream: a held connection through replica 1 lives on
	// while replica 0 goes.
	held, err := replicas[1].srv.Tunnel().DialContext(ctx, "tcp", echo.String())
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	replicas[0].stop()
	eventually(t, "agent 0 notices its server is gone", func() error {
		if ok, _ := set.Agents()[0].Ready(); ok {
			return errNotYet("agent 0 still ready")
		}
		return nil
	})
	if ok, why := set.Ready(); !ok {
		t.Errorf("set not ready with replica 1's tunnel up: %s", why)
	}
	_ = held.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintln(held, "still")
	if l, err := bufio.NewReader(held).ReadString('\n'); err != nil || l != "still\n" {
		t.Errorf("the connection through replica 1 after replica 0 went: %q, %v", l, err)
	}
	if err := roundTrip(replicas[1].srv); err != nil {
		t.Errorf("a new connection through replica 1: %v", err)
	}

	// Each agent's metrics carry its destination; the process's relay gauge is there once.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "tendril_agent_vpn_reconnects_total", "tendril_agent_vpn_handshake_age_seconds":
			var got []string
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "destination" {
						got = append(got, l.GetValue())
					}
				}
			}
			if strings.Join(got, ",") != strings.Join(dests, ",") {
				t.Errorf("%s: destinations %q, want %q", mf.GetName(), got, dests)
			}
		case "tendril_agent_vpn_relay_buffers":
			if n := len(mf.GetMetric()); n != 1 {
				t.Errorf("%s: %d series, want the process's one", mf.GetName(), n)
			}
		}
	}
}
