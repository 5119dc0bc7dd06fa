package loops

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

func newLoops(t *testing.T) *Loops {
	t.Helper()
	ls, err := NewLoops(LoopsConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ls.Close)
	return ls
}

// joined sets up client ⇄ (a | Loops | b) ⇄ server over real sockets, with first sent to the
// server before the client's bytes.
func joined(t *testing.T, ls *Loops, g *Group, first []byte, idle time.Duration) (client, server net.Conn, done chan [2]int64) {
	t.Helper()
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	done = make(chan [2]int64, 2) // 2: a second call would show up in the test
	if err := ls.Join(g, a, b, first, idle, func(x, y int64) { done <- [2]int64{x, y} }); err != nil {
		t.Fatal(err)
	}
	return client, server, done
}

func waitDone(t *testing.T, done chan [2]int64) [2]int64 {
	t.Helper()
	select {
	case n := <-done:
		select {
		case again := <-done:
			t.Fatalf("done called twice: %v, %v", n, again)
		case <-time.After(50 * time.Millisecond):
		}
		return n
	case <-time.After(10 * time.Second):
		t.Fatal("the pair did not end")
		return [2]int64{}
	}
}

func TestLoopsHalfCloseAndFirstBytes(t *testing.T) {
	ls := newLoops(t)
	var g Group
	client, server, done := joined(t, ls, &g, []byte("hello:"), 0)
	req := bytes.Repeat([]byte("q"), 3<<20)
	go func() {
		_, _ = client.Write(req)
		_ = client.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(server) // ends only if the half-close was passed on
	if err != nil || !bytes.Equal(got, append([]byte("hello:"), req...)) {
		t.Fatalf("server read %d bytes (%v), want %d", len(got), err, len(req)+6)
	}
	if g.Len() != 1 {
		t.Fatalf("group has %d open pairs during the answer, want 1", g.Len())
	}
	if _, err := server.Write([]byte("answer")); err != nil {
		t.Fatal(err)
	}
	_ = server.(*net.TCPConn).CloseWrite()
	ans, err := io.ReadAll(client)
	if err != nil || string(ans) != "answer" {
		t.Fatalf("client read %q (%v)", ans, err)
	}
	if n := waitDone(t, done); n != [2]int64{int64(len(req)) + 6, 6} {
		t.Fatalf("counted %v", n)
	}
	if g.Len() != 0 {
		t.Fatalf("group has %d open pairs after the end, want 0", g.Len())
	}
}

// A slow reader on one side holds the other side back without losing or reordering a byte, both
// ways at once.
func TestLoopsBackPressureKeepsEveryByte(t *testing.T) {
	ls := newLoops(t)
	var g Group
	client, server, done := joined(t, ls, &g, nil, 0)
	const size = 16 << 20
	send := func(c net.Conn, seed byte) [32]byte {
		b := make([]byte, size)
		for i := range b {
			b[i] = byte(i*7) + seed
		}
		go func() {
			_, _ = c.Write(b)
			_ = c.(*net.TCPConn).CloseWrite()
		}()
		return sha256.Sum256(b)
	}
	slowRead := func(c net.Conn) ([32]byte, int) {
		h := sha256.New()
		buf := make([]byte, 8<<10)
		n := 0
		for i := 0; ; i++ {
			m, err := c.Read(buf)
			h.Write(buf[:m])
			n += m
			if err != nil {
				break
			}
			if i%64 == 0 {
				time.Sleep(time.Millisecond) // slower than the sender: the relay must hold back
			}
		}
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		return sum, n
	}
	up := send(client, 1)
	downSum := send(server, 2)
	var wg sync.WaitGroup
	var gotUp, gotDown [32]byte
	var nUp, nDown int
	wg.Go(func() { gotUp, nUp = slowRead(server) })
	wg.Go(func() { gotDown, nDown = slowRead(client) })
	wg.Wait()
	if gotUp != up || gotDown != downSum {
		t.Fatalf("bytes differ: up %d bytes (match %v), down %d bytes (match %v)", nUp, gotUp == up, nDown, gotDown == downSum)
	}
	if n := waitDone(t, done); n != [2]int64{size, size} {
		t.Fatalf("counted %v", n)
	}
}

// A pair ends once neither side has sent for the idle time, and not while one side sends.
func TestLoopsIdleTimeout(t *testing.T) {
	ls := newLoops(t)
	var g Group
	const idle = 200 * time.Millisecond
	quiet, _, quietDone := joined(t, ls, &g, nil, idle)
	client, server, busyDone := joined(t, ls, &g, nil, idle)
	start := time.Now()
	// One direction only, for 4 idle times: a watch whose client never sends.
	go func() {
		for time.Since(start) < 4*idle {
			if _, err := server.Write([]byte("event")); err != nil {
				return
			}
			time.Sleep(idle / 4)
		}
	}()
	waitDone(t, quietDone)
	if took := time.Since(start); took < idle {
		t.Fatalf("the quiet pair ended after %v, before its idle time %v", took, idle)
	}
	if _, err := quiet.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the quiet pair's client read %v, want EOF", err)
	}
	buf := make([]byte, 5)
	for time.Since(start) < 4*idle-idle/2 {
		if _, err := io.ReadFull(client, buf); err != nil {
			t.Fatalf("the busy pair broke after %v: %v", time.Since(start), err)
		}
	}
	select {
	case n := <-busyDone:
		t.Fatalf("the busy pair ended after %v (%v)", time.Since(start), n)
	default:
	}
	waitDone(t, busyDone) // and ends once the events stop
}

// A reset on one side closes the other.
func TestLoopsResetEndsPair(t *testing.T) {
	ls := newLoops(t)
	var g Group
	client, server, done := joined(t, ls, &g, nil, 0)
	_ = server.(*net.TCPConn).SetLinger(0)
	server.Close() // RST
	_ = client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(make([]byte, 1)); err == nil {
		t.Fatal("the client read a byte from a pair whose server reset")
	}
	waitDone(t, done)
}

func TestLoopsCloseGroup(t *testing.T) {
	ls := newLoops(t)
	var g1, g2 Group
	var dones []chan [2]int64
	for range 3 {
		_, _, d := joined(t, ls, &g1, nil, 0)
		dones = append(dones, d)
	}
	c2, s2, d2 := joined(t, ls, &g2, nil, 0)
	if n := ls.CloseGroup(&g1); n != 3 {
		t.Fatalf("CloseGroup closed %d, want 3", n)
	}
	for _, d := range dones {
		waitDone(t, d)
	}
	if g1.Len() != 0 || g2.Len() != 1 {
		t.Fatalf("open pairs: g1 %d, g2 %d; want 0, 1", g1.Len(), g2.Len())
	}
	a, b := tcpPair(t)
	if err := ls.Join(&g1, a, b, nil, 0, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Join to a closed group: %v, want ErrClosed", err)
	}
	// The other group's pair still works.
	if _, err := c2.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s2, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	ls.Close()
	waitDone(t, d2)
}

// Idle pairs hold their two sockets and no goroutine; closing them gives the sockets back.
func TestLoopsIdlePairsHoldTwoDescriptorsAndNoGoroutine(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("counts /proc/self/fd")
	}
	ls := newLoops(t)
	var g Group
	const n = 500
	type ends struct{ client, server net.Conn }
	var all []ends
	var dones []chan [2]int64
	// The test's own ends: 2 per pair; the pair joined by the loops: 2 more.
	fdsBefore, gBefore := countFDs(t), runtime.NumGoroutine()
	for range n {
		c, s, d := joined(t, ls, &g, nil, 0)
		all = append(all, ends{c, s})
		dones = append(dones, d)
	}
	time.Sleep(50 * time.Millisecond) // let closed Go conns' finalizers and pollers settle
	if got := countFDs(t) - fdsBefore; got != 4*n {
		t.Fatalf("%d idle pairs added %d fds, want %d (2 test ends + 2 relayed sockets each)", n, got, 4*n)
	}
	if got := runtime.NumGoroutine() - gBefore; got > 0 {
		t.Fatalf("%d idle pairs added %d goroutines", n, got)
	}
	for i, e := range all {
		if i%50 != 0 {
			continue
		}
		if _, err := e.client.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(e.server, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
	}
	for _, e := range all {
		e.client.Close()
		e.server.Close()
	}
	for _, d := range dones {
		select {
		case <-d:
		case <-time.After(10 * time.Second):
			t.Fatal("a pair did not end")
		}
	}
	if got := countFDs(t); got > fdsBefore {
		t.Fatalf("%d fds open after the pairs ended, %d before", got, fdsBefore)
	}
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// A dialed upstream joins with the bytes read first, even when the upstream spoke before the
// join (its readable edge came while the socket was still the dialer's).
func TestLoopsDialAndJoin(t *testing.T) {
	ls := newLoops(t)
	var g Group
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			_, _ = c.Write([]byte("banner\n")) // speaks first
		}
		accepted <- c
	}()
	up, err := ls.Dial(context.Background(), netip.MustParseAddrPort(l.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	server := <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	defer server.Close()
	time.Sleep(20 * time.Millisecond) // the banner arrives before the join
	client, a := tcpPair(t)
	defer client.Close()
	done := make(chan [2]int64, 2)
	if err := ls.JoinDialed(&g, a, up, []byte("first "), 0, func(x, y int64) { done <- [2]int64{x, y} }); err != nil {
		t.Fatal(err)
	}
	_ = client.SetDeadline(time.Now().Add(5 * time.Second))
	_ = server.SetDeadline(time.Now().Add(5 * time.Second))
	banner := make([]byte, 7)
	if _, err := io.ReadFull(client, banner); err != nil || string(banner) != "banner\n" {
		t.Fatalf("client read %q (%v), want the banner sent before the join", banner, err)
	}
	if _, err := client.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 11)
	if _, err := io.ReadFull(server, got); err != nil || string(got) != "first hello" {
		t.Fatalf("server read %q (%v)", got, err)
	}
	up.Close() // after the join: nothing
	client.Close()
	server.Close()
	if n := waitDone(t, done); n != [2]int64{11, 7} {
		t.Fatalf("counted %v", n)
	}
}

func TestLoopsDialErrors(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("counts /proc/self/fd")
	}
	ls := newLoops(t)
	addr := netip.MustParseAddrPort(testnet.RefusedAddr(t))
	fds := countFDs(t)
	if _, err := ls.Dial(context.Background(), addr); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial to a closed port: %v, want ECONNREFUSED", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := ls.Dial(ctx, addr); !errors.Is(err, context.Canceled) {
		t.Fatalf("dial with a canceled context: %v", err)
	}
	if n := countFDs(t); n != fds {
		t.Fatalf("%d fds after failed dials, %d before", n, fds)
	}
}

// tcpPair is a connected pair of TCP sockets on loopback, as net.Conns.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	return testnet.TCPPair(t)
}
