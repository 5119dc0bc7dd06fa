package harness

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/peers"
)

// reason classifies a failed connection.
type reason int

const (
	reasonDial      reason = iota // TCP connect failed or timed out
	reasonProxy                   // writing the PROXY header failed
	reasonConnect                 // the CONNECT exchange failed (I/O or a malformed answer)
	reasonStatus                  // the CONNECT answer was not 2xx
	reasonHandshake               // TLS handshake failed (other than verification)
	reasonVerify                  // the server's certificate did not verify for the host
	reasonWrite                   // sending the request failed
	reasonRead                    // reading the answer failed or it was cut short
	reasonRoute                   // the answer came from another shoot's upstream
	reasonStalled                 // still unfinished after stallAfter when the measurement ended
	numReasons
)

var reasonNames = [numReasons]string{"dial", "proxy", "connect", "status", "handshake", "verify", "write", "read", "route", "stalled"}

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
	// proxyHeader and connectRequest are the shoot's preambles, made
	// once: the client shares the CPUs with the data plane under test, so
	// its per-connection work stays at what a connection needs.
	proxyHeader             []byte
	connectRequest          []byte
	connectRequestToUpsPort []byte // naming the upstream's port (PreambleConnectUpstreamPort)
}

// proxySource is the source address in the PROXY headers, of the
// destination's family: a pod address in the shoot, as the apiserver-proxy
// would pass on. No data plane here looks at it.
func proxySource(dst netip.Addr) *net.TCPAddr {
	if dst.Is4() {
		return &net.TCPAddr{IP: net.IPv4(10, 96, 0, 10), Port: 40000}
	}
	return &net.TCPAddr{IP: net.ParseIP("fd00:96::a"), Port: 40000}
}

// client is the load generator's connection code, the same for every target.
type client struct {
	shoots []shootClient
	dialer net.Dialer
	bulk   int64
}

func newClient(p *pki, routes []peers.Route, payload int, bulk int64) *client {
	c := &client{dialer: net.Dialer{Timeout: dialTimeout}, bulk: bulk}
	for i, r := range routes {
		sc := shootClient{
			host: r.Host,
			// No ClientSessionCache: every connection is a full
			// handshake with certificate verification, like a new
			// kubectl process.
			tls:            &tls.Config{ServerName: r.Host, RootCAs: p.pool, MinVersion: tls.VersionTLS12},
			expected:       smallPayload(i, payload),
			connectRequest: connectRequest(r, strconv.Itoa(peers.APIServerPort)),
		}
		if ap, err := netip.ParseAddrPort(r.Upstream); err == nil {
			sc.connectRequestToUpsPort = connectRequest(r, strconv.Itoa(int(ap.Port())))
		}
		if r.Advertised.IsValid() {
			dst := &net.TCPAddr{IP: r.Advertised.AsSlice(), Port: peers.APIServerPort}
			// Made once and written per connection: the same bytes as
			// HeaderProxyFromAddrs(…).WriteTo(conn) each time.
			h, err := proxyproto.HeaderProxyFromAddrs(2, proxySource(r.Advertised), dst).Format()
			if err != nil {
				// Only an unknown version or mismatched address
				// families fail, and neither can happen here.
				panic(fmt.Sprintf("PROXY header for %s: %v", r.Name, err))
			}
			sc.proxyHeader = h
		}
		c.shoots = append(c.shoots, sc)
	}
	return c
}

// errAborted is why connect drops a connection it dialled after the
// worker's slot was aborted (the measurement ended, or the run was cancelled).
var errAborted = errors.New("aborted")

// connect dials t for shoot i, sends t's preamble and completes a verified
// handshake. The caller closes the returned raw connection.
func (c *client) connect(ctx context.Context, t *target, i int, s *inflight.Slot, deadline time.Time) (net.Conn, *tls.Conn, error) {
	raw, err := c.dialer.DialContext(ctx, "tcp", t.addr(i))
	if err != nil {
		return nil, nil, fail(reasonDial, err)
	}
	if !s.Set(raw) {
		raw.Close()
		return nil, nil, fail(reasonDial, errAborted)
	}
	if err := raw.SetDeadline(deadline); err != nil {
		s.Clear()
		raw.Close()
		return nil, nil, fail(reasonDial, err)
	}
	if err := c.sendPreamble(raw, t.preamble, i); err != nil {
		s.Clear()
		raw.Close()
		return nil, nil, err
	}
	tc := tls.Client(raw, c.shoots[i].tls)
	// Handshake, not HandshakeContext: the latter starts a goroutine per
	// connection to watch the context; the deadline and the slot already
	// bound and abort it.
	if err := tc.Handshake(); err != nil {
		s.Clear()
		raw.Close()
		var verr *tls.CertificateVerificationError
		if errors.As(err, &verr) {
			return nil, nil, fail(reasonVerify, err)
		}
		return nil, nil, fail(reasonHandshake, err)
	}
	return raw, tc, nil
}

// connectRequest is the CONNECT request for r's kube-apiserver, with port in
// its target.
func connectRequest(r peers.Route, port string) []byte {
	authority := net.JoinHostPort(r.Host, port)
	return []byte("CONNECT " + authority + " HTTP/1.1\r\nHost: " + authority + "\r\n" +
		peers.GardenerDestinationHeader + ": " + peers.GardenerDestination(r.Name) + "\r\n\r\n")
}

// sendPreamble sends what precedes the TLS handshake for shoot i, and for a
// CONNECT waits for its answer.
func (c *client) sendPreamble(conn net.Conn, p Preamble, i int) error {
	switch p {
	case PreambleProxyV2:
		h := c.shoots[i].proxyHeader
		if h == nil {
			return fail(reasonProxy, fmt.Errorf("shoot %s has no advertised address", c.shoots[i].host))
		}
		if _, err := conn.Write(h); err != nil {
			return fail(reasonProxy, err)
		}
	case PreambleConnect, PreambleConnectUpstreamPort:
		req := c.shoots[i].connectRequest
		if p == PreambleConnectUpstreamPort {
			req = c.shoots[i].connectRequestToUpsPort
		}
		if _, err := conn.Write(req); err != nil {
			return fail(reasonConnect, err)
		}
		return readConnectAnswer(conn)
	}
	return nil
}

// maxConnectAnswer bounds the header of a CONNECT answer: tendril's is 39
// bytes, an error answer with a body a few hundred.
const maxConnectAnswer = 2048

var headerEnd = []byte("\r\n\r\n")

// readConnectAnswer reads the answer to a CONNECT request up to the end of its
// header and returns nil for a 2xx. It reads nothing past a 2xx header: the
// upstream sends nothing before the client's ClientHello, so bytes after the
// header mean a broken data plane, and are an error rather than lost.
func readConnectAnswer(conn net.Conn) error {
	var buf [maxConnectAnswer]byte
	n := 0
	for {
		m, err := conn.Read(buf[n:])
		n += m
		if end := bytes.Index(buf[:n], headerEnd); end >= 0 {
			status := firstLineOf(buf[:end])
			code, ok := statusCode(status)
			switch {
			case !ok:
				return fail(reasonConnect, fmt.Errorf("malformed CONNECT answer %q", status))
			case code < 200 || code > 299:
				return fail(reasonStatus, fmt.Errorf("CONNECT answered %q", strings.TrimSpace(status)))
			case end+len(headerEnd) != n:
				return fail(reasonConnect, fmt.Errorf("%d bytes after the CONNECT answer, before the ClientHello", n-end-len(headerEnd)))
			}
			return nil
		}
		if err != nil {
			if code, ok := statusCode(firstLineOf(buf[:n])); ok && (code < 200 || code > 299) {
				return fail(reasonStatus, fmt.Errorf("CONNECT answered %q, then %w", strings.TrimSpace(firstLineOf(buf[:n])), err))
			}
			return fail(reasonConnect, fmt.Errorf("CONNECT answer after %d bytes: %w", n, err))
		}
		if n == len(buf) {
			return fail(reasonConnect, fmt.Errorf("CONNECT answer header longer than %d bytes", len(buf)))
		}
	}
}

// statusCode returns the code of an HTTP/1.x status line.
func statusCode(line string) (int, bool) {
	rest, ok := strings.CutPrefix(line, "HTTP/1.")
	if !ok || len(rest) < 5 || rest[1] != ' ' {
		return 0, false
	}
	code, err := strconv.Atoi(rest[2:5])
	if err != nil || code < 100 || code > 999 || (len(rest) > 5 && rest[5] != ' ' && rest[5] != '\r') {
		return 0, false
	}
	return code, true
}

// fetchSmall makes one complete small exchange with shoot i through t:
// dial, preamble, verified handshake, request, answer to EOF, close. It returns the
// time from dial start to the first answer byte. buf must hold at least one
// byte more than the answer. If state is not nil, it receives the
// connection's TLS parameters.
func (c *client) fetchSmall(ctx context.Context, t *target, i int, s *inflight.Slot, buf []byte, state *tls.ConnectionState) (time.Duration, error) {
	start := time.Now()
	raw, tc, err := c.connect(ctx, t, i, s, start.Add(connTimeout))
	if err != nil {
		return 0, err
	}
	defer s.Clear()
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

// fetchBulk makes one bulk exchange with shoot i through t and adds every
// byte read to *got as it arrives, so a measurement can read throughput over
// its own window rather than per transfer.
func (c *client) fetchBulk(ctx context.Context, t *target, i int, s *inflight.Slot, buf []byte, got *atomic.Int64) error {
	start := time.Now()
	raw, tc, err := c.connect(ctx, t, i, s, start.Add(connTimeout))
	if err != nil {
		return err
	}
	defer s.Clear()
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
// receives them over xDS just after its listener opens). A static peer's
// refusal of a CONNECT is final. It returns the TLS parameters of the last
// connection.
func (c *client) probe(ctx context.Context, t *target, timeout time.Duration) (tls.ConnectionState, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	buf := make([]byte, len(c.shoots[0].expected)+1)
	var state tls.ConnectionState
	for i := range c.shoots {
		for {
			var s inflight.Slot
			_, err := c.fetchSmall(ctx, t, i, &s, buf, &state)
			if err == nil {
				break
			}
			err = fmt.Errorf("shoot %s through %s: %w", c.shoots[i].host, t.name, err)
			var ce *connError
			if t.static && errors.As(err, &ce) && ce.reason == reasonStatus {
				return state, err
			}
			select {
			case <-ctx.Done():
				return state, err
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
