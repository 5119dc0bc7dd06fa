package harness

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/internal/inflight"
)

// Requests an upstream understands: one byte after the handshake.
const (
	reqSmall byte = 'r' // answer with the small payload, then close
	reqBulk  byte = 'b' // answer with BulkBytes bytes, then close
)

// upstreamTimeout bounds one upstream connection from accept to the end of
// the request byte, and every later write: a stuck client must not keep an
// upstream goroutine forever.
const upstreamTimeout = 10 * time.Second

// bulkChunk is the write size for bulk answers: four maximum-size TLS records,
// so each write fills whole records.
const bulkChunk = 64 << 10

// upstream is one shoot's API server stand-in: a TLS server holding only its
// own host's certificate. It refuses a ClientHello that names another host,
// so a connection routed to the wrong shoot fails at the handshake rather than
// being counted for the wrong upstream.
type upstream struct {
	shoot int
	host  string
	ln    net.Listener
	tls   *tls.Config
	small []byte // the small answer; it names the shoot, so the client can check where it landed
	bulk  int64

	served     [3]atomic.Int64 // answered requests: [0] small, [1] bulk, [2] echo (held connections)
	misrouted  atomic.Int64    // ClientHellos naming another host
	failed     atomic.Int64    // other handshake or request failures
	conns      inflight.Set    // closed by close: aborts what the connections are blocked in
	handlersWG sync.WaitGroup  // accept loop and connection handlers
}

// smallPayload is the answer of shoot i's upstream: its identity, padded to
// size bytes.
func smallPayload(i, size int) []byte {
	b := make([]byte, size)
	for j := range b {
		b[j] = '.'
	}
	copy(b, fmt.Sprintf("tendril-bench upstream s%d\n", i))
	b[len(b)-1] = '\n'
	return b
}

// upstreams are the run's N upstream servers.
type upstreams []*upstream

// startUpstreams starts one upstream per certificate on 127.0.0.1:0.
func startUpstreams(p *pki, hosts []string, payload int, bulk int64) (upstreams, error) {
	var us upstreams
	for i, host := range hosts {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			us.Close()
			return nil, fmt.Errorf("upstream %s: %w", host, err)
		}
		u := &upstream{shoot: i, host: host, ln: ln, small: smallPayload(i, payload), bulk: bulk}
		u.tls = &tls.Config{
			Certificates: []tls.Certificate{p.certs[i]},
			// The client never resumes (each connection is a full
			// handshake, the expensive case the benchmark is about), so
			// session tickets would be bytes and CPU spent for nothing.
			SessionTicketsDisabled: true,
			GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
				if hello.ServerName != u.host {
					u.misrouted.Add(1)
					return nil, fmt.Errorf("upstream %s: ClientHello for %q", u.host, hello.ServerName)
				}
				return nil, nil
			},
		}
		us = append(us, u)
		u.handlersWG.Add(1)
		go u.acceptLoop()
	}
	return us, nil
}

// Close stops accepting, aborts open connections and waits for every
// goroutine of every upstream.
func (us upstreams) Close() {
	for _, u := range us {
		u.close()
	}
	for _, u := range us {
		u.handlersWG.Wait()
	}
}

func (u *upstream) addr() string { return u.ln.Addr().String() }

func (u *upstream) close() {
	u.conns.Close()
	u.ln.Close()
}

func (u *upstream) acceptLoop() {
	defer u.handlersWG.Done()
	for {
		c, err := u.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors or a connection reset before
			// accept: wait a little instead of spinning, then go on.
			time.Sleep(5 * time.Millisecond)
			continue
		}
		if !u.conns.Add(c) {
			c.Close()
			continue
		}
		// After the Add, not under its lock: this loop's own count keeps
		// Close's Wait from returning before it.
		u.handlersWG.Add(1)
		go u.handle(c)
	}
}

func (u *upstream) handle(c net.Conn) {
	defer u.handlersWG.Done()
	defer u.conns.Done(c)
	if err := u.serve(c); err != nil {
		u.failed.Add(1)
	}
}

func (u *upstream) serve(c net.Conn) error {
	if err := c.SetDeadline(time.Now().Add(upstreamTimeout)); err != nil {
		return err
	}
	tc := tls.Server(c, u.tls)
	if err := tc.Handshake(); err != nil {
		return err
	}
	var req [1]byte
	if _, err := io.ReadFull(tc, req[:]); err != nil {
		return err
	}
	switch req[0] {
	case reqSmall:
		if _, err := tc.Write(u.small); err != nil {
			return err
		}
		u.served[0].Add(1)
	case reqBulk:
		if err := u.writeBulk(c, tc); err != nil {
			return err
		}
		u.served[1].Add(1)
	case reqEcho:
		u.served[2].Add(1)
		return echo(c, tc)
	default:
		return fmt.Errorf("unknown request %q", req[0])
	}
	// Close sends close_notify, so the client reads a clean EOF and can tell
	// a complete answer from a cut one.
	return tc.Close()
}

// echo answers the echo request and then echoes every byte until the client
// closes. A held connection is idle for as long as the benchmark holds it,
// so there is no deadline; the upstream's Close ends it.
func echo(c net.Conn, tc *tls.Conn) error {
	if err := c.SetDeadline(time.Time{}); err != nil {
		return err
	}
	buf := []byte{reqEcho}
	for {
		if _, err := tc.Write(buf); err != nil {
			return err
		}
		var b [64]byte
		n, err := tc.Read(b[:])
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		buf = b[:n]
	}
}

var bulkData = func() []byte {
	b := make([]byte, bulkChunk)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}()

func (u *upstream) writeBulk(c net.Conn, tc *tls.Conn) error {
	for left := u.bulk; left > 0; {
		// The deadline is per write, not per answer: a slow but moving
		// transfer is fine, a stalled one is not.
		if err := c.SetWriteDeadline(time.Now().Add(upstreamTimeout)); err != nil {
			return err
		}
		n := min(left, int64(len(bulkData)))
		if _, err := tc.Write(bulkData[:n]); err != nil {
			return err
		}
		left -= n
	}
	return nil
}

// UpstreamStats is what one upstream saw during the whole run, warm-ups and
// readiness probes included.
type UpstreamStats struct {
	Shoot     string `json:"shoot"`
	Host      string `json:"host"`
	Small     int64  `json:"small_requests"`
	Bulk      int64  `json:"bulk_requests"`
	Held      int64  `json:"held,omitempty"` // echo requests: connections held open (idle mode)
	Misrouted int64  `json:"misrouted"`      // ClientHellos naming another shoot's host
	Failed    int64  `json:"failed"`         // other failed connections (aborted at the end of a measurement, too)
}

func (us upstreams) stats(names []string) []UpstreamStats {
	var out []UpstreamStats
	for i, u := range us {
		out = append(out, UpstreamStats{Shoot: names[i], Host: u.host, Small: u.served[0].Load(),
			Bulk: u.served[1].Load(), Held: u.served[2].Load(), Misrouted: u.misrouted.Load(), Failed: u.failed.Load()})
	}
	return out
}
