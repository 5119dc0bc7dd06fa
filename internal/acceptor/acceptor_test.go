package acceptor

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestMaxAndDrain: a connection beyond Max is refused and closed at once; on shutdown a
// connection still being served is closed after the drain timeout.
func TestMaxAndDrain(t *testing.T) {
	l := listen(t)
	var refused atomic.Int32
	s := &Server{
		Handle: func(ctx context.Context, c net.Conn, _ *Conns) { _, _ = io.Copy(io.Discard, c) }, // until closed
		Max:    1, Refused: func(net.Conn) { refused.Add(1) }, DrainTimeout: 50 * time.Millisecond,
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
	if err := s.Serve(context.Background(), failing{listen(t)}); !errors.Is(err, errBroken) {
		t.Errorf("Serve: %v", err)
	}
}
