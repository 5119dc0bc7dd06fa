package accept

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

func TestSourceKey(t *testing.T) {
	for in, want := range map[string]string{
		"10.1.2.3":             "10.1.2.3",
		"::ffff:10.1.2.3":      "10.1.2.3", // an IPv4 client of a dual-stack socket
		"2001:db8:1:2:3:4:5:6": "2001:db8:1:2::",
		"2001:db8:1:2::ff":     "2001:db8:1:2::", // the same host's /64
	} {
		if got := SourceKey(netip.MustParseAddr(in)); got != netip.MustParseAddr(want) {
			t.Errorf("SourceKey(%s) = %s, want %s", in, got, want)
		}
	}
}

// TestMaxPerSource: a source at its bound has its next connection refused (RefusedSource) and
// closed at once while another source is served; a connection of the source that ends gives its
// place back, and a source with nothing open is forgotten.
func TestMaxPerSource(t *testing.T) {
	l := testnet.Listen(t)
	var mu sync.Mutex
	var reasons []string
	s := &Server{
		Handle:       func(ctx context.Context, c net.Conn, _ *Conns) { _, _ = io.Copy(io.Discard, c) }, // until closed
		MaxPerSource: 2,
		Refused: func(_ net.Conn, reason string) {
			mu.Lock()
			reasons = append(reasons, reason)
			mu.Unlock()
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	dialFrom := func(src string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	waitOpen := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); s.Open() != n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d connections served, want %d", s.Open(), n)
			}
		}
	}
	closed := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := c.Read(make([]byte, 1))
		return err == io.EOF
	}
	first := dialFrom("127.0.0.1")
	dialFrom("127.0.0.1")
	waitOpen(2)
	if extra := dialFrom("127.0.0.1"); !closed(extra) {
		t.Error("a third connection of 127.0.0.1 was not closed")
	}
	dialFrom("127.0.0.2") // another source
	waitOpen(3)
	if s.Sources() != 2 {
		t.Errorf("%d sources counted, want 2", s.Sources())
	}
	first.Close()
	waitOpen(2)
	dialFrom("127.0.0.1") // its place back
	waitOpen(3)
	mu.Lock()
	if len(reasons) != 1 || reasons[0] != RefusedSource {
		t.Errorf("refusals %q, want one %q", reasons, RefusedSource)
	}
	mu.Unlock()
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if s.Sources() != 0 {
		t.Errorf("%d sources counted after Serve, want 0", s.Sources())
	}
}

// TestAbort: the connections open at shutdown are closed with Abort (here a reset), those that
// Handle ended itself are not.
func TestAbort(t *testing.T) {
	l := testnet.Listen(t)
	s := &Server{
		Handle: func(ctx context.Context, c net.Conn, _ *Conns) {
			b := make([]byte, 1)
			if _, err := c.Read(b); err != nil || b[0] == 'q' {
				return // an orderly close
			}
			_, _ = io.Copy(io.Discard, c) // until closed
		},
		Abort: func(c net.Conn) {
			_ = c.(*net.TCPConn).SetLinger(0)
			c.Close()
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	dial := func(first string) net.Conn { return dialWriting(t, l.Addr().String(), first) }
	quit := dial("q")
	_ = quit.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := quit.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("connection its handler ended: %v, want an orderly close", err)
	}
	held := dial("x")
	for deadline := time.Now().Add(5 * time.Second); s.Open() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections served, want 1", s.Open())
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	_ = held.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := held.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("connection open at shutdown: %v, want reset", err)
	}
}
