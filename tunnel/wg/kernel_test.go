package wg

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/tunnel/netstack"
	"github.com/tendril-net/tendril/tunnel/tundev"
)

// kernelNet is the network of TestKernelStack, all in namespaces of its own (nothing in the
// test's):
//
//	seed   tendril0 (the server's TUN device)
//	shoot  tendril0 (the agent's), veth 10.218.N.1/24 ⇄ 10.218.N.2/24 and 10.219.N.2/24  pod
//
// 10.218.N.0/24 is the shoot's pod network, which the agent forwards; 10.219.N.0/24 is a
// network the server routes to the agent but the agent does not forward. N comes from the
// process ID; names carry it, so that a killed run's namespaces are removed by the next.
type kernelNet struct {
	seed, shoot, pod string
	podAddr          netip.Addr // in the forwarded network
	podOther         netip.Addr // in the network that is routed but not forwarded
	shootGW          netip.Addr // the shoot's address on the pod network: the masquerade's
	forwarded        netip.Prefix
	notForwarded     netip.Prefix
	// The pod network's IPv6 half: fd00:218:N::/64, the pod ::2, the shoot ::1.
	podAddr6, shootGW6 netip.Addr
	forwarded6         netip.Prefix
}

var kernelNSRE = regexp.MustCompile(`^twg(\d+)-(seed|shoot|pod)$`)

func newKernelNet(t testing.TB) *kernelNet {
	t.Helper()
	if err := netns.Check(); err != nil {
		t.Skip(err)
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skip(err)
	}
	ctx := t.Context()
	netns.RemoveStale(ctx, kernelNSRE)
	pid := os.Getpid()
	n := byte(pid%250 + 1)
	a := func(b, d byte) netip.Addr { return netip.AddrFrom4([4]byte{10, b, n, d}) }
	name := func(role string) string { return "twg" + strconv.Itoa(pid) + "-" + role }
	k := &kernelNet{
		seed: name("seed"), shoot: name("shoot"), pod: name("pod"),
		podAddr: a(218, 2), podOther: a(219, 2), shootGW: a(218, 1),
		forwarded: netip.PrefixFrom(a(218, 0), 24), notForwarded: netip.PrefixFrom(a(219, 0), 24),
		podAddr6:   netip.AddrFrom16([16]byte{0xfd, 0, 2, 0x18, 0, n, 15: 2}),
		shootGW6:   netip.AddrFrom16([16]byte{0xfd, 0, 2, 0x18, 0, n, 15: 1}),
		forwarded6: netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0, 2, 0x18, 0, n}), 64),
	}
	for _, ns := range []string{k.seed, k.shoot, k.pod} {
		if err := netns.IP(ctx, "netns", "add", ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = netns.IP(context.Background(), "netns", "del", ns) })
	}
	s, p := k.shoot, k.pod
	for _, st := range [][]string{
		{"-n", s, "link", "set", "lo", "up"},
		{"-n", p, "link", "set", "lo", "up"},
		{"-n", k.seed, "link", "set", "lo", "up"},
		{"-n", s, "link", "add", "pod0", "type", "veth", "peer", "name", "eth0", "netns", p},
		{"-n", s, "addr", "add", k.shootGW.String() + "/24", "dev", "pod0"},
		{"-n", s, "link", "set", "pod0", "up"},
		{"-n", s, "route", "add", k.notForwarded.String(), "dev", "pod0"},
		{"-n", p, "addr", "add", k.podAddr.String() + "/24", "dev", "eth0"},
		{"-n", p, "addr", "add", k.podOther.String() + "/24", "dev", "eth0"},
		{"-n", s, "addr", "add", k.shootGW6.String() + "/64", "dev", "pod0", "nodad"},
		{"-n", p, "addr", "add", k.podAddr6.String() + "/64", "dev", "eth0", "nodad"},
		{"-n", p, "link", "set", "eth0", "up"},
		// No route back to the server's inner address: replies reach it only through the
		// agent's masquerade.
		{"-n", p, "route", "add", "default", "via", k.shootGW.String()},
		{"-n", p, "route", "add", "default", "via", k.shootGW6.String()},
	} {
		if err := netns.IP(ctx, st...); err != nil {
			t.Fatal(err)
		}
	}
	return k
}

// in runs f in namespace ns, failing the test if it cannot.
func in(t *testing.T, ns string, f func() error) {
	t.Helper()
	if err := netns.In(ns, f); err != nil {
		t.Fatal(err)
	}
}

// TestKernelStack runs both ends on TUN devices (Config.TUN) in namespaces of their own, the
// shoot's pod in a third, in both ways the agent can reach the pod: the kernel forwarding TCP
// (masqueraded), or redirecting it to the agent's handler (Config.TUNHandler), which dials.
// Either way the server reaches the pod, UDP is forwarded, the ends reach each other's inner
// addresses on the ports they listen on through the tunnel, and nothing else of the agent's
// namespace, and no network it does not forward, is reachable from the server (the drops are
// counted).
func TestKernelStack(t *testing.T) {
	t.Run("kernel forwards", func(t *testing.T) { testKernelStack(t, false) })
	t.Run("agent dials", func(t *testing.T) { testKernelStack(t, true) })
}

func testKernelStack(t *testing.T, handler bool) {
	k := newKernelNet(t)
	o := worldOpts{
		kernel:  &[2]string{k.seed, k.shoot},
		forward: &netstack.Forward{Prefixes: []netip.Prefix{k.forwarded, k.forwarded6}},
		routed:  []netip.Prefix{k.notForwarded},
	}
	handled := make(chan netip.AddrPort, 16)
	if handler {
		// The agent's way (vpn.Agent.forwardTUN), dialling from the shoot's namespace.
		o.tunHandler = func(ctx context.Context, c *net.TCPConn, dst netip.AddrPort) {
			handled <- dst
			var up net.Conn
			err := netns.In(k.shoot, func() (err error) {
				up, err = (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", dst.String())
				return err
			})
			if err != nil {
				tundev.Reset(c)
				return
			}
			defer up.Close()
			pipe.Pipe(c, up, time.Minute)
		}
	}
	w := newWorld(t, o)

	// The pod echoes (TCP and UDP) and tells whom it saw.
	var pod net.Listener
	var podUDP net.PacketConn
	in(t, k.pod, func() (err error) {
		if pod, err = net.Listen("tcp", ":8080"); err != nil {
			return err
		}
		podUDP, err = net.ListenPacket("udp", ":5353")
		return err
	})
	seen := make(chan netip.Addr, 16)
	testnet.Serve(t, pod, func(c net.Conn) {
		seen <- c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
		testnet.Echo(c)
	})
	testnet.ServeUDP(t, podUDP, func(b []byte) []byte { return b })

	// dialFrom dials addr over tun, with the socket made in ns.
	dialFrom := func(ns string, tun *Tunnel, network string, addr netip.AddrPort, timeout time.Duration) (c net.Conn, err error) {
		ctx, cancel := context.WithTimeout(t.Context(), timeout)
		defer cancel()
		in(t, ns, func() error { c, err = tun.DialContext(ctx, network, addr.String()); return nil })
		return c, err
	}
	podAt := netip.AddrPortFrom(k.podAddr, 8080)

	for _, tc := range []struct {
		name          string
		pod           netip.AddrPort
		shoot, server netip.Addr
	}{
		{"server to the pod", podAt, k.shootGW, serverAddr4},
		{"server to the pod, IPv6", netip.AddrPortFrom(k.podAddr6, 8080), k.shootGW6, serverAddr},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := w.agent.StackStats().Forwarded
			c, err := dialFrom(k.seed, w.server, "tcp", tc.pod, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := testnet.RoundTrip(c, randomBytes(t, 8<<20)); err != nil {
				t.Fatal(err)
			}
			if src := <-seen; src != tc.shoot {
				t.Fatalf("the pod saw the connection from %v, want the shoot's %v", src, tc.shoot)
			}
			if got := c.LocalAddr().(*net.TCPAddr).AddrPort().Addr().Unmap(); got != tc.server {
				t.Fatalf("server dialed from %v, want its inner %v", got, tc.server)
			}
			if handler {
				if dst := <-handled; dst != tc.pod {
					t.Fatalf("the handler was given %v, want %v", dst, tc.pod)
				}
				if n := w.agent.StackStats().Forwarded - before; n != 1 {
					t.Fatalf("the agent's stack counted %d forwarded connections, want 1", n)
				}
			}
		})
	}

	if handler {
		t.Run("a refused dial resets", func(t *testing.T) {
			// The agent's kernel completes the handshake and the handler resets the connection
			// once its own dial failed. The reset usually comes after the dial returned; on a
			// busy machine it can come before Go has read the connect's result, and the dial
			// itself reports it.
			c, err := dialFrom(k.seed, w.server, "tcp", netip.AddrPortFrom(k.podAddr, 8081), 10*time.Second)
			if err == nil {
				defer c.Close()
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, err = c.Read(make([]byte, 1))
			}
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("dial or read after the agent's dial failed: %v, want a reset", err)
			}
		})
	}

	t.Run("UDP to the pod", func(t *testing.T) {
		c, err := dialFrom(k.seed, w.server, "udp", netip.AddrPortFrom(k.podAddr, 5353), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("a query")); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 64)
		n, err := c.Read(b)
		if err != nil || string(b[:n]) != "a query" {
			t.Fatalf("read %q, %v; want the query back", b[:n], err)
		}
	})

	t.Run("inner addresses, on ports listened on through the tunnel", func(t *testing.T) {
		for _, tc := range []struct {
			name         string
			ns, listenNS string
			from, to     *Tunnel
			addr         netip.Addr
		}{
			{"server to agent", k.seed, k.shoot, w.server, w.agent, agentAddr},
			{"agent to server", k.shoot, k.seed, w.agent, w.server, serverAddr},
		} {
			var ln net.Listener
			in(t, tc.listenNS, func() (err error) { ln, err = tc.to.ListenTCP(netip.AddrPortFrom(tc.addr, 0)); return err })
			testnet.Serve(t, ln, testnet.Echo)
			c, err := dialFrom(tc.ns, tc.from, "tcp", ln.Addr().(*net.TCPAddr).AddrPort(), 10*time.Second)
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			err = testnet.RoundTrip(c, randomBytes(t, 1<<20))
			c.Close()
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
		}
	})

	t.Run("nothing else", func(t *testing.T) {
		// A listener of the agent's namespace that was not opened through the tunnel, on every
		// address: the agent's inner one included.
		var other net.Listener
		in(t, k.shoot, func() (err error) { other, err = net.Listen("tcp", ":0"); return err })
		testnet.Serve(t, other, testnet.Echo)
		before := w.agent.StackStats().Dropped[netstack.DropNotTCP]
		for _, dst := range []netip.AddrPort{
			netip.AddrPortFrom(agentAddr, other.Addr().(*net.TCPAddr).AddrPort().Port()),
			netip.AddrPortFrom(k.podOther, 8080), // routed to the agent, not forwarded by it
		} {
			c, err := dialFrom(k.seed, w.server, "tcp", dst, 2*time.Second)
			if err == nil {
				c.Close()
				t.Fatalf("the server reached %v through the agent", dst)
			}
			t.Logf("%v: %v", dst, err)
		}
		if d := w.agent.StackStats().Dropped[netstack.DropNotTCP] - before; d < 2 {
			t.Fatalf("the agent counted %d dropped packets, want at least one SYN of each dial", d)
		}
	})

	t.Run("not routed into the tunnel", func(t *testing.T) {
		// The server's sockets are bound to its device: an address the tunnel does not route
		// is unreachable, not dialled through the seed's own network.
		var local net.Listener
		in(t, k.seed, func() (err error) { local, err = net.Listen("tcp", "127.0.0.1:0"); return err })
		testnet.Serve(t, local, testnet.Echo)
		c, err := dialFrom(k.seed, w.server, "tcp", local.Addr().(*net.TCPAddr).AddrPort(), 2*time.Second)
		if err == nil {
			c.Close()
			t.Fatal("the server's tunnel dialled its own namespace's loopback")
		}
		if !errors.Is(err, tundev.ErrNoRoute) {
			t.Fatalf("got %v, want %v", err, tundev.ErrNoRoute)
		}
	})

	t.Run("a prefix routed later", func(t *testing.T) {
		// Route (the HA takeover) routes a prefix into the device too: a dial into it then goes
		// through the tunnel (where the agent, which does not forward it, drops it).
		later := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 220, k.podAddr.As4()[2], 2}), 8080)
		if _, err := dialFrom(k.seed, w.server, "tcp", later, time.Second); !errors.Is(err, tundev.ErrNoRoute) {
			t.Fatalf("before Route: %v, want %v", err, tundev.ErrNoRoute)
		}
		if err := w.server.Route(w.agentKey.PublicKey(), []netip.Prefix{netip.PrefixFrom(later.Addr(), 24)}); err != nil {
			t.Fatal(err)
		}
		_, err := dialFrom(k.seed, w.server, "tcp", later, time.Second)
		if err == nil || errors.Is(err, tundev.ErrNoRoute) {
			t.Fatalf("after Route: %v, want a dial through the tunnel that the agent drops", err)
		}
	})
}
