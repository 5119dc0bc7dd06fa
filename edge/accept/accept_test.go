package accept

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestMaxAndDrain: a connection beyond Max is refused and closed at once; on shutdown a
// connection still being served is closed after the drain timeout.
func TestMaxAndDrain(t *testing.T) {
	l := testnet.Listen(t)
	var refused atomic.Int32
	s := &Server{
		Handle: func(ctx context.Context, c net.Conn, _ *Conns) { _, _ = io.Copy(io.Discard, c) }, // until closed
		Max:    1, Refused: func(_ net.Conn, reason string) {
			if reason == RefusedMax {
				refused.Add(1)
			}
		}, DrainTimeout: 50 * time.Millisecond,
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	held, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	for deadline := time.Now().Add(5 * time.Second); s.Active() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("first connection not served")
		}
	}
	extra, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := extra.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("connection beyond Max: %v, want closed", err)
	}
	if refused.Load() != 1 {
		t.Errorf("refused %d", refused.Load())
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve after shutdown: %v", err)
	}
	_ = held.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := held.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("held connection after the drain timeout: %v, want closed", err)
	}
	if s.Active() != 0 {
		t.Errorf("%d slots held after Serve", s.Active())
	}
}

type failing struct{ net.Listener }

var errBroken = errors.New("broken")

func (failing) Accept() (net.Conn, error) { return nil, errBroken }

// TestAcceptError: Accept failing by itself ends Serve with its error.
func TestAcceptError(t *testing.T) {
	s := &Server{Handle: func(context.Context, net.Conn, *Conns) {}}
	if err := s.Serve(context.Background(), failing{testnet.Listen(t)}); !errors.Is(err, errBroken) {
		t.Errorf("Serve: %v", err)
	}
}

// TestStopAcceptingAndCloseAll: once the listener is closed by its owner the connections being
// served go on (Serve has not returned); CloseAll closes them, counts them, and from then on
// Add refuses and closes. A connection handed over with Forget is left open.
func TestStopAcceptingAndCloseAll(t *testing.T) {
	l := testnet.Listen(t)
	handedOver := make(chan net.Conn, 1)
	refusedUp := make(chan bool, 1)
	s := &Server{Handle: func(ctx context.Context, c net.Conn, conns *Conns) {
		b := make([]byte, 1)
		if _, err := c.Read(b); err != nil {
			return
		}
		if b[0] == 'h' { // hand over
			conns.Forget(c)
			handedOver <- c
			return
		}
		_, _ = io.Copy(io.Discard, c) // until closed
		up, peer := net.Pipe()
		defer peer.Close()
		refusedUp <- !conns.Add(up)
	}}
	done := make(chan error, 1)
	go func() { done <- s.Serve(context.Background(), l) }()
	dial := func(first string) net.Conn { return dialWriting(t, l.Addr().String(), first) }
	held := dial("x")
	dial("h")
	over := <-handedOver
	defer over.Close()
	for deadline := time.Now().Add(5 * time.Second); s.Open() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections tracked, want 1 (the handed-over one is not)", s.Open())
		}
	}
	s.StopAccepting()
	if _, err := net.Dial("tcp", l.Addr().String()); err == nil {
		t.Error("dial after StopAccepting succeeded")
	}
	select {
	case err := <-done:
		t.Fatalf("Serve returned while a connection was being served: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if n := s.CloseAll(); n != 1 {
		t.Errorf("CloseAll closed %d, want 1", n)
	}
	if !<-refusedUp {
		t.Error("Add after CloseAll tracked the connection")
	}
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	_ = held.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := held.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("served connection after CloseAll: %v, want closed", err)
	}
	if _, err := over.Write([]byte("x")); err != nil {
		t.Errorf("handed-over connection closed: %v", err)
	}
}

// dialWriting dials addr and writes first; the connection is closed when the test ends.
func dialWriting(t *testing.T, addr, first string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte(first)); err != nil {
		t.Fatal(err)
	}
	return c
}

type flaky struct {
	net.Listener
	fails atomic.Int32
}

func (f *flaky) Accept() (net.Conn, error) {
	if f.fails.Add(-1) >= 0 {
		return nil, errBroken
	}
	return f.Listener.Accept()
}

// TestRetryAccept: with RetryAccept, Accept errors are passed over and the connections after
// them served.
func TestRetryAccept(t *testing.T) {
	l := &flaky{Listener: testnet.Listen(t)}
	l.fails.Store(3)
	served := make(chan struct{}, 1)
	s := &Server{Handle: func(context.Context, net.Conn, *Conns) { served <- struct{}{} }, RetryAccept: true}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("connection after three failed Accepts not served")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

// TestLimit: a connection beyond Max is refused and closed at once; closing an accepted one
// frees its place.
func TestLimit(t *testing.T) {
	var refused atomic.Int32
	m := &Limit{Max: 1, Refused: func(net.Conn) { refused.Add(1) }}
	l := m.Listener(testnet.Listen(t))
	defer l.Close()
	accepted := make(chan net.Conn)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial()
	first := <-accepted
	extra := dial()
	_ = extra.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := extra.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("connection beyond Max: %v, want closed", err)
	}
	if refused.Load() != 1 || m.Open() != 1 {
		t.Errorf("refused %d, open %d; want 1, 1", refused.Load(), m.Open())
	}
	first.Close()
	first.Close() // counted once
	if m.Open() != 0 {
		t.Errorf("open %d after Close, want 0", m.Open())
	}
	dial()
	(<-accepted).Close()
}
