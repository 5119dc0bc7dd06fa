// Package pipe joins two connections with two goroutines: it copies bytes both ways until both
// directions have ended, passing each end of stream on as a half-close, with an idle timeout
// (Pipe; splice(2) between two TCP connections, a pooled buffer otherwise, held only while bytes
// move). It also gives the connection edge its readiness wait without a buffer (WaitReadable)
// and its one test of a deadline's expiry (IsTimeout). It does not dial, accept, parse or count:
// package loops joins TCP pairs on epoll event loops instead of goroutines.
package pipe

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// chunk is how much one splice may move before the idle deadline is pushed out again: large
// enough that the deadline costs nothing per byte (one extra call per MiB).
const chunk = 1 << 20

// bufferSize is the copy buffer between connections that cannot splice (a userspace netstack
// connection on one side): a tunnel with a 60,000-byte MTU moves about half as much with 32 KiB
// reads as with 256 KiB ones; 128 KiB per direction keeps most of that, and only connections
// that cannot splice hold it.
const bufferSize = 128 << 10

// buffers are the copy buffers, reused across connections: every connection through a tunnel
// needs two, and allocating (and zeroing) 256 KiB per dial is a share of tendril-server's CPU
// per dial worth saving (docs/performance.md, "Reversed tunnel", why the dial rate cannot reach
// 2× konnectivity). A direction holds one only from the moment its source has bytes (or its
// end) until it has written them on and a read has found the source drained (WaitReadable), so
// an idle connection holds none; a source it cannot wait on (a bare TLS connection) keeps its
// buffer while open. Bound: the directions moving bytes at the moment, plus one per such
// source; a sync.Pool keeps no more than were in use at once, and drops them over two garbage
// collections (tendril-server and tendril-agent run those once a load is over:
// internal/host/idlemem). BuffersHeld counts them.
var buffers = sync.Pool{New: func() any { return new([bufferSize]byte) }}

// held is the number of copy buffers directions hold now (BuffersHeld).
var held atomic.Int64

// BuffersHeld is how many 128 KiB copy buffers connections hold now: directions moving bytes
// (or blocked writing them), and sources that cannot be waited on.
func BuffersHeld() int64 { return held.Load() }

// Pipe copies a to b and b to a until both directions have ended, half-closing each write side
// when its read side reaches end of stream (as Envoy's tcp_proxy does), and returns the bytes
// moved each way. A direction without a byte for idle (0: no limit) ends both; so does a reset
// on either side. The caller closes both connections once Pipe returns.
func Pipe(a, b net.Conn, idle time.Duration) (aToB, bToA int64) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		aToB = half(b, a, idle)
	}()
	bToA = half(a, b, idle)
	wg.Wait()
	return aToB, bToA
}

// half copies src to dst and then half-closes dst. A read error other than end of stream (a
// reset, the idle timeout) closes both connections, so the other direction ends too. The idle
// timeout is measured per chunk: a direction is idle once a whole deadline passes without a
// byte, so it ends between idle and twice idle after its last byte.
func half(dst, src net.Conn, idle time.Duration) int64 {
	if spliceable(dst, src) {
		return splice(dst, src, idle)
	}
	var total, sinceDeadline int64
	var deadline time.Time
	setDeadline := func() {
		if idle > 0 {
			deadline = time.Now().Add(idle)
			_ = src.SetReadDeadline(deadline)
		}
		sinceDeadline = 0
	}
	var buf *[bufferSize]byte
	// waitable: WaitReadable waits on src, so a drained direction can give its buffer back.
	var waitable bool
	release := func() {
		if buf != nil {
			buffers.Put(buf)
			held.Add(-1)
			buf = nil
		}
	}
	defer release()
	setDeadline()
	for {
		var err error
		if buf == nil {
			// Bytes first, then a buffer for them.
			if waitable, err = WaitReadable(src, deadline); err == nil {
				buf = buffers.Get().(*[bufferSize]byte)
				held.Add(1)
			}
		}
		var n int
		if err == nil {
			n, err = src.Read(buf[:])
		}
		if n > 0 {
			// Write directly: a *net.TCPConn destination's ReadFrom (which io.Copy would
			// use) splices only from another socket and otherwise copies through a 32 KiB
			// buffer of its own, allocated per call: the agent wrote to the pod in 32 KiB
			// pieces.
			if _, werr := dst.Write(buf[:n]); werr != nil {
				src.Close()
				dst.Close()
				return total
			}
			total += int64(n)
			sinceDeadline += int64(n)
		}
		switch {
		case err == nil:
			if n < bufferSize && waitable {
				release() // drained, most likely: the next read waits without it
			}
			if sinceDeadline >= chunk {
				setDeadline()
			}
			continue
		case err == io.EOF: // the peer finished sending
			closeWrite(dst)
			return total
		case IsTimeout(err) && sinceDeadline > 0:
			setDeadline() // bytes moved within the window: not idle
			continue
		}
		src.Close()
		dst.Close()
		return total
	}
}

// splice copies between two TCP connections: the kernel moves the bytes (splice(2)), no
// user-space buffer.
func splice(dst, src net.Conn, idle time.Duration) int64 {
	var total int64
	for {
		if idle > 0 {
			_ = src.SetReadDeadline(time.Now().Add(idle))
		}
		n, err := io.Copy(dst, io.LimitReader(src, chunk))
		total += n
		switch {
		case err == nil && n == chunk:
			continue // chunk done, more to come
		case err == nil: // end of stream: the peer finished sending
			closeWrite(dst)
			return total
		case IsTimeout(err) && n > 0:
			continue // bytes moved within the window: not idle
		}
		src.Close()
		dst.Close()
		return total
	}
}

// WaitReadable waits until a Read of c would not block — bytes, the end of stream, an error —
// without a buffer. deadline is the read deadline the caller set on c (the zero Time: none);
// past it, the error is a timeout. It reports false, at once, for a connection it cannot wait
// on: anything but a TCP socket or a connection that waits itself (tunnel/netstack's, the
// CONNECT front-end's TLS connections). A bare TLS connection is one of those: what it has
// decrypted already is not in its socket.
func WaitReadable(c net.Conn, deadline time.Time) (bool, error) {
	switch c := c.(type) {
	case interface{ WaitReadable(time.Time) error }:
		return true, c.WaitReadable(deadline)
	case *net.TCPConn:
		return waitSocket(c)
	}
	return false, nil
}

func spliceable(dst, src net.Conn) bool {
	_, d := dst.(*net.TCPConn)
	_, s := src.(*net.TCPConn)
	return d && s
}

// IsTimeout reports whether err is a deadline's expiry (a read or write deadline, a dial's
// timeout): the one test of it for every package of the connection edge, which counts a timeout
// apart from other failures.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		if err := cw.CloseWrite(); err != nil && !errors.Is(err, net.ErrClosed) && !errors.Is(err, syscall.ENOTCONN) {
			c.Close()
		}
		return
	}
	c.Close()
}
