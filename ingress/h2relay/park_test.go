package h2relay

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// splitConn is a client's TCP connection whose next write, once armed, goes out in two parts
// with pause between them: a TLS record cut in the middle.
type splitConn struct {
	net.Conn
	armed atomic.Bool
	pause func()
}

func (c *splitConn) Write(b []byte) (int, error) {
	if len(b) > 4 && c.armed.CompareAndSwap(true, false) {
		n, err := c.Conn.Write(b[:4])
		if err != nil {
			return n, err
		}
		c.pause()
		m, err := c.Conn.Write(b[4:])
		return n + m, err
	}
	return c.Conn.Write(b)
}

// waitParked waits until n client connections are parked.
func waitParked(t *testing.T, r *Relay, n int64) {
	t.Helper()
	for range 500 {
		if r.Parked() == n {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%d connections parked, want %d", r.Parked(), n)
}

// TestParkedConnectionServes: a quiet client connection is parked and serves its next request
// as before, on the same connection, also when that request's first TLS record comes in two
// parts with a park between them.
func TestParkedConnectionServes(t *testing.T) {
	const parkAfter = 20 * time.Millisecond
	r := newRig(t, Config{ParkAfter: parkAfter}, http.HandlerFunc(echo))
	var dials atomic.Int32
	var conn atomic.Pointer[splitConn]
	tr := r.client.Transport.(*http.Transport)
	addr := relayAddr(t, tr)
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		dials.Add(1)
		sc := &splitConn{Conn: c}
		conn.Store(sc)
		return sc, nil
	}
	post := func(body string) {
		t.Helper()
		resp, err := r.client.Post("https://relay.test/echo", "text/plain", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != body || resp.Header.Get("X-Seen") != "yes" {
			t.Fatalf("got %q (%v), x-seen %q", got, err, resp.Header.Get("X-Seen"))
		}
	}
	for i := range 3 {
		post(strings.Repeat("a", 100+i))
		waitParked(t, r.relay, 1)
	}
	// The next record's first 4 bytes wake the connection; its probe finds no whole record
	// and parks it again, with the 4 bytes in TLS's buffer, until the rest comes.
	sc := conn.Load()
	var parkedMidRecord atomic.Int64
	sc.pause = func() { // on the transport's writer: it records, the test asserts
		time.Sleep(10 * parkAfter) // the 4 bytes woke the connection; it parks again
		for range 500 {
			if parkedMidRecord.Store(r.relay.Parked()); parkedMidRecord.Load() == 1 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	sc.armed.Store(true)
	post("after a cut record")
	if sc.armed.Load() {
		t.Fatal("no write was cut")
	}
	if n := parkedMidRecord.Load(); n != 1 {
		t.Fatalf("%d connections parked with half a record read, want 1", n)
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("%d client connections, want all requests on one", n)
	}
	waitParked(t, r.relay, 1)
}

// TestParkedIdleTimeout: a parked connection closes at its idle deadline, with no reader of its
// own that could see it, and bytes that never make a frame do not move that deadline.
func TestParkedIdleTimeout(t *testing.T) {
	const idle = 300 * time.Millisecond
	r := newRig(t, Config{ParkAfter: 20 * time.Millisecond, IdleTimeout: idle}, http.HandlerFunc(echo))
	tr := r.client.Transport.(*http.Transport)
	open := func() (*tls.Conn, *trickleConn, *http2.Framer) {
		raw, err := net.Dial("tcp", relayAddr(t, tr))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { raw.Close() })
		trickle := &trickleConn{Conn: raw, gap: 30 * time.Millisecond}
		c := tls.Client(trickle, &tls.Config{RootCAs: tr.TLSClientConfig.RootCAs, ServerName: "relay.test", NextProtos: []string{"h2"}})
		if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
			t.Fatal(err)
		}
		fr := http2.NewFramer(c, c)
		if err := fr.WriteSettings(); err != nil {
			t.Fatal(err)
		}
		waitParked(t, r.relay, 1)
		return c, trickle, fr
	}

	// A connection that says nothing more: the relay closes it (its frames read, then the end).
	quiet, _, _ := open()
	_ = quiet.SetReadDeadline(time.Now().Add(10 * idle))
	if _, err := io.Copy(io.Discard, quiet); err != nil {
		t.Fatalf("a parked connection without streams was not closed at its idle deadline (%v): %v", idle, err)
	}
	waitParked(t, r.relay, 0)

	// A PING's record, sent a byte at a time but its last: each byte wakes the connection,
	// none completes a frame. 38 bytes at 30 ms are over a second, several idle timeouts.
	_, trickle, fr := open()
	start := time.Now()
	trickle.on.Store(true)
	err := fr.WritePing(false, [8]byte{1})
	if err == nil || errors.Is(err, errHeldBack) {
		t.Fatalf("the trickle went on for %v, want the connection closed at its idle deadline (%v)", time.Since(start), idle)
	}
	if d := time.Since(start); d < idle-50*time.Millisecond {
		t.Fatalf("closed after %v, before its idle deadline (%v)", d, idle)
	}
	waitParked(t, r.relay, 0)
}

// trickleConn, once on, writes a byte at a time with gap between them, and holds the last byte
// of a write back.
type trickleConn struct {
	net.Conn
	on  atomic.Bool
	gap time.Duration
}

func (c *trickleConn) Write(b []byte) (int, error) {
	if !c.on.Load() {
		return c.Conn.Write(b)
	}
	for i := range len(b) - 1 {
		if _, err := c.Conn.Write(b[i : i+1]); err != nil {
			return i, err
		}
		time.Sleep(c.gap)
	}
	return len(b) - 1, errHeldBack
}

var errHeldBack = errors.New("trickle: the last byte held back")

// closeConn tells when it was closed.
type closeConn struct {
	net.Conn
	once   sync.Once
	closed chan struct{}
}

func (c *closeConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// TestParkedWithStream: a connection whose only stream is a quiet response (a watch) parks
// with it open; the response goes on reaching the client, and once it ended the connection
// closes at its idle deadline.
func TestParkedWithStream(t *testing.T) {
	const idle = 300 * time.Millisecond
	parkedMidStream := make(chan int64, 1)
	var r *rig
	r = newRig(t, Config{ParkAfter: 20 * time.Millisecond, IdleTimeout: idle}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.WriteString(w, "first\n")
		w.(http.Flusher).Flush()
		time.Sleep(300 * time.Millisecond)
		parkedMidStream <- r.relay.Parked()
		_, _ = io.WriteString(w, "second\n")
	}))
	tr := r.client.Transport.(*http.Transport)
	addr := relayAddr(t, tr)
	var conn atomic.Pointer[closeConn]
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		cc := &closeConn{Conn: c, closed: make(chan struct{})}
		conn.Store(cc)
		return cc, nil
	}
	resp, err := r.client.Get("https://relay.test/watch")
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(got) != "first\nsecond\n" {
		t.Fatalf("got %q (%v)", got, err)
	}
	if n := <-parkedMidStream; n != 1 {
		t.Fatalf("%d connections parked while the response waited, want 1", n)
	}
	// The client keeps the connection; the relay closes it once it has been idle long enough.
	ended := time.Now()
	select {
	case <-conn.Load().closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was not closed after its stream ended, want it closed at its idle deadline")
	}
	if d := time.Since(ended); d < idle-50*time.Millisecond {
		t.Fatalf("closed %v after the stream ended, before its idle deadline (%v)", d, idle)
	}
}

// BenchmarkParkCycle: the CPU of the whole process (client, relay and upstream, all here) per
// request after a pause, when the connection parks in each pause ("parks") and when it stays
// awake ("stays"): the difference is a park and a wake-up. Here (2 vCPUs of a VM, otherwise idle)
// it was 250–400 µs, most of it the quiet check's timer waking an idle process: a Go program
// that only sleeps 30 ms per loop spends ~250 µs of CPU per wake-up here, ~200 µs more with one
// timer more in between.
func BenchmarkParkCycle(b *testing.B) {
	const pause = 30 * time.Millisecond
	for _, c := range []struct {
		name      string
		parkAfter time.Duration
	}{{"parks", pause / 3}, {"stays", time.Hour}} {
		b.Run(c.name, func(b *testing.B) {
			r := newRig(b, Config{ParkAfter: c.parkAfter}, http.HandlerFunc(echo))
			get := func() {
				resp, err := r.client.Get("https://relay.test/echo")
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			get()
			b.ResetTimer()
			before := processCPU(b)
			for range b.N {
				time.Sleep(pause)
				get()
			}
			b.ReportMetric(float64((processCPU(b)-before).Microseconds())/float64(b.N), "cpu-µs/op")
		})
	}
}

// processCPU is the process's CPU time so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
