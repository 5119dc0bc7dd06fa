// Package preamble is the seed side of PROXY and CONNECT: it reads what a client's connection
// carries ahead of the bytes the ingress relays — the load balancer's PROXY header, the sender's
// own PROXY header (an apiserver-proxy's), the TLS ClientHello, a CONNECT request — each bounded
// in time and size, and says why it refuses one (an outcome, the ingress's metrics label). It
// does not route, dial or count; the ingress does, with what Conn learned.
//
// Memory: a Conn whose listener reads a PROXY header or a request holds a 4 KiB buffered reader
// until the connection is relayed (its unread bytes are replayed to the upstream then); what one
// connection may make it read is bounded by the limits below, whatever the client sends.
package preamble

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/ingress/sni"
)

// Outcomes of a refused preamble, the values of the ingress's outcome label.
const (
	OutcomeBadHello       = "bad_client_hello"
	OutcomeHelloTimeout   = "client_hello_timeout"
	OutcomeNotTLS         = "not_tls"
	OutcomeBadProxyHeader = "bad_proxy_header"
	OutcomeProxyTimeout   = "proxy_header_timeout"
	OutcomeNoProxyHeader  = "missing_proxy_header"
	OutcomeUntrustedProxy = "untrusted_proxy_header"
)

// maxProxyHeader bounds a PROXY header: go-proxyproto's own v2 limit (MaxV2HeaderSize, 4 KiB)
// plus the 16-byte fixed part; a v1 header is at most 107 bytes.
const maxProxyHeader = 4096 + 16

// bufferSize is the buffered reader's: a PROXY v2 header at its largest, or a request's head
// in a few reads.
const bufferSize = 4096

// Conn is a client's connection while its preamble is read, and what was learned of it.
type Conn struct {
	C net.Conn
	// Peer is the TCP peer; Local and Source are the connection's destination and origin, from
	// the PROXY header when there is one.
	Peer, Local, Source netip.AddrPort
	// TrustedPeer: the TCP peer is a load balancer whose own PROXY header is believed.
	TrustedPeer bool
	// Client is the origin the load balancer's header reported, if there was one.
	Client netip.AddrPort
	// ServerName and Hello are the ClientHello's server name and bytes (to replay upstream).
	ServerName string
	Hello      []byte
	// First is, after Parse, what the upstream is sent first: the ClientHello and what the
	// client sent after it. parsed is what it sent after the filters' bytes.
	First  []byte
	parsed []byte

	// r reads the connection's remaining bytes: src, or br, which holds bytes read past a PROXY
	// header. limit bounds what the filters and a request may read. src is the connection, or
	// what Parse was given, or (after Continue) prefix and then the connection.
	r      io.Reader
	br     *bufio.Reader
	limit  *io.LimitedReader
	src    io.Reader
	prefix *bytes.Reader
}

// Filters are a listener's filters, read in this order.
type Filters struct {
	// LBProxyProtocol: the load balancer's own PROXY header comes first on every connection;
	// it is read only from a trusted peer (from anyone else its place is the inner header's).
	LBProxyProtocol bool
	// ProxyProtocol: the sender's own PROXY header may come next (optional).
	ProxyProtocol bool
	// TLSInspector: the ClientHello comes next; its server name is read.
	TLSInspector bool
}

// read runs the filters on what d.r reads.
func (f Filters) read(d *Conn) (string, error) {
	if f.LBProxyProtocol || f.ProxyProtocol {
		d.buffer()
	}
	if f.LBProxyProtocol && d.TrustedPeer {
		h, outcome, err := d.readProxyHeader(false)
		if outcome != "" {
			return outcome, err
		}
		if h != nil {
			d.Client = d.Source
		}
	}
	if f.ProxyProtocol {
		h, outcome, err := d.readProxyHeader(true)
		if outcome != "" {
			return outcome, err
		}
		if h != nil && f.LBProxyProtocol && !d.TrustedPeer {
			// Only a load balancer may put its header in front of another one; from anyone
			// else a second header is an attempt to choose both addresses.
			var h2 *proxyproto.Header
			d.withHeaderAllowance(func() {
				if next, _ := d.br.Peek(1); len(next) == 1 && (next[0] == proxyproto.SIGV1[0] || next[0] == proxyproto.SIGV2[0]) {
					h2, _ = proxyproto.Read(d.br)
				}
			})
			if h2 != nil {
				return OutcomeUntrustedProxy, fmt.Errorf("two PROXY headers from %v, which is not a trusted proxy", d.Peer)
			}
		}
	}
	if f.TLSInspector {
		if d.limit != nil {
			d.limit.N += sni.MaxHelloSize
		}
		name, raw, err := sni.ReadClientHello(d.r)
		if err != nil {
			return helloOutcome(err), err
		}
		d.ServerName, d.Hello = name, raw
	}
	return "", nil
}

// ReadRequest reads one request (a CONNECT) after the filters: its line and headers may use up to
// maxHeader more bytes of the limit the filters used, within timeout; the tunnel's bytes are
// spliced from the connection itself, past it.
func (d *Conn) ReadRequest(maxHeader int, timeout time.Duration) (*http.Request, *connect.Refusal) {
	d.buffer()
	return connect.ReadRequest(d.C, d.br, d.limit, maxHeader, timeout)
}

// Buffered returns the bytes read past the preamble: the relayed stream's first, to be sent
// upstream after anything replayed.
func (d *Conn) Buffered() []byte {
	var b []byte
	if d.br != nil && d.br.Buffered() > 0 {
		b, _ = d.br.Peek(d.br.Buffered())
	}
	if d.prefix != nil && d.prefix.Len() > 0 {
		rest := make([]byte, d.prefix.Len())
		_, _ = d.prefix.Read(rest)
		b = append(b[:len(b):len(b)], rest...)
	}
	return b
}

// buffer reads the connection through a limit and a buffered reader from now on.
func (d *Conn) buffer() {
	if d.limit == nil {
		d.limit = &io.LimitedReader{R: d.src}
		d.br = bufio.NewReaderSize(d.limit, bufferSize)
		d.r = d.br
	}
}

// withHeaderAllowance runs read, which reads from d.br, with maxProxyHeader more bytes allowed,
// and then leaves the limit raised by exactly the bytes read consumed (bytes it only peeked at
// stay buffered and count against what follows). The bytes read past a header thus count
// against what follows, so a CONNECT request stops at the same limit with or without a PROXY
// header, on every listener.
func (d *Conn) withHeaderAllowance(read func()) {
	d.limit.N += maxProxyHeader
	before := d.limit.N + int64(d.br.Buffered())
	read()
	consumed := before - d.limit.N - int64(d.br.Buffered())
	d.limit.N += consumed - maxProxyHeader
}

// readProxyHeader reads one PROXY header (optional when allowWithout) and makes its addresses
// the connection's. A LOCAL header (the sender's own health check) keeps the connection's.
func (d *Conn) readProxyHeader(allowWithout bool) (*proxyproto.Header, string, error) {
	var h *proxyproto.Header
	var err error
	d.withHeaderAllowance(func() { h, err = proxyproto.Read(d.br) })
	switch {
	case errors.Is(err, proxyproto.ErrNoProxyProtocol):
		if !allowWithout {
			return nil, OutcomeNoProxyHeader, err
		}
		return nil, "", nil
	case err != nil:
		if pipe.IsTimeout(err) {
			return nil, OutcomeProxyTimeout, err
		}
		return nil, OutcomeBadProxyHeader, err
	case !h.Command.IsProxy():
		return h, "", nil
	}
	src, dst, ok := h.TCPAddrs()
	if !ok {
		return nil, OutcomeBadProxyHeader, fmt.Errorf("PROXY header for %v, want TCP", h.TransportProtocol)
	}
	d.Source = netip.AddrPortFrom(src.AddrPort().Addr().Unmap(), src.AddrPort().Port())
	d.Local = netip.AddrPortFrom(dst.AddrPort().Addr().Unmap(), dst.AddrPort().Port())
	return h, "", nil
}

func helloOutcome(err error) string {
	switch {
	case pipe.IsTimeout(err): // os.ErrDeadlineExceeded is a net.Error that times out
		return OutcomeHelloTimeout
	case errors.Is(err, sni.ErrNotTLS):
		return OutcomeNotTLS
	default:
		return OutcomeBadHello
	}
}

// MaxBytes bounds what the filters read of a connection: two PROXY headers and a ClientHello at
// their largest, (4,096 + 16) × 2 + 16,389 = 24,613 bytes. A client that sends that much
// without completing them has been refused by one of their own limits already.
const MaxBytes = 2*maxProxyHeader + sni.MaxHelloSize

// errMore ends the bytes Parse was given while more may come.
var errMore = errors.New("more bytes needed")

// Parse runs the filters on data, what a connection from peer to local has sent so far, without
// waiting: end says why nothing more will come (nil while more may; io.EOF; a read error;
// os.ErrDeadlineExceeded once the filters' time is up, which Parse reports as their timeout).
// more reports that the filters need more bytes than data holds (with end nil only). Otherwise
// the refusal comes as its outcome and an error, or Conn holds what the filters learned and
// First the part of data the upstream is to be sent (the ClientHello and what followed it; the
// PROXY headers are not relayed). It is called again with all the bytes when more arrive: the
// filters' few hundred bytes are cheaper to parse again than to hold a parser's state.
func (f Filters) Parse(peer, local netip.AddrPort, trustedPeer bool, data []byte, end error) (d *Conn, more bool, outcome string, err error) {
	if end == nil && f.TLSInspector && !f.LBProxyProtocol && !f.ProxyProtocol && incompleteRecord(data) {
		// A client that sends its ClientHello a few bytes at a time is answered without a
		// parse per read: its first record's header says how much is still to come.
		return nil, true, "", nil
	}
	in := &bytesThen{data: data, end: end}
	d = &Conn{r: in, src: in, Peer: peer, Local: local, Source: peer, TrustedPeer: trustedPeer}
	outcome, err = f.read(d)
	if in.starved && end == nil {
		// Even a success: a filter that looked past its own bytes (is a second PROXY header
		// next?) decides again with them.
		return nil, true, "", nil
	}
	if outcome != "" {
		return d, false, outcome, err
	}
	consumed := in.off
	if d.br != nil {
		consumed -= d.br.Buffered()
	}
	d.First = data[consumed-len(d.Hello):]
	d.parsed = data[consumed:]
	return d, false, "", nil
}

// Continue goes on reading the connection on c, after Parse: the bytes Parse was given past the
// filters are read first.
func (d *Conn) Continue(c net.Conn) {
	d.C = c
	d.prefix = bytes.NewReader(d.parsed)
	d.src = io.MultiReader(d.prefix, c)
	d.r = d.src
	if d.limit != nil {
		// What br held was counted against the limit when it was read; it is read again.
		d.limit = &io.LimitedReader{R: d.src, N: d.limit.N + int64(d.br.Buffered())}
		d.br = bufio.NewReaderSize(d.limit, bufferSize)
		d.r = d.br
	}
}

// incompleteRecord reports whether data is the start of a TLS handshake record that has not all
// arrived (5-byte header: type 22, version, 16-bit length).
func incompleteRecord(data []byte) bool {
	return len(data) >= 5 && data[0] == 22 && len(data) < 5+int(data[3])<<8|int(data[4])
}

// bytesThen reads data, and then returns end, or errMore while end is nil.
type bytesThen struct {
	data    []byte
	off     int
	end     error
	starved bool
}

func (r *bytesThen) Read(p []byte) (int, error) {
	if r.off >= len(r.data) {
		r.starved = true
		if r.end != nil {
			return 0, r.end
		}
		return 0, errMore
	}
	n := copy(p, r.data[r.off:])
	r.off += n
	return n, nil
}
