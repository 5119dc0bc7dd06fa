package ingress

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// holdingUpstream is a TLS server whose connections hold a transfer until the test releases it:
// the client sends "hold KEY", the server answers "held", waits until KEY is released and then
// sends holdBytes bytes of pattern() and closes, like a watch that delivers its events late.
type holdingUpstream struct {
	addr    netip.AddrPort
	mu      sync.Mutex
	release map[string]chan struct{}
	done    chan struct{}
}

const holdBytes = 1 << 20 // 1 MiB: more than the socket buffers, so it is really relayed

func startHoldingUpstream(t *testing.T, w *world, host string) *holdingUpstream {
	t.Helper()
	cert, err := w.ca.Leaf(host)
	if err != nil {
		t.Fatal(err)
	}
	l := testnet.Listen(t)
	u := &holdingUpstream{addr: netip.MustParseAddrPort(l.Addr().String()), release: map[string]chan struct{}{}, done: make(chan struct{})}
	tl := tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}})
	testnet.Serve(t, tl, func(c net.Conn) {
		line, err := bufio.NewReader(c).ReadString('\n')
		f := strings.Fields(line)
		if err != nil || len(f) != 2 || f[0] != "hold" {
			return
		}
		if _, err := io.WriteString(c, "held\n"); err != nil {
			return
		}
		select {
		case <-u.ch(f[1]):
		case <-u.done:
			return
		}
		_, _ = io.Copy(c, io.LimitReader(pattern(), holdBytes))
	})
	// Cleanups run last-registered first: held handlers are let go before Serve's cleanup
	// closes the listener and waits for them.
	t.Cleanup(func() { close(u.done) })
	w.route(model.Shoot{Name: "shoot--t--hold", Hosts: []string{host}, APIServer: u.addr})
	return u
}

func (u *holdingUpstream) ch(key string) chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	c := u.release[key]
	if c == nil {
		c = make(chan struct{})
		u.release[key] = c
	}
	return c
}

func (u *holdingUpstream) releaseKey(key string) { close(u.ch(key)) }

// finishTransfer releases the connection held as "transfer", checks that the transfer arrives in
// full through the draining ingress and closes the client's end.
func (u *holdingUpstream) finishTransfer(t *testing.T, tc *tls.Conn, transfer io.Reader) {
	t.Helper()
	u.releaseKey("transfer")
	if err := readHeld(transfer); err != nil {
		t.Fatalf("transfer through the draining ingress: %v", err)
	}
	tc.Close() // the client is done: the relay's other direction ends
}

// hold opens a connection through the ingress's SNI listener whose upstream holds it until key is
// released; it returns once the upstream has answered, so the connection is established.
func (w *world) hold(t *testing.T, host, key string) (*tls.Conn, *bufio.Reader) {
	t.Helper()
	c, err := w.dial(host, host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "hold %s\n", key)
	r := bufio.NewReader(c)
	if line, err := r.ReadString('\n'); err != nil || line != "held\n" {
		t.Fatalf("hold %s: %q, %v", key, line, err)
	}
	return c, r
}

// readHeld reads the rest of a held connection and checks it is exactly the transfer.
func readHeld(r io.Reader) error {
	got, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("after %d bytes: %w", len(got), err)
	}
	want, _ := io.ReadAll(io.LimitReader(pattern(), holdBytes))
	if !bytes.Equal(got, want) {
		return fmt.Errorf("got %d bytes, want the %d of the transfer", len(got), len(want))
	}
	return nil
}

// refused waits until a new connection to addr is refused by the kernel (the listener is closed).
func refused(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if errors.Is(err, syscall.ECONNREFUSED) {
			return
		}
		if err == nil {
			c.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("new connections to %s are still accepted (%v)", addr, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (w *world) drainClosed(listener string) float64 {
	return promtest.ToFloat64(w.in.metrics.drainClosed.WithLabelValues(listener))
}

// TestDrainFinishesTransfersAndClosesTheRest: once Serve's context ends, readiness fails and the
// listeners close at once (no DrainDelay), a transfer under way finishes in full through the
// draining ingress, and the connection still open at DrainTimeout is closed and counted.
func TestDrainFinishesTransfersAndClosesTheRest(t *testing.T) {
	t.Parallel()
	// The timeout is the deadline for the steps between stop and the end of the transfer.
	const drainTimeout = 3 * time.Second
	w := newWorldConfig(t, translate.Options{}, Config{DrainTimeout: drainTimeout})
	u := startHoldingUpstream(t, w, "api.hold.test")
	tc, transfer := w.hold(t, "api.hold.test", "transfer")
	watch, watchR := w.hold(t, "api.hold.test", "watch") // never released: a watch without events

	start := time.Now()
	w.stop()
	testwait.Until(t, "draining", w.in.Draining)
	if w.in.Ready() {
		t.Error("ready while draining")
	}
	refused(t, w.sni)
	refused(t, w.proxy)
	u.finishTransfer(t, tc, transfer)
	select {
	case <-w.served:
		t.Fatal("Serve returned while a connection was open and the drain timeout had not passed")
	default:
	}
	select {
	case <-w.served:
	case <-time.After(drainTimeout + 10*time.Second):
		t.Fatal("Serve did not return after the drain timeout")
	}
	if took := time.Since(start); took < drainTimeout {
		t.Errorf("Serve returned %v after stop, before the drain timeout %v with a connection open", took, drainTimeout)
	}
	_ = watch.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, err := io.ReadAll(watchR); err != nil && pipe.IsTimeout(err) {
		t.Errorf("the watch connection is still open after the drain (read %q)", b)
	}
	if got := w.drainClosed("sni"); got != 1 {
		t.Errorf("connections closed by the drain on sni: %v, want 1", got)
	}
	if got := w.drainClosed("proxy"); got != 0 {
		t.Errorf("connections closed by the drain on proxy: %v, want 0", got)
	}
}

// TestDrainEndsWithTheLastConnection: with a long DrainTimeout, Serve returns as soon as the last
// connection has ended by itself, and closes none.
func TestDrainEndsWithTheLastConnection(t *testing.T) {
	t.Parallel()
	w := newWorldConfig(t, translate.Options{}, Config{DrainTimeout: time.Hour})
	u := startHoldingUpstream(t, w, "api.hold.test")
	tc, transfer := w.hold(t, "api.hold.test", "transfer")
	w.stop()
	refused(t, w.sni)
	u.finishTransfer(t, tc, transfer)
	select {
	case <-w.served:
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return once the last connection had ended")
	}
	if got := w.drainClosed("sni"); got != 0 {
		t.Errorf("connections closed by the drain on sni: %v, want 0", got)
	}
}

// TestDrainZeroClosesAtOnce: the zero Config closes every connection when Serve's context ends,
// and counts them.
func TestDrainZeroClosesAtOnce(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	startHoldingUpstream(t, w, "api.hold.test")
	c, r := w.hold(t, "api.hold.test", "never")
	w.stop()
	select {
	case <-w.served:
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return at once")
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, err := io.ReadAll(r); err != nil && pipe.IsTimeout(err) {
		t.Errorf("the connection is still open after Serve returned (read %q)", b)
	}
	if got := w.drainClosed("sni"); got != 1 {
		t.Errorf("connections closed by the drain on sni: %v, want 1", got)
	}
}

// TestDrainDelayKeepsAccepting: during DrainDelay readiness already fails but new connections are
// still proxied (the load balancer has not noticed yet); after it the listeners close.
func TestDrainDelayKeepsAccepting(t *testing.T) {
	t.Parallel()
	// The delay is the deadline for one connection through the ingress after stop.
	const delay = 3 * time.Second
	w := newWorldConfig(t, translate.Options{}, Config{DrainDelay: delay, DrainTimeout: time.Hour})
	u := startHoldingUpstream(t, w, "api.hold.test")
	w.stop()
	testwait.Until(t, "draining", w.in.Draining)
	if w.in.Ready() {
		t.Error("ready while draining")
	}
	lc, late := w.hold(t, "api.hold.test", "late") // accepted during the delay
	refused(t, w.sni)
	u.releaseKey("late")
	if err := readHeld(late); err != nil {
		t.Fatalf("a connection accepted during the drain delay: %v", err)
	}
	lc.Close()
	select {
	case <-w.served:
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return once the last connection had ended")
	}
}
