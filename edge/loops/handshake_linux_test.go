package loops

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// lineShaker is a Handshaker for tests: the client's first line names the upstream
// ("127.0.0.1:PORT\n"); the rest of what it sent goes upstream first. Every call is recorded.
type lineShaker struct {
	mu      sync.Mutex
	events  []string
	ends    []error
	dials   []netip.AddrPort // tried in order; the first line's address is appended last
	handOff bool
	first   []byte
	conns   chan net.Conn
	done    chan [2]int64
}

func (s *lineShaker) record(e string) {
	s.mu.Lock()
	s.events = append(s.events, e)
	s.mu.Unlock()
}

func (s *lineShaker) seen() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.events...)
}

func (s *lineShaker) Read(data []byte, end error) Verdict {
	s.mu.Lock()
	s.ends = append(s.ends, end)
	s.mu.Unlock()
	i := bytes.IndexByte(data, '\n')
	if i < 0 {
		if end != nil {
			s.record("refused")
			return Verdict{Step: StepClose}
		}
		return Verdict{Step: StepMore}
	}
	if s.handOff {
		return Verdict{Step: StepHandOff}
	}
	addr, err := netip.ParseAddrPort(string(data[:i]))
	if err != nil {
		s.record("bad")
		return Verdict{Step: StepClose}
	}
	s.dials = append(s.dials, addr)
	s.first = data[i+1:]
	return s.next()
}

func (s *lineShaker) next() Verdict {
	v := Verdict{Step: StepDial, Addr: s.dials[0], Timeout: time.Second, First: s.first}
	v.Done = func(x, y int64) { s.done <- [2]int64{x, y} }
	s.dials = s.dials[1:]
	return v
}

func (s *lineShaker) DialFailed(err error) Verdict {
	s.record("dial failed")
	if len(s.dials) == 0 {
		return Verdict{Step: StepClose}
	}
	return s.next()
}

func (s *lineShaker) Joined() { s.record("joined") }
func (s *lineShaker) Closed() { s.record("closed") }
func (s *lineShaker) HandOff(c net.Conn, err error) {
	s.record("handed off")
	if err == nil {
		s.conns <- c
	}
}

// serving runs ls.Serve on a listener with shaker as every connection's Handshaker.
func serving(t *testing.T, ls *Loops, g *Group, shaker Handshaker, timeout time.Duration, maxBytes int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rl, err := Listen(ln, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		errc <- ls.Serve(g, rl, func(hs *Handshake) (Handshaker, time.Duration, int) {
			if hs.Local.Port() == 0 || !hs.Peer.Addr().IsLoopback() {
				t.Errorf("handshake addresses %v → %v", hs.Peer, hs.Local)
			}
			// The listener's options, inherited.
			nodelay, err1 := unix.GetsockoptInt(hs.fd, unix.IPPROTO_TCP, unix.TCP_NODELAY)
			idle, err2 := unix.GetsockoptInt(hs.fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
			if nodelay != 1 || idle != 60 || err1 != nil || err2 != nil {
				t.Errorf("accepted socket: TCP_NODELAY %d (%v), TCP_KEEPIDLE %d (%v); want 1 and 60", nodelay, err1, idle, err2)
			}
			return shaker, timeout, maxBytes
		})
	}()
	t.Cleanup(func() {
		rl.Close()
		if err := <-errc; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln.Addr().String()
}

func echoServer(t *testing.T) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

func TestServeDialsWhatTheHandshakeNamesAndRetries(t *testing.T) {
	ls := newLoops(t)
	var g Group
	up := echoServer(t)
	// A port bound and not listening: a connect to it is refused, and no other test (go test
	// runs packages at once) can take the port meanwhile. The first dial fails there, the retry
	// goes to the echo server.
	bound, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(bound)
	if err := unix.Bind(bound, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(bound)
	if err != nil {
		t.Fatal(err)
	}
	dead := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), uint16(sa.(*unix.SockaddrInet4).Port))
	s := &lineShaker{done: make(chan [2]int64, 2), dials: []netip.AddrPort{dead}}
	addr := serving(t, ls, &g, s, 5*time.Second, 1024)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The line in two parts: the first read finds no line and waits for more.
	if _, err := c.Write([]byte("127.0.0.1:")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if _, err := c.Write([]byte(up.String()[len("127.0.0.1:"):] + "\nfirst|")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("second")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len("first|second"))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "first|second" {
		t.Fatalf("echo %q, %v (events %q)", got, err, s.seen())
	}
	if got := s.seen(); len(got) != 2 || got[0] != "dial failed" || got[1] != "joined" {
		t.Fatalf("events %q, want dial failed, joined", got)
	}
	if g.Handshakes() != 0 || g.Len() != 1 {
		t.Fatalf("handshakes %d pairs %d, want 0 and 1", g.Handshakes(), g.Len())
	}
	c.(*net.TCPConn).CloseWrite()
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after half-close: %v, want EOF", err)
	}
	n := waitDone(t, s.done)
	if n[0] != int64(len("first|second")) || n[1] != n[0] {
		t.Fatalf("bytes moved %v", n)
	}
}

func TestServeRefusesAtTheDeadlineAndTheLimit(t *testing.T) {
	ls := newLoops(t)
	var g Group
	s := &lineShaker{}
	addr := serving(t, ls, &g, s, 200*time.Millisecond, 16)
	silent, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	long, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()
	if _, err := long.Write(bytes.Repeat([]byte("x"), 100)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []net.Conn{silent, long} {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read: %v, want the connection closed", err)
		}
	}
	s.mu.Lock()
	var deadline, tooLong bool
	for _, e := range s.ends {
		deadline = deadline || errors.Is(e, os.ErrDeadlineExceeded)
		tooLong = tooLong || errors.Is(e, ErrTooLong)
	}
	s.mu.Unlock()
	if !deadline || !tooLong {
		t.Fatalf("ends %v: want the deadline and ErrTooLong", s.ends)
	}
	if g.Handshakes() != 0 {
		t.Fatalf("%d handshakes left", g.Handshakes())
	}
}

func TestServeHandsOffAndClosesGroups(t *testing.T) {
	ls := newLoops(t)
	var g Group
	s := &lineShaker{handOff: true, conns: make(chan net.Conn, 1)}
	addr := serving(t, ls, &g, s, 5*time.Second, 1024)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("CONNECT\n")); err != nil {
		t.Fatal(err)
	}
	h := <-s.conns
	if _, err := h.Write([]byte("handed")); err != nil {
		t.Fatal(err)
	}
	h.Close()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "handed" {
		t.Fatalf("read %q, %v", got, err)
	}

	// One connection waits in its handshake; CloseGroup closes it and tells the Handshaker.
	waiting, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer waiting.Close()
	deadline := time.Now().Add(5 * time.Second)
	for g.Handshakes() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d handshakes, want 1", g.Handshakes())
		}
		time.Sleep(time.Millisecond)
	}
	if n := ls.CloseGroup(&g); n != 1 {
		t.Fatalf("CloseGroup closed %d, want 1", n)
	}
	if _, err := waiting.Read(make([]byte, 1)); err == nil {
		t.Fatal("the handshake's connection is open after CloseGroup")
	}
	if got := s.seen(); got[len(got)-1] != "closed" {
		t.Fatalf("events %q, want closed last", got)
	}
}

// TestRawAcceptAddresses: the raw accept reads the peer's address and port (network byte order)
// right, for IPv4 and IPv6, and getsockname the connection's own.
func TestRawAcceptAddresses(t *testing.T) {
	for _, network := range []string{"127.0.0.1:0", "[::1]:0"} {
		ln, err := net.Listen("tcp", network)
		if err != nil {
			t.Skipf("%s: %v", network, err)
		}
		rl, err := Listen(ln, 0)
		if err != nil {
			t.Fatal(err)
		}
		c, err := net.Dial("tcp", rl.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		rc, err := rl.f.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var fd int
		var peer netip.AddrPort
		if err := rc.Read(func(lfd uintptr) bool {
			fd, peer, err = rawAccept(int(lfd))
			return err != syscall.EAGAIN
		}); err != nil {
			t.Fatal(err)
		}
		if err != nil {
			t.Fatal(err)
		}
		want := c.LocalAddr().(*net.TCPAddr).AddrPort()
		if peer != netip.AddrPortFrom(want.Addr().Unmap(), want.Port()) || rawLocal(fd) != rl.Addr() {
			t.Errorf("%s: peer %v local %v, want %v and %v", network, peer, rawLocal(fd), want, rl.Addr())
		}
		rawClose(fd)
		c.Close()
		rl.Close()
	}
}

// TestServeClosedBeforePlaced: a handshake closed between its accept and its placing on a loop
// (another listener's accept evicting it) is closed when it gets there, and its Handshaker told.
func TestServeClosedBeforePlaced(t *testing.T) {
	ls := newLoops(t)
	var g Group
	s := &lineShaker{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rl, err := Listen(ln, 0)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		errc <- ls.Serve(&g, rl, func(hs *Handshake) (Handshaker, time.Duration, int) {
			hs.Close()
			return s, time.Minute, 1024
		})
	}()
	defer func() {
		rl.Close()
		if err := <-errc; err != nil {
			t.Error(err)
		}
	}()
	c, err := net.Dial("tcp", rl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read: %v, want the connection closed", err)
	}
	if got := s.seen(); len(got) != 1 || got[0] != "closed" || g.Handshakes() != 0 {
		t.Fatalf("events %q, %d handshakes; want closed and 0", got, g.Handshakes())
	}
}

// TestConnectBothFamilies: the loops' raw connect reaches IPv4 and IPv6 listeners (the port in
// network byte order, the family's own address layout) and reports a refusal as ECONNREFUSED.
func TestConnectBothFamilies(t *testing.T) {
	ls := newLoops(t)
	for _, network := range []string{"127.0.0.1:0", "[::1]:0"} {
		l, err := net.Listen("tcp", network)
		if err != nil {
			t.Fatal(err)
		}
		addr := netip.MustParseAddrPort(l.Addr().String())
		accepted := make(chan net.Conn, 1)
		go func() {
			c, _ := l.Accept()
			accepted <- c
		}()
		up, err := ls.Dial(context.Background(), addr)
		if err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
		c := <-accepted
		if c == nil {
			t.Fatalf("%s: nothing accepted", addr)
		}
		if got := c.LocalAddr().String(); got != addr.String() {
			t.Errorf("connected to %s, want %s", got, addr)
		}
		c.Close()
		up.Close()
		l.Close()
		if _, err := ls.Dial(context.Background(), addr); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("%s closed: %v, want ECONNREFUSED", addr, err)
		}
	}
}
