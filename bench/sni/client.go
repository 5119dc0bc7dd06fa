package sni

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// reason classifies a failed connection.
type reason int

const (
	reasonDial      reason = iota // TCP connect failed or timed out
	reasonHandshake               // TLS handshake failed (other than verification)
	reasonVerify                  // the server's certificate did not verify for the host
	reasonWrite                   // sending the request failed
	reasonRead                    // reading the answer failed or it was cut short
	reasonRoute                   // the answer came from another shoot's upstream
	reasonStalled                 // still unfinished after stallAfter when the measurement ended
	numReasons
)

var reasonNames = [numReasons]string{"dial", "handshake", "verify", "write", "read", "route", "stalled"}

// stallAfter is how long a connection may be in flight when a measurement
// ends before it counts as stalled. Connections cut off by the end of the
// window are not failures, but one that has hung for this long (a dropped
// SYN waits 1 s for its retransmission) is, and without counting it a stall
// would only show as a lower rate.
const stallAfter = time.Second

func (r reason) String() string { return reasonNames[r] }

// connError is a failed connection with its reason.
type connError struct {
	reason reason
	err    error
}

func (e *connError) Error() string { return e.reason.String() + ": " + e.err.Error() }
func (e *connError) Unwrap() error { return e.err }

func fail(r reason, err error) *connError { return &connError{reason: r, err: err} }

// Client timeouts. connTimeout bounds a whole small exchange (dial to EOF),
// far above any healthy latency here (milliseconds) but short enough that a
// black-holed connection does not stall a worker for a whole measurement.
const (
	dialTimeout = 5 * time.Second
	connTimeout = 10 * time.Second
	// bulkIdle bounds each read of a bulk answer; the answer as a whole
	// may take as long as it takes.
	bulkIdle = 10 * time.Second
)

// shootClient is what the client needs to talk to one shoot.
type shootClient struct {
	host     string
	tls      *tls.Config // ServerName host, RootCAs the run's CA, no session cache
	expected []byte      // the small answer of this shoot's upstream
}

// client is the load generator's connection code, the same for every target.
type client struct {
	shoots []shootClient
	dialer net.Dialer
	bulk   int64
}

func newClient(p *pki, hosts []string, payload int, bulk int64) *client {
	c := &client{dialer: net.Dialer{Timeout: dialTimeout}, bulk: bulk}
	for i, h := range hosts {
		c.shoots = append(c.shoots, shootClient{
			host: h,
			// No ClientSessionCache: every connection is a full
			// handshake with certificate verification, like a new
			// kubectl process.
			tls:      &tls.Config{ServerName: h, RootCAs: p.pool, MinVersion: tls.VersionTLS12},
			expected: smallPayload(i, payload),
		})
	}
	return c
}

// slot lets a measurement abort a worker's connection in flight: at the end
// of a measurement, or when the run is cancelled. The mutex is per worker, so
// it is never contended on the hot path.
type slot struct {
	mu      sync.Mutex
	conn    net.Conn
	aborted bool
}

var errAborted = errors.New("aborted")

// set registers c as the connection in flight; false means the slot was
// aborted and c must not be used.
func (s *slot) set(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return false
	}
	s.conn = c
	return true
}

func (s *slot) clear() {
	s.mu.Lock()
	s.conn = nil
	s.mu.Unlock()
}

// abort makes the connection in flight fail at once and every later set fail.
func (s *slot) abort() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.aborted = true
	if s.conn != nil {
		s.conn.SetDeadline(time.Unix(1, 0)) // in the past: pending I/O returns now
	}
}

// connect dials addr and completes a verified handshake for shoot i. The
// caller closes the returned raw connection.
func (c *client) connect(ctx context.Context, addr string, i int, s *slot, deadline time.Time) (net.Conn, *tls.Conn, error) {
	raw, err := c.dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, fail(reasonDial, err)
	}
	if !s.set(raw) {
		raw.Close()
		return nil, nil, fail(reasonDial, errAborted)
	}
	if err := raw.SetDeadline(deadline); err != nil {
		s.clear()
		raw.Close()
		return nil, nil, fail(reasonDial, err)
	}
	tc := tls.Client(raw, c.shoots[i].tls)
	// Handshake, not HandshakeContext: the latter starts a goroutine per
	// connection to watch the context; the deadline and the slot already
	// bound and abort it.
	if err := tc.Handshake(); err != nil {
		s.clear()
		raw.Close()
		var verr *tls.CertificateVerificationError
		if errors.As(err, &verr) {
			return nil, nil, fail(reasonVerify, err)
		}
		return nil, nil, fail(reasonHandshake, err)
	}
	return raw, tc, nil
}

// fetchSmall makes one complete small exchange with shoot i through addr:
// dial, verified handshake, request, answer to EOF, close. It returns the
// time from dial start to the first answer byte. buf must hold at least one
// byte more than the answer. If state is not nil, it receives the
// connection's TLS parameters.
func (c *client) fetchSmall(ctx context.Context, addr string, i int, s *slot, buf []byte, state *tls.ConnectionState) (time.Duration, error) {
	start := time.Now()
	raw, tc, err := c.connect(ctx, addr, i, s, start.Add(connTimeout))
	if err != nil {
		return 0, err
	}
	defer s.clear()
	// The upstream closes first; closing the raw connection skips our
	// close_notify, which would only arrive at a closed socket.
	defer raw.Close()
	if state != nil {
		*state = tc.ConnectionState()
	}
	if _, err := tc.Write([]byte{reqSmall}); err != nil {
		return 0, fail(reasonWrite, err)
	}
	var ttfb time.Duration
	n := 0
	for {
		m, err := tc.Read(buf[n:])
		if m > 0 && n == 0 {
			ttfb = time.Since(start)
		}
		n += m
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return 0, fail(reasonRead, err)
		}
		if n == len(buf) {
			return 0, fail(reasonRead, fmt.Errorf("answer longer than %d bytes", len(buf)-1))
		}
	}
	want := c.shoots[i].expected
	switch {
	case n != len(want):
		return 0, fail(reasonRead, fmt.Errorf("answer of %d bytes, want %d", n, len(want)))
	case !bytes.Equal(buf[:n], want):
		return 0, fail(reasonRoute, fmt.Errorf("answer for %s came from elsewhere: %q", c.shoots[i].host, firstLineOf(buf[:n])))
	}
	return ttfb, nil
}

// fetchBulk makes one bulk exchange with shoot i through addr and adds every
// byte read to *got as it arrives, so a measurement can read throughput over
// its own window rather than per transfer.
func (c *client) fetchBulk(ctx context.Context, addr string, i int, s *slot, buf []byte, got *atomic.Int64) error {
	start := time.Now()
	raw, tc, err := c.connect(ctx, addr, i, s, start.Add(connTimeout))
	if err != nil {
		return err
	}
	defer s.clear()
	defer raw.Close()
	if _, err := tc.Write([]byte{reqBulk}); err != nil {
		return fail(reasonWrite, err)
	}
	var total int64
	for {
		if err := raw.SetReadDeadline(time.Now().Add(bulkIdle)); err != nil {
			return fail(reasonRead, err)
		}
		n, err := tc.Read(buf)
		total += int64(n)
		got.Add(int64(n))
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fail(reasonRead, err)
		}
	}
	if total != c.bulk {
		return fail(reasonRead, fmt.Errorf("bulk answer of %d bytes, want %d", total, c.bulk))
	}
	return nil
}

// probe waits until every shoot answers through t, or timeout passes: a
// peer may accept connections before its routes are in place (tendril
// receives them over xDS just after its listener opens). It returns the TLS
// parameters of the last connection.
func (c *client) probe(ctx context.Context, t *target, timeout time.Duration) (tls.ConnectionState, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	buf := make([]byte, len(c.shoots[0].expected)+1)
	var state tls.ConnectionState
	for i := range c.shoots {
		for {
			var s slot
			_, err := c.fetchSmall(ctx, t.addr(i), i, &s, buf, &state)
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return state, fmt.Errorf("shoot %s through %s: %w", c.shoots[i].host, t.name, err)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	return state, nil
}

// describeTLS names the parameters the handshakes negotiate: Go's client
// defaults, as a Go client such as kubectl would use them.
func describeTLS(s tls.ConnectionState) string {
	return fmt.Sprintf("%s, %s, key exchange %s, ECDSA P-256 certificates, full handshake every connection (no resumption)",
		tls.VersionName(s.Version), tls.CipherSuiteName(s.CipherSuite), s.CurveID)
}

func firstLineOf(b []byte) string {
	l, _, _ := bytes.Cut(b, []byte("\n"))
	return string(l)
}
