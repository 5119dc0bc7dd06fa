package preamble

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"
)

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

func header(t *testing.T, src, dst string) []byte {
	t.Helper()
	h := proxyproto.HeaderProxyFromAddrs(2, net.TCPAddrFromAddrPort(netip.MustParseAddrPort(src)), net.TCPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
	b, err := h.Format()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestProxyHeaders: an inner PROXY header sets the connection's addresses; a load balancer's
// header is read only from a trusted peer; from anyone else two headers are refused.
func TestProxyHeaders(t *testing.T) {
	inner := header(t, "10.1.0.5:40000", "10.2.0.1:443")
	outer := header(t, "192.0.2.7:50000", "198.51.100.1:8443")
	both := append(append([]byte(nil), outer...), inner...)
	f := Filters{LBProxyProtocol: true, ProxyProtocol: true, Timeout: 5 * time.Second}

	d := New(conn(t, both), true)
	if outcome, err := f.Read(d); outcome != "" {
		t.Fatalf("trusted load balancer's header and an inner one: %s %v", outcome, err)
	}
	if d.Client.String() != "192.0.2.7:50000" || d.Source.String() != "10.1.0.5:40000" || d.Local.String() != "10.2.0.1:443" {
		t.Errorf("client %v source %v local %v", d.Client, d.Source, d.Local)
	}

	d = New(conn(t, both), false)
	if outcome, _ := f.Read(d); outcome != OutcomeUntrustedProxy {
		t.Errorf("two headers from an untrusted peer: %q, want %s", outcome, OutcomeUntrustedProxy)
	}

	d = New(conn(t, []byte("GET / HTTP/1.1\r\n\r\n")), true)
	if outcome, _ := f.Read(d); outcome != OutcomeNoProxyHeader {
		t.Errorf("trusted peer without its header: %q, want %s", outcome, OutcomeNoProxyHeader)
	}

	d = New(conn(t, proxyproto.SIGV2[:8]), false) // and then nothing
	f.Timeout = 100 * time.Millisecond
	if outcome, _ := f.Read(d); outcome != OutcomeProxyTimeout {
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
	inner := header(t, "10.1.0.5:40000", "10.2.0.1:443")
	for _, prefix := range [][]byte{nil, inner} {
		f := Filters{ProxyProtocol: true, Timeout: 5 * time.Second}
		d := New(conn(t, append(append(append([]byte(nil), prefix...), request(maxHeader)...), "tunnel"...)), false)
		if outcome, err := f.Read(d); outcome != "" {
			t.Fatal(outcome, err)
		}
		if _, r := d.ReadRequest(maxHeader, 5*time.Second); r != nil {
			t.Errorf("header %d bytes: request of %d bytes refused: %+v", len(prefix), maxHeader, r)
		} else if got := d.Buffered(); !bytes.Equal(got, []byte("tunnel")) {
			t.Errorf("header %d bytes: bytes behind the request %q", len(prefix), got)
		}
		// Beyond the limit and the 4 KiB the buffer may already hold.
		d = New(conn(t, append(append([]byte(nil), prefix...), request(maxHeader+2*bufferSize)...)), false)
		if outcome, err := f.Read(d); outcome != "" {
			t.Fatal(outcome, err)
		}
		if _, r := d.ReadRequest(maxHeader, 5*time.Second); r == nil || r.Status != 431 {
			t.Errorf("header %d bytes: request of %d bytes: %+v, want 431", len(prefix), maxHeader+2*bufferSize, r)
		}
	}
}
