package reserve

import (
	"errors"
	"net"
	"syscall"
	"testing"
)

// TestReserve: a reserved port refuses connections, is handed to no bind of port 0, and the
// server it is for (a Go listener) binds and serves it while it is held; nobody else binds it
// then. Released, it is free.
func TestReserve(t *testing.T) {
	p, err := TCP("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := net.Dial("tcp", p.Addr); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dial before the server listens: %v, want connection refused", err)
	}
	// 2,000 binds of port 0 (the ephemeral range has about 28,000 ports) while it is held.
	for range 2000 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		got := l.Addr().String()
		l.Close()
		if got == p.Addr {
			t.Fatalf("a bind of port 0 got the reserved %s", got)
		}
	}
	srv, err := net.Listen("tcp", p.Addr)
	if err != nil {
		t.Fatalf("the server cannot listen on its reserved %s: %v", p.Addr, err)
	}
	c, err := net.Dial("tcp", p.Addr)
	if err != nil {
		t.Fatalf("dial the server: %v", err)
	}
	c.Close()
	if l, err := net.Listen("tcp", p.Addr); err == nil {
		l.Close()
		t.Errorf("a second listener got %s", p.Addr)
	}
	srv.Close()
	p.Close()
	p.Close() // twice is fine
	l, err := net.Listen("tcp", p.Addr)
	if err != nil {
		t.Fatalf("released, %s cannot be bound: %v", p.Addr, err)
	}
	l.Close()
	if _, err := TCP("not an address"); err == nil {
		t.Error("a host that is not an address was accepted")
	}
}
