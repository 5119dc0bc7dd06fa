package seedserver

import (
	"crypto/tls"
	"net"
	"sync"
	"time"

	"github.com/tendril-net/tendril/edge/pipe"
)

// batchRoom is the least room a Read must have left to try for another TLS record: a record
// carries at most 16 KiB of plaintext.
const batchRoom = 16 << 10

// recordBatcher makes one Read return every TLS record already received, not just the first.
// A tls.Conn's Read returns at most one record (16 KiB), and each Read's bytes go into the
// tunnel's netstack as one write, which becomes one TCP segment and one WireGuard packet: without
// it the CONNECT front-end's packets to the shoot are a fraction of the 60,000 bytes the tunnel's
// MTU allows; with recordBatcher over readAhead they are as large as those from the shoot
// (docs/performance.md, "Reversed tunnel", what changed on 2026-11-23).
// Records that have arrived are decrypted and appended without waiting for more: a Read never
// blocks longer than it did.
type recordBatcher struct {
	*tls.Conn
	deadline time.Time // the read deadline the caller set, restored after each batch
	// drained: the last Read ended because the next record was not there yet (a read with room
	// for a whole record timed out at once), so TLS holds no bytes to hand out and readAhead
	// none either: whatever comes next arrives on the socket first.
	drained bool
}

// WaitReadable waits without a buffer until the socket has bytes, if the last Read drained
// what TLS and readAhead held (pipe.WaitReadable); otherwise it returns at once, as for a
// Read that may find bytes TLS holds. So a connection from kube-apiserver that went idle after
// its last bytes holds no relay buffer either.
func (b *recordBatcher) WaitReadable(deadline time.Time) error {
	ra, ok := b.Conn.NetConn().(*readAhead)
	if !b.drained || !ok || ra.buf != nil {
		return nil
	}
	_, err := pipe.WaitReadable(ra.Conn, deadline)
	return err
}

// past is a read deadline that has passed: a Read with it returns what TLS holds and does not
// touch the network.
var past = time.Unix(1, 0)

func (b *recordBatcher) SetReadDeadline(t time.Time) error {
	b.deadline = t
	return b.Conn.SetReadDeadline(t)
}

func (b *recordBatcher) SetDeadline(t time.Time) error {
	b.deadline = t
	return b.Conn.SetDeadline(t)
}

func (b *recordBatcher) Read(p []byte) (int, error) {
	b.drained = false
	n, err := b.Conn.Read(p)
	if err != nil || len(p)-n < batchRoom {
		return n, err
	}
	// A timeout leaves a tls.Conn usable (it is a temporary error, not recorded as the
	// connection's); any other error is, and the next Read returns it again.
	_ = b.Conn.SetReadDeadline(past)
	for len(p)-n >= batchRoom {
		m, err := b.Conn.Read(p[n:])
		n += m
		if err != nil {
			// With the deadline past, the socket is not read: TLS timed out because it
			// needed more than it and readAhead held, and it took all readAhead held.
			b.drained = m == 0 && pipe.IsTimeout(err)
			break
		}
	}
	_ = b.Conn.SetReadDeadline(b.deadline)
	return n, nil
}

// readAheadSize is the most one read from a TLS client's socket takes in: eight full records'
// worth (16 KiB of plaintext each), so that recordBatcher finds whatever a busy sender's writes
// put in the socket at once, where TLS alone reads a record or two per read.
const readAheadSize = 128 << 10

// readAheads are readAhead's buffers, held only while they hold bytes: a read takes one once
// the socket has bytes (pipe.WaitReadable), so an idle connection keeps none. Bound: one per
// CONNECT connection whose bytes are being read at the moment; what a load leaves in the pool
// goes with the next two GCs, which internal/host/idlemem runs once the server is idle.
var readAheads = sync.Pool{New: func() any { return new([readAheadSize]byte) }}

// readAhead is the socket under a TLS server connection. It takes in everything the socket
// has, up to readAheadSize, in one read and hands it to TLS in the pieces TLS asks for (a
// record header, then the record); TLS then finds every record that arrived together already
// there, which is what recordBatcher collects. What it holds is returned before the socket
// is read again, whatever the read deadline (as TLS does with what it holds).
type readAhead struct {
	net.Conn
	buf  *[readAheadSize]byte // nil while empty
	r, w int
}

func (c *readAhead) Read(p []byte) (int, error) {
	if c.buf == nil {
		// The socket's read deadline (TLS's) bounds the wait.
		if _, err := pipe.WaitReadable(c.Conn, time.Time{}); err != nil {
			return 0, err
		}
		buf := readAheads.Get().(*[readAheadSize]byte)
		n, err := c.Conn.Read(buf[:])
		if n == 0 {
			readAheads.Put(buf)
			return 0, err
		}
		// An error with bytes (the socket's end right after them) comes again on the next
		// read of the socket.
		c.buf, c.r, c.w = buf, 0, n
	}
	n := copy(p, c.buf[c.r:c.w])
	c.r += n
	if c.r == c.w {
		readAheads.Put(c.buf)
		c.buf = nil
	}
	return n, nil
}
