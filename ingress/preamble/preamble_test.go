package preamble

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// New and Read read a preamble from a connection with the blocking parsers, as the ingress did
// before its listeners' connections moved to the relay loops: the reference Parse is held to.

// New starts reading c's preamble; trustedPeer says whether its TCP peer is a trusted load
// balancer.
func New(c net.Conn, trustedPeer bool) *Conn {
	peer := addrPort(c.RemoteAddr())
	return &Conn{C: c, r: c, src: c, Peer: peer, Local: addrPort(c.LocalAddr()), Source: peer, TrustedPeer: trustedPeer}
}

// Read runs the filters on d within timeout. A refusal comes as its outcome and an error.
func (f Filters) Read(d *Conn, timeout time.Duration) (string, error) {
	_ = d.C.SetReadDeadline(time.Now().Add(timeout))
	defer d.C.SetReadDeadline(time.Time{})
	return f.read(d)
}

func addrPort(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		ap := ta.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return ap
}

// conn sends b on a loopback connection and returns the server's end.
func conn(t *testing.T, b []byte) net.Conn {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	if _, err := client.Write(b); err != nil {
		t.Fatal(err)
	}
	return server
}

// TestProxyHeaders: an inner PROXY header sets the connection's addresses; a load balancer's
// header is read only from a trusted peer; from anyone else two headers are refused.
func TestProxyHeaders(t *testing.T) {
	inner := testnet.ProxyHeader(t, "10.1.0.5:40000", "10.2.0.1:443")
	outer := testnet.ProxyHeader(t, "192.0.2.7:50000", "198.51.100.1:8443")
	both := append(append([]byte(nil), outer...), inner...)
	f := Filters{LBProxyProtocol: true, ProxyProtocol: true}
	timeout := 5 * time.Second

	d := New(conn(t, both), true)
	if outcome, err := f.Read(d, timeout); outcome != "" {
		t.Fatalf("trusted load balancer's header and an inner one: %s %v", outcome, err)
	}
	if d.Client.String() != "192.0.2.7:50000" || d.Source.String() != "10.1.0.5:40000" || d.Local.String() != "10.2.0.1:443" {
		t.Errorf("client %v source %v local %v", d.Client, d.Source, d.Local)
	}

	d = New(conn(t, both), false)
	if outcome, _ := f.Read(d, timeout); outcome != OutcomeUntrustedProxy {
		t.Errorf("two headers from an untrusted peer: %q, want %s", outcome, OutcomeUntrustedProxy)
	}

	d = New(conn(t, []byte("GET / HTTP/1.1\r\n\r\n")), true)
	if outcome, _ := f.Read(d, timeout); outcome != OutcomeNoProxyHeader {
		t.Errorf("trusted peer without its header: %q, want %s", outcome, OutcomeNoProxyHeader)
	}

	d = New(conn(t, proxyproto.SIGV2[:8]), false) // and then nothing
	timeout = 100 * time.Millisecond
	if outcome, _ := f.Read(d, timeout); outcome != OutcomeProxyTimeout {
		t.Errorf("incomplete header: %q, want %s", outcome, OutcomeProxyTimeout)
	}
}

// TestRequestAfterHeader: a CONNECT request is read after a PROXY header or without one, the
// bytes behind it are the tunnel's, and its headers are bounded either way.
func TestRequestAfterHeader(t *testing.T) {
	const maxHeader = 1024
	request := func(size int) []byte {
		head := "CONNECT x:443 HTTP/1.1\r\nX: "
		return []byte(head + strings.Repeat("a", size-len(head)-4) + "\r\n\r\n")
	}
	inner := testnet.ProxyHeader(t, "10.1.0.5:40000", "10.2.0.1:443")
	for _, prefix := range [][]byte{nil, inner} {
		f := Filters{ProxyProtocol: true}
		d := New(conn(t, append(append(append([]byte(nil), prefix...), request(maxHeader)...), "tunnel"...)), false)
		if outcome, err := f.Read(d, 5*time.Second); outcome != "" {
			t.Fatal(outcome, err)
		}
		if _, r := d.ReadRequest(maxHeader, 5*time.Second); r != nil {
			t.Errorf("header %d bytes: request of %d bytes refused: %+v", len(prefix), maxHeader, r)
		} else if got := d.Buffered(); !bytes.Equal(got, []byte("tunnel")) {
			t.Errorf("header %d bytes: bytes behind the request %q", len(prefix), got)
		}
		// Beyond the limit and the 4 KiB the buffer may already hold.
		d = New(conn(t, append(append([]byte(nil), prefix...), request(maxHeader+2*bufferSize)...)), false)
		if outcome, err := f.Read(d, 5*time.Second); outcome != "" {
			t.Fatal(outcome, err)
		}
		if _, r := d.ReadRequest(maxHeader, 5*time.Second); r == nil || r.Status != 431 {
			t.Errorf("header %d bytes: request of %d bytes: %+v, want 431", len(prefix), maxHeader+2*bufferSize, r)
		}
	}
}

// clientHello returns a real ClientHello for name, as crypto/tls sends it.
func clientHello(t *testing.T, name string) []byte {
	t.Helper()
	a, b := net.Pipe()
	defer b.Close()
	go func() {
		_ = tls.Client(a, &tls.Config{ServerName: name}).Handshake()
		a.Close()
	}()
	buf := make([]byte, 64<<10)
	n, err := b.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return buf[:n]
}

// TestParseAgreesWithReadAtEverySplit: Parse, given the bytes as they may arrive (every prefix),
// asks for more until the filters can decide, and then decides what Read decides on a
// connection; the bytes it relays are the ClientHello and what followed it.
func TestParseAgreesWithReadAtEverySplit(t *testing.T) {
	hello := clientHello(t, "api.s1.example")
	inner := testnet.ProxyHeader(t, "10.1.0.5:40000", "10.2.0.1:443")
	outer := testnet.ProxyHeader(t, "192.0.2.7:50000", "198.51.100.1:8443")
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	tail := []byte("early data")
	peer, local := netip.MustParseAddrPort("127.0.0.1:40000"), netip.MustParseAddrPort("127.0.0.1:8443")
	for _, c := range []struct {
		name    string
		f       Filters
		trusted bool
		in      []byte
	}{
		{"hello", Filters{TLSInspector: true}, false, cat(hello, tail)},
		{"header and hello", Filters{ProxyProtocol: true, TLSInspector: true}, false, cat(inner, hello, tail)},
		{"optional header absent", Filters{ProxyProtocol: true, TLSInspector: true}, false, cat(hello, tail)},
		{"balancer and inner header", Filters{LBProxyProtocol: true, ProxyProtocol: true, TLSInspector: true}, true, cat(outer, inner, hello)},
		{"two headers untrusted", Filters{LBProxyProtocol: true, ProxyProtocol: true, TLSInspector: true}, false, cat(outer, inner, hello)},
		// Without a TLS inspector nothing else needs bytes after the first header: Parse
		// must still wait to see whether a second one follows.
		{"two headers untrusted, request", Filters{LBProxyProtocol: true, ProxyProtocol: true}, false, cat(outer, inner, []byte("CONNECT x:443 HTTP/1.1\r\n\r\n"))},
		{"not TLS", Filters{TLSInspector: true}, false, []byte("GET / HTTP/1.1\r\n\r\n")},
		{"bad header", Filters{ProxyProtocol: true}, false, cat(proxyproto.SIGV2, []byte{0x21, 0x11, 0xff, 0xff}, bytes.Repeat([]byte{0}, 64))},
	} {
		t.Run(c.name, func(t *testing.T) {
			want := New(conn(t, c.in), c.trusted)
			wantOutcome, _ := c.f.Read(want, 5*time.Second)
			decided := -1
			for k := 0; k <= len(c.in); k++ {
				d, more, outcome, err := c.f.Parse(peer, local, c.trusted, c.in[:k], nil)
				if more {
					if decided >= 0 {
						t.Fatalf("%d bytes: more asked for after %d decided", k, decided)
					}
					continue
				}
				if decided < 0 {
					decided = k
				}
				if outcome != wantOutcome {
					t.Fatalf("%d bytes: outcome %q (%v), Read's %q", k, outcome, err, wantOutcome)
				}
				if outcome != "" {
					continue
				}
				fromHeader := want.Source != want.Peer // else the addresses are each connection's own
				if d.ServerName != want.ServerName || d.Client != want.Client || fromHeader && (d.Local != want.Local || d.Source != want.Source) {
					t.Fatalf("%d bytes: learned %q %v %v %v, Read %q %v %v %v", k, d.ServerName, d.Client, d.Source, d.Local, want.ServerName, want.Client, want.Source, want.Local)
				}
				if c.f.TLSInspector && !bytes.Equal(d.First, c.in[k-len(d.First):k]) || !bytes.HasPrefix(d.First, want.Hello) {
					t.Fatalf("%d bytes: first bytes to relay %d, want the ClientHello (%d) and what followed it", k, len(d.First), len(want.Hello))
				}
			}
			if decided < 0 {
				t.Fatal("never decided")
			}
		})
	}
	// At the end of the stream or the filters' time, what is missing is a refusal.
	part := cat(inner, hello[:10])
	f := Filters{ProxyProtocol: true, TLSInspector: true}
	if _, _, outcome, _ := f.Parse(peer, local, false, part, io.EOF); outcome != OutcomeBadHello {
		t.Errorf("truncated hello at EOF: %q, want %s", outcome, OutcomeBadHello)
	}
	if _, _, outcome, _ := f.Parse(peer, local, false, part, os.ErrDeadlineExceeded); outcome != OutcomeHelloTimeout {
		t.Errorf("truncated hello at the deadline: %q, want %s", outcome, OutcomeHelloTimeout)
	}
	if _, _, outcome, _ := f.Parse(peer, local, false, inner[:9], os.ErrDeadlineExceeded); outcome != OutcomeProxyTimeout {
		t.Errorf("truncated header at the deadline: %q, want %s", outcome, OutcomeProxyTimeout)
	}
}

// TestContinueReadsTheRequestAcrossTheParsedBytes: a CONNECT request that Parse's bytes hold a
// part of is read on the connection after Continue, and the bytes behind it are the tunnel's.
func TestContinueReadsTheRequestAcrossTheParsedBytes(t *testing.T) {
	inner := testnet.ProxyHeader(t, "10.1.0.5:40000", "10.2.0.1:443")
	req := []byte("CONNECT x:443 HTTP/1.1\r\nX-A: b\r\n\r\ntunnel")
	for _, prefix := range [][]byte{nil, inner} {
		f := Filters{ProxyProtocol: true}
		parsed := append(append([]byte(nil), prefix...), req[:10]...)
		d, more, outcome, err := f.Parse(netip.MustParseAddrPort("127.0.0.1:1"), netip.MustParseAddrPort("127.0.0.1:2"), false, parsed, nil)
		if more || outcome != "" {
			t.Fatalf("header %d bytes: more %v outcome %q %v", len(prefix), more, outcome, err)
		}
		d.Continue(conn(t, req[10:]))
		r, refusal := d.ReadRequest(1024, 5*time.Second)
		if refusal != nil {
			t.Fatalf("header %d bytes: %+v", len(prefix), refusal)
		}
		if r.Header.Get("X-A") != "b" || string(d.Buffered()) != "tunnel" {
			t.Errorf("header %d bytes: X-A %q, behind the request %q", len(prefix), r.Header.Get("X-A"), d.Buffered())
		}
	}
}

// BenchmarkParseIncomplete is the cost of asking again with a ClientHello that is almost
// complete (16,000 of a 16,389-byte record): what a client trickling its hello makes the loop pay
// per read, on top of the read itself.
func BenchmarkParseIncomplete(b *testing.B) {
	rec := make([]byte, 16000)
	copy(rec, []byte{0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0x00, 0x3f, 0xfc})
	peer, local := netip.MustParseAddrPort("127.0.0.1:1"), netip.MustParseAddrPort("127.0.0.1:2")
	for _, f := range []Filters{{ProxyProtocol: true, TLSInspector: true}, {TLSInspector: true}} {
		b.Run(fmt.Sprintf("proxy=%v", f.ProxyProtocol), func(b *testing.B) {
			for b.Loop() {
				if _, more, _, _ := f.Parse(peer, local, false, rec, nil); !more {
					b.Fatal("decided on an incomplete hello")
				}
			}
		})
	}
}
