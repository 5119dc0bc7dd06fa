package wg

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestDialsAtHighRatePodClosesFirst makes thousands of short connections through the tunnel, 32
// at a time, to one pod that answers and closes first, as tendril-bench tunnel's dial test
// does. Each dial and its round trip must finish within a deadline far above a normal dial
// (milliseconds) and below one SYN retransmission (1 s). The pod closing first leaves the
// agent's end of each connection in TIME-WAIT; with the server's stack picking source ports at
// random, a dial that drew a port still in TIME-WAIT had its SYN dropped and waited 1 s (9 of
// 5,000 here; netstack's bindNextPort).
func TestDialsAtHighRatePodClosesFirst(t *testing.T) {
	if testing.Short() {
		t.Skip("5,000 dials")
	}
	w, _ := newForwardWorld(t, worldOpts{mtu: 60000}, func(c net.Conn) {
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err == nil {
			_, _ = c.Write([]byte("ok\n"))
		}
		c.Close()
	})
	const (
		workers = 32
		dials   = 5000
		// deadline is a correctness bound, not a performance target: a dial here takes a few
		// milliseconds, a lost SYN costs 1 s.
		deadline = 500 * time.Millisecond
	)
	dst := netip.MustParseAddrPort("10.123.0.1:80")
	var (
		next  atomic.Int64
		mu    sync.Mutex
		worst time.Duration
		slow  []string
		wg    sync.WaitGroup
	)
	start := time.Now()
	for range workers {
		wg.Go(func() {
			for i := next.Add(1); i <= dials && !t.Failed(); i = next.Add(1) {
				t0 := time.Now()
				err := pingPod(t, w.server, dst)
				el := time.Since(t0)
				if err != nil {
					t.Errorf("dial %d after %v: %v", i, el, err)
					return
				}
				mu.Lock()
				worst = max(worst, el)
				if el > deadline {
					slow = append(slow, fmt.Sprintf("dial %d: %v at %v", i, el.Round(time.Millisecond), t0.Sub(start).Round(time.Millisecond)))
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	el := time.Since(start)
	t.Logf("%d dials in %v (%.0f/s), worst %v; agent %+v", dials, el.Round(time.Millisecond), dials/el.Seconds(), worst, w.agent.StackStats())
	if len(slow) > 0 {
		t.Errorf("%d dials took over %v: %v", len(slow), deadline, slow)
	}
}

// pingPod dials dst through tun, sends one byte and reads the pod's three-byte answer.
func pingPod(t *testing.T, tun *Tunnel, dst netip.AddrPort) error {
	c, err := dialAddr(t, tun, dst, 10*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("P")); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	var b [3]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	return nil
}
