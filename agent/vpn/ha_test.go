package vpn

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
)

var (
	serverAddr4 = netip.MustParseAddr("198.18.0.1")
	// haDNS is a "DNS server" in the shoot's network of newHAWorld: a UDP echo on loopback.
	haDNS = netip.MustParseAddrPort("10.99.0.53:53")
	// haGreeter is a "pod" that says hi and hangs up (it closes first).
	haGreeter = netip.MustParseAddrPort("10.99.0.2:7")
)

// udpEchoServer answers each datagram with "answer: <datagram>" until the test ends.
func udpEchoServer(t *testing.T) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testnet.ServeUDP(t, pc, func(b []byte) []byte { return append([]byte("answer: "), b...) })
	return pc.LocalAddr().String()
}

// haWorld is one server and n agents, each reaching the server's tunnel port through its own
// proxy (which the test can blackhole), all forwarding into "the shoot's network": loopback,
// where an echo server runs.
type haWorld struct {
	srv     *seedserver.Server
	agents  []*Agent
	keys    []wg.Key
	proxies []*testnet.Proxy
	regs    []*prometheus.Registry // agent i's metrics
	srvReg  *prometheus.Registry   // the server's
	stops   []func()               // stop agent i
	starts  []func()               // start agent i (buildHAWorld; newHAWorld starts them all)
	echo    netip.AddrPort
}

func newHAWorld(t *testing.T, n int) *haWorld {
	t.Helper()
	return newHAWorldBackoff(t, n, 20*time.Millisecond, 200*time.Millisecond)
}

// newHAWorldBackoff is newHAWorld with the agents' reconnect backoff given.
func newHAWorldBackoff(t *testing.T, n int, minBackoff, maxBackoff time.Duration) *haWorld {
	t.Helper()
	return newHAWorldPath(t, n, minBackoff, maxBackoff, 0)
}

// newHAWorldPath is newHAWorldBackoff with every agent's path to the server slowed to a round
// trip of rtt (slowPath); 0 for loopback.
func newHAWorldPath(t *testing.T, n int, minBackoff, maxBackoff, rtt time.Duration) *haWorld {
	t.Helper()
	w := buildHAWorld(t, n, minBackoff, maxBackoff, rtt)
	for _, start := range w.starts {
		start()
	}
	return w
}

// buildHAWorld is newHAWorldPath with no agent started yet: w.starts[i] starts agent i.
func buildHAWorld(t *testing.T, n int, minBackoff, maxBackoff, rtt time.Duration) *haWorld {
	t.Helper()
	// The shoot's network is 10.99.0.0/24 in the tunnel; the agents' dialer maps it to the echo
	// on loopback (gVisor drops packets to loopback addresses arriving on its NIC).
	realEcho := testnet.EchoServer(t)
	realDNS := udpEchoServer(t)
	greeter, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testnet.Serve(t, greeter, func(c net.Conn) { _, _ = io.WriteString(c, "hi") })
	echo := netip.MustParseAddrPort("10.99.0.1:7")
	shoot := []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}
	dialShoot := func(ctx context.Context, network, addr string) (net.Conn, error) {
		switch {
		case network == "tcp" && addr == echo.String():
			return (&net.Dialer{}).DialContext(ctx, network, realEcho)
		case network == "tcp" && addr == haGreeter.String():
			return (&net.Dialer{}).DialContext(ctx, network, greeter.Addr().String())
		case network == "udp" && addr == haDNS.String():
			return (&net.Dialer{}).DialContext(ctx, network, realDNS)
		}
		return nil, fmt.Errorf("nothing at %s %s", network, addr)
	}
	serverKey, _ := wg.GenerateKey()
	w := &haWorld{echo: echo}
	var peers []wg.Peer
	for i := range n {
		k, _ := wg.GenerateKey()
		w.keys = append(w.keys, k)
		peers = append(peers, wg.Peer{PublicKey: k.PublicKey(), AllowedIPs: []netip.Prefix{netip.PrefixFrom(haAgentAddr(i), 128)}})
	}
	w.srvReg = prometheus.NewRegistry()
	srv, err := seedserver.New(seedserver.Config{
		Tunnel:     wg.Config{PrivateKey: serverKey, LocalAddresses: []netip.Addr{serverAddr, serverAddr4}, Peers: peers},
		ShootCIDRs: shoot, Registry: w.srvReg,
		Log: testr.New(t).WithName("server"),
	})
	if err != nil {
		t.Fatal(err)
	}
	w.srv = srv
	tl := listen(t, "127.0.0.1:0")
	ctx, cancel := context.WithCancel(context.Background())
	var wgr sync.WaitGroup
	wgr.Add(1)
	go func() { defer wgr.Done(); _ = srv.ServeTunnel(ctx, tl) }()
	t.Cleanup(func() { cancel(); wgr.Wait(); srv.Close() })
	target := tl.Addr().String()
	if rtt > 0 {
		target = slowPath(t, target, rtt)
	}
	for i := range n {
		p := testnet.NewProxy(t, target)
		w.proxies = append(w.proxies, p)
		reg := prometheus.NewRegistry()
		w.regs = append(w.regs, reg)
		a, err := New(Config{Registry: reg, PrivateKey: w.keys[i], ServerPublicKey: serverKey.PublicKey(), Address: haAgentAddr(i),
			ServerAddresses: []netip.Addr{serverAddr, serverAddr4}, ShootCIDRs: shoot, Seed: p.Addr, Direct: true, Dial: dialShoot,
			MinBackoff: minBackoff, MaxBackoff: maxBackoff, Log: testr.New(t).WithName("agent")})
		if err != nil {
			t.Fatal(err)
		}
		w.agents = append(w.agents, a)
		actx, acancel := context.WithCancel(ctx)
		done := make(chan struct{})
		var started, once sync.Once
		w.starts = append(w.starts, func() { started.Do(func() { go func() { defer close(done); _ = a.Run(actx) }() }) })
		stop := func() {
			once.Do(func() {
				acancel()
				started.Do(func() { close(done) }) // never started: nothing to wait for
				<-done
				a.Close()
			})
		}
		w.stops = append(w.stops, stop)
		t.Cleanup(stop)
	}
	return w
}

// TestFirstLiveAgentTakesOver: at the server's start the shoot's networks go to the agent that
// comes up first, at once, even if it is not the first configured; that is no failover, and the
// first configured one, when it comes, stays a live standby.
func TestFirstLiveAgentTakesOver(t *testing.T) {
	w := buildHAWorld(t, 2, 20*time.Millisecond, 200*time.Millisecond, 0)
	ctx := t.Context()
	w.starts[1]()
	eventually(t, "agent 1 active", func() error {
		st, err := w.srv.Agents()
		if err != nil {
			return err
		}
		if !st[1].Live || !st[1].Active {
			return errNotYet("agent 1 live %v, active %v", st[1].Live, st[1].Active)
		}
		return nil
	})
	if err := w.roundTrip(ctx); err != nil {
		t.Fatalf("through agent 1: %v", err)
	}
	w.starts[0]()
	var active int
	eventually(t, "both live", func() (err error) { active, err = w.activeWhenAllLive(); return err })
	// A second's watching: agent 0 stays standby (its stream is not closed, nothing moves).
	for range 4 {
		time.Sleep(250 * time.Millisecond)
		if a, err := w.activeWhenAllLive(); err != nil || a != 1 {
			t.Fatalf("active agent %d (%v), want 1 with both live", a, err)
		}
	}
	if active != 1 {
		t.Fatalf("active agent %d, want 1", active)
	}
	if n := w.srv.Failovers(); n != 0 {
		t.Fatalf("%d failovers counted, want 0 (the first agent up is no failover)", n)
	}
	if err := w.roundTrip(ctx); err != nil {
		t.Fatalf("with both agents: %v", err)
	}
}

func haAgentAddr(i int) netip.Addr {
	b := agentAddr.As16()
	b[15] += byte(i)
	return netip.AddrFrom16(b)
}

// roundTrip dials the echo in the shoot's network through the tunnel, as an egress front-end
// does, and checks one echo.
func (w *haWorld) roundTrip(ctx context.Context) error {
	c, err := w.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	return testnet.RoundTrip(c, []byte("ping"))
}

func (w *haWorld) dial(ctx context.Context) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := w.srv.Tunnel().DialContext(dctx, "tcp", w.echo.String())
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c, nil
}

// active returns the index of the active agent once every agent is live.
func (w *haWorld) activeWhenAllLive() (int, error) {
	st, err := w.srv.Agents()
	if err != nil {
		return -1, err
	}
	active := -1
	for i, a := range st {
		if !a.Live {
			return -1, errNotYet("agent %d not live", i)
		}
		if a.Active {
			active = i
		}
	}
	if active < 0 {
		return -1, errNotYet("no active agent")
	}
	return active, nil
}

// activeConn waits until every agent is live and a round trip passes through the active one; it
// returns the active agent's index and a connection through it, closed when the test ends.
func (w *haWorld) activeConn(t *testing.T) (int, net.Conn) {
	t.Helper()
	ctx := t.Context()
	var active int
	eventually(t, "both agents live", func() error {
		var err error
		active, err = w.activeWhenAllLive()
		return err
	})
	eventually(t, "a round trip through the active agent", func() error { return w.roundTrip(ctx) })
	c, err := w.dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return active, c
}

// TestHAFailover runs two agents; the active one dies (stops, or its path silently stops
// forwarding for good); a connection through it fails, new dials go through the other agent.
func TestHAFailover(t *testing.T) {
	for _, tc := range []struct {
		name string
		kill func(w *haWorld, i int)
	}{
		{"agent stops", func(w *haWorld, i int) { w.stops[i]() }},
		// The path goes silent for good: the agent's redials get nowhere either. (A path that
		// only lost its current connection is the agent's to replace: TestDeadPath.)
		{"path cut", func(w *haWorld, i int) { w.proxies[i].Cut() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newHAWorld(t, 2)
			ctx := t.Context()
			active, old := w.activeConn(t)
			if _, err := old.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(old, make([]byte, 5)); err != nil {
				t.Fatal(err)
			}

			tc.kill(w, active)
			other := 1 - active
			eventually(t, "the other agent takes over", func() error {
				st, err := w.srv.Agents()
				if err != nil {
					return err
				}
				if !st[other].Active {
					return errNotYet("agent %d not active yet", other)
				}
				return nil
			})
			eventually(t, "a round trip after the failover", func() error { return w.roundTrip(ctx) })
			if n := w.srv.Failovers(); n != 1 {
				t.Errorf("failovers = %d, want 1", n)
			}
			// The connection through the dead agent does not carry on through the other one.
			_ = old.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := old.Write([]byte("still there?")); err == nil {
				buf := make([]byte, 16)
				if n, err := old.Read(buf); err == nil {
					t.Errorf("a connection through the dead agent still echoes %q", buf[:n])
				}
			}
		})
	}
}

// slowPath forwards TCP connections to target as a path with a round trip of rtt would: each
// connection starts carrying data 2 × rtt after it is accepted (the TCP handshake and the
// CONNECT through the ingress that a real agent's stream needs before its first frame), and
// every chunk arrives rtt/2 after it was read. When either side ends, the connection ends once
// what was in flight is delivered. It returns the listener's address.
func slowPath(t *testing.T, target string, rtt time.Duration) string {
	t.Helper()
	dial := func() (net.Conn, error) {
		time.Sleep(2 * rtt)
		return net.Dial("tcp", target)
	}
	// carry copies src to dst, each chunk rtt/2 late, then closes both.
	carry := func(dst, src net.Conn) {
		type chunk struct {
			due time.Time
			b   []byte
		}
		q := make(chan chunk, 256) // bounded: a full queue stops the reader, as a full window would
		var reader sync.WaitGroup
		defer reader.Wait()
		reader.Go(func() {
			defer close(q)
			for {
				buf := make([]byte, 32<<10)
				n, err := src.Read(buf)
				if n > 0 {
					q <- chunk{time.Now().Add(rtt / 2), buf[:n]}
				}
				if err != nil {
					return
				}
			}
		})
		defer src.Close()
		defer dst.Close()
		for c := range q {
			time.Sleep(time.Until(c.due))
			if _, err := dst.Write(c.b); err != nil {
				return
			}
		}
	}
	return testnet.Forward(t, dial, carry)
}

// TestBlipDoesNotFailOver: the active agent's stream breaks (an ingress replica restarted) on a
// path with a long round trip while the agent lives. The agent dials again with its default
// backoff and is back before the server's grace runs out: the shoot's networks stay with it and
// a connection through it carries on, each of several times. (Moving the networks as soon as
// the stream closed, or after a grace shorter than the agent's return, fails this: the agent
// returns 0.1–0.2 s + 2.5 × 100 ms after the break.)
func TestBlipDoesNotFailOver(t *testing.T) {
	const rtt = 100 * time.Millisecond
	w := newHAWorldPath(t, 2, 200*time.Millisecond, 15*time.Second, rtt) // the agent's default backoff
	active, held := w.activeConn(t)
	_ = held.SetDeadline(time.Time{})
	a := w.agents[active]
	// The server starts with the first agent active; if the other was live first, the networks
	// moved to it during the bring-up: those failovers are not the blips'.
	before := w.srv.Failovers()
	for i := range 3 {
		eventually(t, "the server answers a heartbeat on this stream", func() error {
			if n := a.echoedStreams.Load(); n < uint64(i+1) {
				return errNotYet("%d streams echoed, want %d", n, i+1)
			}
			return nil
		})
		attached := w.srv.Tunnel().BindStats().StreamsAttached
		w.proxies[active].Reset()
		eventually(t, "the agent's new stream", func() error {
			if n := w.srv.Tunnel().BindStats().StreamsAttached; n <= attached {
				return errNotYet("no new stream yet")
			}
			return nil
		})
		// Past every grace the server has (the agent is live again well before), the networks
		// are still with the agent that blipped.
		time.Sleep(1500 * time.Millisecond)
		if _, err := w.activeWhenAllLive(); err != nil {
			t.Fatalf("blip %d: %v", i+1, err)
		}
		if n := w.srv.Failovers() - before; n != 0 {
			t.Fatalf("blip %d: %d failovers, want none", i+1, n)
		}
		_ = held.SetDeadline(time.Now().Add(10 * time.Second))
		msg := fmt.Sprintf("after blip %d", i+1)
		if _, err := io.WriteString(held, msg); err != nil {
			t.Fatalf("blip %d: the connection through the agent: %v", i+1, err)
		}
		if got, err := io.ReadAll(io.LimitReader(held, int64(len(msg)))); err != nil || string(got) != msg {
			t.Fatalf("blip %d: the connection through the agent echoed %q, %v", i+1, got, err)
		}
	}
}

// TestDeadPath: the agent's only path stops forwarding without closing; the agent's heartbeats
// go unanswered, it ends the stream and dials again, and the tunnel works again.
func TestDeadPath(t *testing.T) {
	w := newHAWorld(t, 1)
	ctx := t.Context()
	eventually(t, "the first round trip", func() error { return w.roundTrip(ctx) })
	eventually(t, "the server echoes a heartbeat", func() error {
		if !w.agents[0].echoSeen.Load() {
			return errNotYet("no echo yet")
		}
		return nil
	})
	attached := w.srv.Tunnel().BindStats().StreamsAttached
	w.proxies[0].Blackhole()
	eventually(t, "the agent gives up on the silent path", func() error {
		if n := counterValue(t, w.agents[0].pathTimeouts); n < 1 {
			return errNotYet("path timeouts %v", n)
		}
		return nil
	})
	eventually(t, "a round trip over the new stream", func() error { return w.roundTrip(ctx) })
	if n := w.srv.Tunnel().BindStats().StreamsAttached; n <= attached {
		t.Errorf("the server saw %d streams, want more than %d after the reconnect", n, attached)
	}
	// The server closes the silent stream the agent left (it is no agent's endpoint any more).
	eventually(t, "the server closes the abandoned stream", func() error {
		if n := w.srv.Tunnel().BindStats().StreamsActive; n != 1 {
			return errNotYet("%d streams attached", n)
		}
		return nil
	})
}

// TestBackoffStartsOverAfterAHealthyStream: the path to the seed is reset again and again
// (restarts of the server or the ingress), each time after the server answered heartbeats on
// the stream; the agent comes back after its shortest backoff each time, not after a doubled
// one. MaxBackoff is large so that the doubling would show: without the start-over the
// seventh reset waits at least 0.2 s × 2⁶ / 2 = 6.4 s, past the 5 s deadline.
func TestBackoffStartsOverAfterAHealthyStream(t *testing.T) {
	w := newHAWorldBackoff(t, 1, 200*time.Millisecond, time.Minute)
	ctx := t.Context()
	a := w.agents[0]
	for i := range 8 {
		eventually(t, "a round trip", func() error { return w.roundTrip(ctx) })
		eventually(t, "the server answers a heartbeat on this stream", func() error {
			if n := a.echoedStreams.Load(); n < uint64(i+1) {
				return errNotYet("%d streams echoed, want %d", n, i+1)
			}
			return nil
		})
		attached := w.srv.Tunnel().BindStats().StreamsAttached
		w.proxies[0].Reset()
		// A deadline, not a measurement: the start-over waits 0.1–0.2 s.
		deadline := time.Now().Add(5 * time.Second)
		for w.srv.Tunnel().BindStats().StreamsAttached <= attached {
			if time.Now().After(deadline) {
				t.Fatalf("reset %d: no new stream within 5 s (the backoff did not start over)", i+1)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

func errNotYet(format string, args ...any) error { return fmt.Errorf(format, args...) }

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// TestForwardDNS: a UDP query from the seed through the tunnel reaches the shoot's "DNS server"
// and the answer comes back; each query is its own flow, which ends with its answer.
func TestForwardDNS(t *testing.T) {
	w := newHAWorld(t, 1)
	ctx := t.Context()
	eventually(t, "the first round trip", func() error { return w.roundTrip(ctx) })
	for i := range 3 {
		c, err := w.srv.Tunnel().DialContext(ctx, "udp", haDNS.String())
		if err != nil {
			t.Fatal(err)
		}
		q := fmt.Sprintf("query %d", i)
		if _, err := c.Write([]byte(q)); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 128)
		n, err := c.Read(buf)
		c.Close()
		if err != nil || string(buf[:n]) != "answer: "+q {
			t.Fatalf("%s: %q, %v", q, buf[:n], err)
		}
	}
	eventually(t, "the answered flows end", func() error {
		if st := w.agents[0].Tunnel().StackStats(); st.UDPFlows != 3 || st.UDPFlowsActive != 0 {
			return errNotYet("stack stats %+v", st)
		}
		return nil
	})
}

// TestStackRefusalsExported: a connection the agent's stack refuses is counted by reason in
// tendril_agent_vpn_stack_refused_total (the seed dials the agent's own address on a port
// nothing listens on: a reset, reason local-port-closed), and the server exports its stack's
// drops.
func TestStackRefusalsExported(t *testing.T) {
	w := newHAWorld(t, 1)
	ctx := t.Context()
	eventually(t, "the first round trip", func() error { return w.roundTrip(ctx) })
	refused := func() float64 {
		return metrictest.Sum(t, w.regs[0], "tendril_agent_vpn_stack_refused_total", map[string]string{"reason": "local-port-closed"})
	}
	if n := refused(); n != 0 {
		t.Fatalf("%v refusals before any", n)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := w.srv.Tunnel().DialContext(dctx, "tcp", netip.AddrPortFrom(haAgentAddr(0), 9).String())
	if err == nil {
		c.Close()
		t.Fatal("a dial to a port nothing listens on succeeded")
	}
	if n := refused(); n != 1 {
		t.Errorf("%v refusals counted for one refused dial (%v)", n, err)
	}
	if n, err := testutil.GatherAndCount(w.srvReg, "tendril_server_tunnel_stack_dropped_total"); err != nil || n != 3 {
		t.Errorf("server: %d drop series (%v), want 3", n, err)
	}
}

// TestSequentialDialsPodClosesFirst: many short connections to a pod that closes first all
// succeed. The agent's end of each is left in TIME-WAIT, and gVisor drops a SYN that reuses its
// addresses and ports (the server's stack picks source ports at random) until TIME-WAIT ends:
// with gVisor's 60 s about one dial in a few hundred hung (netstack.timeWait).
func TestSequentialDialsPodClosesFirst(t *testing.T) {
	w := newHAWorld(t, 1)
	ctx := t.Context()
	eventually(t, "the first round trip", func() error { return w.roundTrip(ctx) })
	for i := range 1500 {
		dctx, cancel := context.WithTimeout(ctx, 5*time.Second) // one SYN retransmission is 1 s
		c, err := w.srv.Tunnel().DialContext(dctx, "tcp", haGreeter.String())
		cancel()
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(b) != "hi" {
			t.Fatalf("dial %d: read %q, %v", i, b, err)
		}
	}
}
