package pipe

import (
	"bytes"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	return testnet.TCPPair(t)
}

// relayed sets up client ⇄ (a | Pipe | b) ⇄ server over real sockets.
func relayed(t *testing.T, idle time.Duration) (client, server net.Conn, done chan [2]int64) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	done = make(chan [2]int64, 1)
	go func() {
		x, y := Pipe(a, b, idle)
		a.Close()
		b.Close()
		done <- [2]int64{x, y}
	}()
	return client, server, done
}

func TestHalfClose(t *testing.T) {
	client, server, done := relayed(t, 0)
	req := bytes.Repeat([]byte("q"), 3<<20) // more than one chunk
	go func() {
		_, _ = client.Write(req)
		_ = client.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(server) // ends only if the half-close was passed on
	if err != nil || !bytes.Equal(got, req) {
		t.Fatalf("server read %d bytes (%v), want %d", len(got), err, len(req))
	}
	// The other direction still works after the first one ended.
	if _, err := server.Write([]byte("answer")); err != nil {
		t.Fatal(err)
	}
	_ = server.(*net.TCPConn).CloseWrite()
	ans, err := io.ReadAll(client)
	if err != nil || string(ans) != "answer" {
		t.Fatalf("client read %q (%v)", ans, err)
	}
	if n := <-done; n != [2]int64{int64(len(req)), 6} {
		t.Fatalf("counted %v", n)
	}
}

func TestIdleTimeout(t *testing.T) {
	for _, through := range []struct {
		name string
		wrap func(net.Conn) net.Conn
	}{
		{"splice", func(c net.Conn) net.Conn { return c }},
		// A destination that cannot splice: the directions copy, and the one from the
		// socket waits for bytes without a buffer, the deadline bounding the wait.
		{"copy", func(c net.Conn) net.Conn { return opaque{c} }},
	} {
		t.Run(through.name, func(t *testing.T) { testIdleTimeout(t, through.wrap) })
	}
}

func testIdleTimeout(t *testing.T, wrap func(net.Conn) net.Conn) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		Pipe(a, wrap(b), 100*time.Millisecond)
		a.Close()
		b.Close()
	}()
	// The relay's idle clock starts when it copies the byte, which is after this write and
	// before the server reads it: timing from the write bounds the idle time from below (timing
	// from the read did not, and failed on a loaded machine).
	start := time.Now()
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := io.ReadFull(server, buf); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("an idle relay did not end")
	}
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Fatalf("ended after %v, before the idle timeout", d)
	}
	_ = server.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := server.Read(buf); err == nil {
		t.Fatal("the server's connection is still open after the idle timeout")
	}
}

func TestResetEndsBoth(t *testing.T) {
	client, server, done := relayed(t, 0)
	_ = client.(*net.TCPConn).SetLinger(0)
	client.Close() // RST
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a reset did not end the relay")
	}
	_ = server.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := io.ReadAll(server); IsTimeout(err) {
		t.Fatal("the server's connection is still open after the client's reset")
	}
}

// readFromConn is a connection whose ReadFrom must not be used: a *net.TCPConn's would copy
// through a 32 KiB buffer of its own whenever the source is no socket (a tunnel's netstack).
type readFromConn struct {
	net.Conn
	used *atomic.Bool
}

func (c readFromConn) ReadFrom(r io.Reader) (int64, error) {
	c.used.Store(true)
	return io.Copy(c.Conn, r)
}

func TestCopiesThroughItsOwnBuffer(t *testing.T) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	dst := readFromConn{Conn: b, used: new(atomic.Bool)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Pipe(a, dst, 0)
		a.Close()
		b.Close()
	}()
	payload := bytes.Repeat([]byte("p"), 1<<20)
	go func() {
		_, _ = client.Write(payload)
		_ = client.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(io.LimitReader(server, int64(len(payload))))
	if err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("server read %d bytes (%v), want %d", len(got), err, len(payload))
	}
	if dst.used.Load() {
		t.Fatal("the copy went through the destination's ReadFrom, not the relay's buffer")
	}
	server.Close()
	<-done
}

// opaque hides a connection's type: Pipe can neither splice it nor wait on it without a
// buffer, as with a TLS connection.
type opaque struct{ net.Conn }

// TestIdleDirectionHoldsNoBuffer: a direction whose source is a socket takes a copy buffer
// only while bytes move; an idle connection through a tunnel held 128 KiB per direction for
// as long as it was open (a kube-apiserver's idle connections to webhooks, logs -f, exec).
// A source that cannot be waited on keeps its buffer.
func TestIdleDirectionHoldsNoBuffer(t *testing.T) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	base := BuffersHeld()
	done := make(chan struct{})
	go func() {
		defer close(done)
		Pipe(a, opaque{b}, time.Minute)
		a.Close()
		b.Close()
	}()
	heldNow := func(want int64, what string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for BuffersHeld()-base != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d copy buffers held, want %d", what, BuffersHeld()-base, want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	// Idle: only the opaque source's direction (server → client) holds one.
	heldNow(1, "idle")
	payload := bytes.Repeat([]byte("p"), 3<<20)
	go func() { _, _ = client.Write(payload) }()
	if _, err := io.ReadFull(server, make([]byte, len(payload))); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = server.Write(payload) }()
	if _, err := io.ReadFull(client, make([]byte, len(payload))); err != nil {
		t.Fatal(err)
	}
	heldNow(1, "idle after bytes both ways")
	client.Close()
	server.Close()
	<-done
	heldNow(0, "closed")
}
