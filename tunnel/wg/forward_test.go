package wg

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/tunnel/netstack"
)

// shootNet is the shoot network the agent forwards into; the server routes all of 10.0.0.0/8 to
// the agent, so that the agent alone decides about 10.200.0.1.
var (
	shootNet  = netip.MustParsePrefix("10.123.0.0/16")
	serverNet = netip.MustParsePrefix("10.0.0.0/8")
)

// shoot is the agent's side of a forwarding world: a Handler that dials a real loopback
// backend as the agent dials pods, and records what it was asked for.
type shoot struct {
	backend string // "127.0.0.1:port" of a real echo server
	closed  string // "127.0.0.1:port" where nothing listens

	mu   sync.Mutex
	seen map[netip.AddrPort]netip.AddrPort // dst → src
}

func newShoot(t testing.TB, handle func(net.Conn)) *shoot {
	t.Helper()
	ln := testnet.Listen(t)
	testnet.Serve(t, ln, handle)
	return &shoot{backend: ln.Addr().String(), closed: testnet.RefusedAddr(t), seen: make(map[netip.AddrPort]netip.AddrPort)}
}

// handle is the Forward.Handler: port 81 of any pod stands for a closed port, everything else
// reaches the backend. It dials first and accepts only then, as the agent does.
func (s *shoot) handle(ctx context.Context, r *netstack.Request) {
	s.mu.Lock()
	s.seen[r.Dst()] = r.Src()
	s.mu.Unlock()
	target := s.backend
	if r.Dst().Port() == 81 {
		target = s.closed
	}
	var d net.Dialer
	up, err := d.DialContext(ctx, "tcp", target)
	if err != nil {
		r.Refuse()
		return
	}
	defer up.Close()
	c, err := r.Accept()
	if err != nil {
		return
	}
	pipe.Pipe(c, up, 0)
}

func (s *shoot) src(dst netip.AddrPort) (netip.AddrPort, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	src, ok := s.seen[dst]
	return src, ok
}

func newForwardWorld(t testing.TB, o worldOpts, handle func(net.Conn)) (*world, *shoot) {
	t.Helper()
	sh := newShoot(t, handle)
	o.forward = &netstack.Forward{Prefixes: []netip.Prefix{shootNet}, Handler: sh.handle}
	o.routed = []netip.Prefix{serverNet}
	return newWorld(t, o), sh
}

func dialAddr(t testing.TB, tun *Tunnel, ap netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	return tun.DialContext(ctx, "tcp", ap.String())
}

// TestForward runs a server and an agent that forwards 10.123.0.0/16 over one real TCP stream;
// the agent's handler relays to a real loopback echo server.
func TestForward(t *testing.T) {
	w, sh := newForwardWorld(t, worldOpts{}, testnet.Echo)

	t.Run("8 MB echo", func(t *testing.T) {
		dst := netip.MustParseAddrPort("10.123.0.5:80")
		c, err := dialAddr(t, w.server, dst, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := testnet.RoundTrip(c, randomBytes(t, 8<<20)); err != nil {
			t.Fatal(err)
		}
		src, ok := sh.src(dst)
		if !ok || src.Addr() != serverAddr4 {
			t.Fatalf("handler saw %v from %v, want %v from %v", dst, src, dst, serverAddr4)
		}
		if got := c.LocalAddr().(*net.TCPAddr).AddrPort().Addr(); got != serverAddr4 {
			t.Fatalf("server dialed from %v, want %v", got, serverAddr4)
		}
	})

	t.Run("100 concurrent", func(t *testing.T) {
		concurrently(t, 100, func(i int) error {
			dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 123, byte(1 + i/50), byte(1 + i%50)}), 8080)
			c, err := dialAddr(t, w.server, dst, 20*time.Second)
			if err != nil {
				return fmt.Errorf("conn %d to %v: %w", i, dst, err)
			}
			defer c.Close()
			if err := testnet.RoundTrip(c, []byte(fmt.Sprintf("hello %d", i))); err != nil {
				return fmt.Errorf("conn %d to %v: %w", i, dst, err)
			}
			if _, ok := sh.src(dst); !ok {
				return fmt.Errorf("conn %d: the handler never saw %v", i, dst)
			}
			return nil
		})
	})

	refused := func(t *testing.T, dst netip.AddrPort, reason netstack.RefuseReason) {
		t.Helper()
		before := w.agent.StackStats().Refused[reason]
		start := time.Now()
		c, err := dialAddr(t, w.server, dst, 10*time.Second)
		if err == nil {
			c.Close()
			t.Fatalf("dial %v succeeded", dst)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial %v: %v, want connection refused", dst, err)
		}
		t.Logf("dial %v refused after %v", dst, time.Since(start))
		testwait.Until(t, fmt.Sprintf("Refused[%v] counted", reason), func() bool { return w.agent.StackStats().Refused[reason] >= before+1 })
	}
	t.Run("outside the prefixes", func(t *testing.T) {
		refused(t, netip.MustParseAddrPort("10.200.0.1:80"), netstack.RefusedOutside)
		if _, ok := sh.src(netip.MustParseAddrPort("10.200.0.1:80")); ok {
			t.Fatal("the handler was asked for a destination outside the prefixes")
		}
	})
	t.Run("refused by the real destination", func(t *testing.T) {
		refused(t, netip.MustParseAddrPort("10.123.0.7:81"), netstack.RefusedByHandler)
	})

	t.Run("own address", func(t *testing.T) {
		testnet.Serve(t, listen(t, w.agent, agentAddr, 7000), testnet.Echo)
		// A listener on the unspecified address binds the agent's one address only: the same
		// port on a pod address is still forwarded.
		any, err := w.agent.Listen("tcp", ":8080")
		if err != nil {
			t.Fatal(err)
		}
		testnet.Serve(t, any, func(c net.Conn) { _, _ = c.Write([]byte("agent")) })
		for _, port := range []uint16{7000, 8080} {
			c, err := dialAddr(t, w.server, netip.AddrPortFrom(agentAddr, port), 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if port == 7000 {
				err = testnet.RoundTrip(c, []byte("own address"))
			} else {
				var buf [5]byte
				_, err = c.Read(buf[:])
				if err == nil && string(buf[:]) != "agent" {
					err = fmt.Errorf("read %q from the agent's listener", buf[:])
				}
			}
			c.Close()
			if err != nil {
				t.Fatalf("port %d: %v", port, err)
			}
		}
		dst := netip.MustParseAddrPort("10.123.0.9:8080")
		c, err := dialAddr(t, w.server, dst, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := testnet.RoundTrip(c, []byte("still the pod")); err != nil {
			t.Fatal(err)
		}
		refused(t, netip.AddrPortFrom(agentAddr, 7999), netstack.RefusedLocalPort)
	})

	st := w.agent.StackStats()
	t.Logf("agent stack stats: %+v", st)
	if st.Forwarded < 102 || st.ForwardInFlight != 0 {
		t.Fatalf("agent stack stats: %+v", st)
	}
}

// TestForwardClose closes the agent while forwarded connections are open and their handlers
// are relaying: Close returns promptly, after every handler has returned, although each
// handler queries the agent's Tunnel on its way out (which would wait forever for the device's
// lock if the device closed before the handlers were done).
func TestForwardClose(t *testing.T) {
	sh := newShoot(t, testnet.Echo)
	var agent atomic.Pointer[Tunnel]
	w := newWorld(t, worldOpts{
		routed: []netip.Prefix{serverNet},
		forward: &netstack.Forward{Prefixes: []netip.Prefix{shootNet}, Handler: func(ctx context.Context, r *netstack.Request) {
			sh.handle(ctx, r)
			if _, err := agent.Load().Peers(); err != nil {
				t.Errorf("Peers from a handler: %v", err)
			}
		}},
	})
	agent.Store(w.agent)
	for i := range 5 {
		c, err := dialAddr(t, w.server, netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 123, 0, byte(i + 1)}), 80), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, "five active handlers", func() bool { return w.agent.StackStats().ForwardActive == 5 })
	done := make(chan struct{})
	go func() { w.agent.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("agent Close did not return with forwarded connections open")
	}
	if st := w.agent.StackStats(); st.ForwardActive != 0 {
		t.Fatalf("after Close: %+v", st)
	}
}
