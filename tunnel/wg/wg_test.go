package wg

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/tunnel/bind"
	"github.com/tendril-net/tendril/tunnel/frame"
	"github.com/tendril-net/tendril/tunnel/netstack"
	"github.com/tendril-net/tendril/tunnel/tundev"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Inner addresses from Gardener's VPN range fd8f:6d53:b97a:1::/96, and an IPv4 one for the
// server from Gardener's legacy VPN range 192.168.123.0/24, so that it can dial IPv4 shoot
// networks.
var (
	serverAddr  = netip.MustParseAddr("fd8f:6d53:b97a:1::1")
	agentAddr   = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
	serverAddr4 = netip.MustParseAddr("192.168.123.1")
)

// world is a seed server and an agent tunnel joined by real loopback TCP connections: the
// agent dials the server's listener (as it dials the ingress's CONNECT port), the server
// attaches what it accepts, the agent attaches what it dialed to its peer, the server.
type world struct {
	t             testing.TB
	server, agent *Tunnel
	serverKey     Key
	agentKey      Key
	ln            net.Listener
	serverEP      chan *bind.Endpoint // endpoints the server attached, in order
	acceptDone    chan struct{}
	lastAgentConn net.Conn
	lastAgentEP   *bind.Endpoint
	lastServerEP  *bind.Endpoint
}

type worldOpts struct {
	mtu int
	// agentKey, if set, is the agent's private key; the server's peer stays the key the world
	// generated, so a different one is the wrong key.
	agentKey *Key
	// forward, if set, is the agent's Forward. The server then has serverAddr4 as well, and
	// routes forward.Prefixes and routed to the agent.
	forward *netstack.Forward
	// routed are more prefixes the server routes to the agent (which may not forward them).
	routed []netip.Prefix
	// newStack, if set, builds both ends' netstacks (the benchmark's comparison).
	newStack func(netstack.Config) (innerStack, error)
	// kernel, if set, are the network namespaces of the server and the agent: each end then
	// runs on a TUN device "tendril0" in its namespace (Config.TUN), made there.
	kernel *[2]string
	// tunHandler, with kernel, is the agent's TUNHandler.
	tunHandler tundev.Handler
}

func newKey(t testing.TB) Key {
	t.Helper()
	k, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func newWorld(t testing.TB, o worldOpts) *world {
	t.Helper()
	w := &world{t: t, serverKey: newKey(t), agentKey: newKey(t), serverEP: make(chan *bind.Endpoint, 16), acceptDone: make(chan struct{})}
	agentPriv := w.agentKey
	if o.agentKey != nil {
		agentPriv = *o.agentKey
	}
	newStack := o.newStack
	if newStack == nil {
		newStack = func(cfg netstack.Config) (innerStack, error) { return netstack.New(cfg) }
	}
	serverCfg := Config{
		PrivateKey:     w.serverKey,
		Logger:         testr.NewWithInterface(t, testr.Options{LogTimestamp: true}).WithName("server"),
		LocalAddresses: []netip.Addr{serverAddr},
		MTU:            o.mtu,
		Peers: []Peer{{
			PublicKey:  w.agentKey.PublicKey(),
			AllowedIPs: []netip.Prefix{netip.PrefixFrom(agentAddr, 128)},
		}},
	}
	agentCfg := Config{
		PrivateKey:     agentPriv,
		Logger:         testr.NewWithInterface(t, testr.Options{LogTimestamp: true}).WithName("agent"),
		LocalAddresses: []netip.Addr{agentAddr},
		MTU:            o.mtu,
		Peers: []Peer{{
			PublicKey:           w.serverKey.PublicKey(),
			AllowedIPs:          []netip.Prefix{netip.PrefixFrom(serverAddr, 128)},
			PersistentKeepalive: 25 * time.Second,
		}},
	}
	if o.forward != nil {
		serverCfg.LocalAddresses = append(serverCfg.LocalAddresses, serverAddr4)
		serverCfg.Peers[0].AllowedIPs = append(append(serverCfg.Peers[0].AllowedIPs, o.forward.Prefixes...), o.routed...)
		agentCfg.Peers[0].AllowedIPs = append(agentCfg.Peers[0].AllowedIPs, netip.PrefixFrom(serverAddr4, 32))
		agentCfg.Forward = *o.forward
		agentCfg.TUNHandler = o.tunHandler
	}
	// start starts the server's end (0) or the agent's (1).
	start := func(cfg Config, _ int) (*Tunnel, error) { return newTunnel(cfg, newStack) }
	if o.kernel != nil {
		serverCfg.TUN, agentCfg.TUN = "tendril0", "tendril0"
		start = func(cfg Config, end int) (tun *Tunnel, err error) {
			err = netns.In(o.kernel[end], func() (err error) { tun, err = New(cfg); return err })
			return tun, err
		}
	}
	var err error
	w.server, err = start(serverCfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.server.Close() })
	w.agent, err = start(agentCfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.agent.Close() })

	w.ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(w.acceptDone)
		for {
			c, err := w.ln.Accept()
			if err != nil {
				return
			}
			ep, err := w.server.Attach(c)
			if err != nil {
				t.Errorf("server attach: %v", err)
				return
			}
			w.serverEP <- ep
		}
	}()
	t.Cleanup(func() { w.ln.Close(); <-w.acceptDone })
	w.connect()
	if o.agentKey == nil {
		// Let the agent's handshake finish before the test sends: a server that has data for
		// the agent while the agent's initiation is being answered initiates too, and
		// wireguard-go resolves crossing initiations only by its 5 s retry.
		for _, tun := range []*Tunnel{w.agent, w.server} {
			testwait.Until(t, "first handshake", func() bool {
				ps, err := tun.Peers()
				return err == nil && !ps[0].LastHandshake.IsZero()
			})
		}
	}
	return w
}

// connect dials a new stream from the agent to the server and attaches both ends.
func (w *world) connect() {
	w.t.Helper()
	c, err := net.Dial("tcp", w.ln.Addr().String())
	if err != nil {
		w.t.Fatal(err)
	}
	ep, err := w.agent.AttachPeer(c, w.serverKey.PublicKey())
	if err != nil {
		w.t.Fatal(err)
	}
	select {
	case w.lastServerEP = <-w.serverEP:
	case <-time.After(5 * time.Second):
		w.t.Fatal("server did not attach the stream")
	}
	w.lastAgentConn, w.lastAgentEP = c, ep
}

func listen(t testing.TB, tun *Tunnel, addr netip.Addr, port uint16) net.Listener {
	t.Helper()
	ln, err := tun.ListenTCP(netip.AddrPortFrom(addr, port))
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func dial(t testing.TB, tun *Tunnel, addr netip.Addr, port uint16, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	return tun.DialContext(ctx, "tcp", netip.AddrPortFrom(addr, port).String())
}

func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// way is one direction through the tunnel: from one end to the other's inner address.
type way struct {
	name string
	from *Tunnel
	to   netip.Addr
}

// echoBothWays serves an echo on port 7000 of each end's inner address until the test ends, and
// returns the two ways to them.
func (w *world) echoBothWays(t testing.TB) []way {
	t.Helper()
	testnet.Serve(t, listen(t, w.agent, agentAddr, 7000), testnet.Echo)
	testnet.Serve(t, listen(t, w.server, serverAddr, 7000), testnet.Echo)
	return []way{{"server to agent", w.server, agentAddr}, {"agent to server", w.agent, serverAddr}}
}

// TestEchoBothWays sends 8 MB through an echo server on each side: the server dials the
// agent's inner address (path 4) and the agent dials the server's.
func TestEchoBothWays(t *testing.T) {
	w := newWorld(t, worldOpts{})
	payload := randomBytes(t, 8<<20)
	for _, tc := range w.echoBothWays(t) {
		t.Run(tc.name, func(t *testing.T) {
			c, err := dial(t, tc.from, tc.to, 7000, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := testnet.RoundTrip(c, payload); err != nil {
				t.Fatal(err)
			}
		})
	}
	ps, err := w.server.Peers()
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 1 || ps[0].PublicKey != w.agentKey.PublicKey() || ps[0].LastHandshake.IsZero() ||
		ps[0].RxBytes < 2*8<<20 || ps[0].TxBytes < 2*8<<20 || ps[0].Endpoint == "" {
		t.Fatalf("server's view of the agent: %+v", ps)
	}
	if st := w.server.BindStats(); st.StreamsActive != 1 || st.PacketsIn == 0 || st.PacketsOut == 0 {
		t.Fatalf("server bind stats: %+v", st)
	}
}

// TestManyConnections opens 200 connections at once from the server to the agent.
func TestManyConnections(t *testing.T) {
	w := newWorld(t, worldOpts{})
	testnet.Serve(t, listen(t, w.agent, agentAddr, 7000), testnet.Echo)
	concurrently(t, 200, func(i int) error {
		c, err := dial(t, w.server, agentAddr, 7000, 20*time.Second)
		if err != nil {
			return fmt.Errorf("conn %d: %w", i, err)
		}
		defer c.Close()
		if err := testnet.RoundTrip(c, []byte(fmt.Sprintf("hello %d", i))); err != nil {
			return fmt.Errorf("conn %d: %w", i, err)
		}
		return nil
	})
}

// concurrently runs f(0) to f(n-1) at once and, once all have returned, fails t with each
// error they returned.
func concurrently(t testing.TB, n int, f func(i int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(i); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestStalledReaderDoesNotStallOthers holds one connection that the agent never reads, fills
// its window, and checks that a 32 MB transfer on another connection of the same tunnel still
// completes: each inner TCP connection has its own flow control.
func TestStalledReaderDoesNotStallOthers(t *testing.T) {
	w := newWorld(t, worldOpts{})
	release := make(chan struct{})
	testnet.Serve(t, listen(t, w.agent, agentAddr, 7001), func(c net.Conn) { <-release }) // never reads
	received := make(chan int64, 1)
	testnet.Serve(t, listen(t, w.agent, agentAddr, 7002), func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		received <- n
	})
	defer close(release)

	stalled, err := dial(t, w.server, agentAddr, 7001, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	// Fill the stalled connection until writes stop making progress.
	stalledWrites := make(chan int64, 1)
	go func() {
		var n int64
		buf := make([]byte, 64<<10)
		for {
			m, err := stalled.Write(buf)
			n += int64(m)
			if err != nil {
				stalledWrites <- n
				return
			}
		}
	}()

	const size = 32 << 20
	bulk, err := dial(t, w.server, agentAddr, 7002, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer bulk.Close()
	if _, err := io.CopyN(bulk, zeros{}, size); err != nil {
		t.Fatalf("bulk write: %v", err)
	}
	bulk.(interface{ CloseWrite() error }).CloseWrite()
	select {
	case n := <-received:
		if n != size {
			t.Fatalf("agent received %d bytes, want %d", n, size)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("32 MB transfer did not complete beside a stalled connection")
	}
	stalled.Close()
	if n := <-stalledWrites; n >= size {
		t.Fatalf("the unread connection accepted %d bytes: it was not stalled", n)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestStreamBreakAndReattach cuts the agent's TCP connection, dials a new one, and checks that
// the server reaches the agent over it.
func TestStreamBreakAndReattach(t *testing.T) {
	w := newWorld(t, worldOpts{})
	testnet.Serve(t, listen(t, w.agent, agentAddr, 7000), testnet.Echo)
	check := func(what string) {
		t.Helper()
		c, err := dial(t, w.server, agentAddr, 7000, 10*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer c.Close()
		if err := testnet.RoundTrip(c, []byte(what)); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	check("before the break")
	old := w.lastAgentEP
	start := time.Now()
	w.lastAgentConn.Close()
	select {
	case <-old.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("agent did not detach its closed stream")
	}
	testwait.Until(t, "server detaches the broken stream", func() bool { return w.server.BindStats().StreamsActive == 0 })
	t.Logf("both sides detached after %v", time.Since(start))

	w.connect()
	// The server cannot know the new stream before the agent's first packet on it arrives
	// (AttachPeer sends a keepalive and a handshake at once); a dial before that goes to the
	// dead stream and waits for a SYN retransmission.
	start = time.Now()
	testwait.Until(t, "server roams the agent to the new stream", func() bool {
		ps, err := w.server.Peers()
		return err == nil && ps[0].Endpoint == w.lastServerEP.DstToString()
	})
	t.Logf("server roamed to the new stream after %v", time.Since(start))
	start = time.Now()
	check("after the reattach")
	t.Logf("check after the reattach took %v", time.Since(start))
	st := w.server.BindStats()
	// Closing a connection with unread data resets it, so the server may see a read or write
	// error rather than EOF: any one reason, once.
	var detached uint64
	for _, n := range st.StreamsDetached {
		detached += n
	}
	if st.StreamsAttached != 2 || st.StreamsActive != 1 || detached != 1 {
		t.Fatalf("server bind stats: %+v", st)
	}
}

// TestWrongKey runs an agent whose key is not the server's peer: nothing gets through either
// way, and the server records no handshake although the agent's initiations reached it.
func TestWrongKey(t *testing.T) {
	wrong := newKey(t)
	w := newWorld(t, worldOpts{agentKey: &wrong})
	ways := w.echoBothWays(t)

	var wg sync.WaitGroup
	for _, tc := range ways {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			c, err := dial(t, tc.from, tc.to, 7000, 2*time.Second)
			if err == nil {
				c.Close()
				t.Errorf("%s: dial succeeded with the wrong agent key", tc.name)
				return
			}
			if !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err) {
				t.Errorf("%s: got %v, want a timeout", tc.name, err)
			}
			t.Logf("%s: refused after %v with a 2 s deadline", tc.name, time.Since(start))
		}()
	}
	wg.Wait()
	ps, err := w.server.Peers()
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 1 || !ps[0].LastHandshake.IsZero() || ps[0].RxBytes != 0 || ps[0].Endpoint != "" {
		t.Fatalf("server's view of its configured peer: %+v", ps)
	}
	if st := w.server.BindStats(); st.PacketsIn == 0 {
		t.Fatal("no handshake initiation reached the server: the test proves nothing")
	}
	// Its initiations were frames, not authenticated packets: the stream never counts as one.
	if last := w.lastServerEP.LastAuthenticated(); !last.IsZero() {
		t.Fatalf("the wrong key's stream marked authenticated at %v", last)
	}
}

// TestOnlyAuthenticatedTrafficKeepsAStream: the agent's stream is marked authenticated from
// WireGuard's state (its handshake and keepalives), a stranger's stream that sends junk frames
// is not, and PruneStreams ends the stranger's however often it sends, not the agent's.
func TestOnlyAuthenticatedTrafficKeepsAStream(t *testing.T) {
	w := newWorld(t, worldOpts{})
	ps, err := w.server.Peers()
	if err != nil {
		t.Fatal(err)
	}
	if ps[0].LastAuthenticated.IsZero() || w.lastServerEP.LastAuthenticated().IsZero() {
		t.Fatalf("after the handshake: peer %+v, stream last authenticated %v", ps[0], w.lastServerEP.LastAuthenticated())
	}
	junkConn, err := net.Dial("tcp", w.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer junkConn.Close()
	var junk *bind.Endpoint
	select {
	case junk = <-w.serverEP:
	case <-time.After(5 * time.Second):
		t.Fatal("server did not attach the junk stream")
	}
	f, err := frame.AppendFrame(nil, []byte("\x04junk that is no transport packet"), frame.MaxSize)
	if err != nil {
		t.Fatal(err)
	}
	before := w.server.BindStats().PacketsIn
	for range 20 {
		if _, err := junkConn.Write(f); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
		if _, err := w.server.Peers(); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, "the junk to arrive", func() bool { return w.server.BindStats().PacketsIn >= before+20 })
	if !junk.LastAuthenticated().IsZero() || !junk.LastReceive().After(junk.Attached()) {
		t.Fatalf("junk stream: last authenticated %v, last receive %v, attached %v", junk.LastAuthenticated(), junk.LastReceive(), junk.Attached())
	}
	n, err := w.server.PruneStreams(100 * time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("pruned %d streams, want the junk one", n)
	}
	<-junk.Done()
	if reason, _ := junk.Err(); reason != bind.DetachPruned {
		t.Fatalf("junk stream ended with %v", reason)
	}
	if reason, err := w.lastServerEP.Err(); reason != 0 || err != nil {
		t.Fatalf("the agent's stream ended: %v %v", reason, err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestConfigErrors(t *testing.T) {
	k := newKey(t)
	good := Config{PrivateKey: k, LocalAddresses: []netip.Addr{serverAddr}}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"no private key", func(c *Config) { c.PrivateKey = Key{} }},
		{"no addresses", func(c *Config) { c.LocalAddresses = nil }},
		{"MTU too small", func(c *Config) { c.MTU = 1000 }},
		{"MTU too large", func(c *Config) { c.MTU = MaxMTU + 1 }},
		{"peer without key", func(c *Config) { c.Peers = []Peer{{}} }},
		{"peer twice", func(c *Config) { c.Peers = []Peer{{PublicKey: k}, {PublicKey: k}} }},
		{"fractional keepalive", func(c *Config) { c.Peers = []Peer{{PublicKey: k, PersistentKeepalive: 1500 * time.Millisecond}} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			tc.mod(&cfg)
			if tun, err := New(cfg); err == nil {
				tun.Close()
				t.Fatal("New accepted the config")
			}
		})
	}
	tun, err := New(good)
	if err != nil {
		t.Fatalf("minimal config: %v", err)
	}
	tun.Close()
	tun.Close()
}

func TestAttachPeerUnknown(t *testing.T) {
	w := newWorld(t, worldOpts{})
	a, b := net.Pipe()
	defer a.Close()
	if _, err := w.agent.AttachPeer(b, newKey(t).PublicKey()); !errors.Is(err, ErrUnknownPeer) {
		t.Fatalf("got %v, want ErrUnknownPeer", err)
	}
}

func TestListenAddresses(t *testing.T) {
	w := newWorld(t, worldOpts{})
	ln, err := w.agent.Listen("tcp", ":7100")
	if err != nil {
		t.Fatal(err)
	}
	testnet.Serve(t, ln, testnet.Echo)
	c, err := dial(t, w.server, agentAddr, 7100, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := testnet.RoundTrip(c, []byte("any address")); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]string{{"udp", ":53"}, {"tcp", "nonsense"}, {"tcp", "host.example:80"}} {
		if ln, err := w.agent.Listen(bad[0], bad[1]); err == nil {
			ln.Close()
			t.Errorf("Listen(%q, %q) succeeded", bad[0], bad[1])
		}
	}
}

// TestPeersAllocatesLittle: tendril-server reads the device's state 8 times a second while idle
// (the agent watch and the stream pruning, every 250 ms), and an idle server's heap grows only
// by what it allocates. Each reading allocated ~6 KiB (a bufio.Scanner's 4 KiB buffer, a
// string of the whole state, a string per line), ~50 KB/s: most of an idle server's allocation,
// which kept its RSS climbing between GCs.
func TestPeersAllocatesLittle(t *testing.T) {
	w := newWorld(t, worldOpts{})
	for _, tun := range []*Tunnel{w.server, w.agent} {
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		const n = 200
		for range n {
			if _, err := tun.Peers(); err != nil {
				t.Fatal(err)
			}
		}
		runtime.ReadMemStats(&ms1)
		// Other goroutines (keepalives, the bind) allocate meanwhile too, so this is an
		// upper bound on Peers' share.
		perCall := float64(ms1.TotalAlloc-ms0.TotalAlloc) / n
		t.Logf("%.0f bytes and %.1f allocations per Peers call", perCall, float64(ms1.Mallocs-ms0.Mallocs)/n)
		// ~600 bytes now (1.7–1.9 KiB with -race, whose instrumentation keeps fewer values
		// on the stack); the bufio.Scanner alone took 4 KiB.
		if perCall > 3<<10 {
			t.Errorf("Peers allocates %.0f bytes per call, want at most 3 KiB", perCall)
		}
	}
}
