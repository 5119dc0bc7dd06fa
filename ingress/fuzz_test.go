package ingress

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/translate"
)

// memConn is a net.Conn that reads from a fixed input; deadlines are accepted and ignored (an
// in-memory read never blocks).
type memConn struct {
	r io.Reader
	net.Conn
}

func (m *memConn) Read(b []byte) (int, error)       { return m.r.Read(b) }
func (m *memConn) Write(b []byte) (int, error)      { return len(b), nil }
func (m *memConn) SetReadDeadline(time.Time) error  { return nil }
func (m *memConn) SetWriteDeadline(time.Time) error { return nil }
func (m *memConn) LocalAddr() net.Addr              { return &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 8443} }
func (m *memConn) RemoteAddr() net.Addr             { return &net.TCPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 50000} }

// FuzzProxyListener feeds arbitrary bytes to the proxy listener's filters (PROXY header) and,
// where they lead to the CONNECT chain, to its request parsing and routing. Invariants: nothing
// panics; a refusal always names its outcome; a PROXY header yields valid addresses; a cluster is
// only ever taken from a header value that passed its route's guard.
func FuzzProxyListener(f *testing.F) {
	lc, err := parseListener(translate.Constant(translate.Options{ProxyProtocol: true, GardenerGateway: translate.HostPort{Host: "gateway", Port: 8443}}).Listeners[1])
	if err != nil {
		f.Fatal(err)
	}
	if lc.name != translate.ProxyListener {
		f.Fatalf("listener %s, want proxy", lc.name)
	}
	var seeds [][]byte
	h := proxyproto.HeaderProxyFromAddrs(2, &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 1234}, &net.TCPAddr{IP: net.IPv4(240, 0, 0, 1), Port: 443})
	v2, _ := h.Format()
	seeds = append(seeds, v2, append(append([]byte{}, v2...), 0x16, 0x03, 0x01))
	h.Version = 1
	v1, _ := h.Format()
	seeds = append(seeds, v1,
		[]byte("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: "+translate.APIServerWireName("shoot--a--b")+"\r\n\r\n"),
		[]byte("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: sni|a\r\n\r\n"),
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		[]byte("CONNECT x:8443 HTTP/1.1\r\nHost: x:8443\r\nX-Gardener-Destination: "+wire.GardenerVPNWireName("shoot--a--b", 1)+"\r\nProxy-Connection: keep-alive\r\n\r\n"),
		append(append([]byte{}, v2...), []byte("CONNECT x:443 HTTP/1.1\r\n\r\n")...),
		append(append([]byte{}, proxyproto.SIGV2...), 0x21, 0x11, 0xff, 0xff),
		[]byte("PROXY TCP4 1.2.3.4 5.6.7.8 1 443\r\n"),
	)
	for _, s := range seeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		// The loops' way: every byte at once, then the end of the stream.
		pd, more, outcome, err := lc.filters().Parse(netip.MustParseAddrPort("10.0.0.2:50000"), netip.MustParseAddrPort("10.0.0.1:8443"), false, in, io.EOF)
		if more {
			t.Fatal("more bytes asked for after the end of the stream")
		}
		if outcome != "" {
			return
		}
		if err != nil {
			t.Fatalf("error without an outcome: %v", err)
		}
		chain := lc.chain(pd.Local.Port())
		if chain == nil {
			return
		}
		pd.Continue(&memConn{r: bytes.NewReader(nil)})
		d := &downstream{Conn: pd}
		if !d.Local.IsValid() || !d.Source.IsValid() {
			t.Fatalf("invalid addresses after the filters: %v → %v", d.Source, d.Local)
		}
		if chain.http == nil {
			if chain.destinationPort != uint32(d.Local.Port()) {
				t.Fatalf("tcp chain for port %d chosen for destination %v", chain.destinationPort, d.Local)
			}
			if got := chain.tcp.clusterFormat.render(connInfo{localAddr: d.Local.String()}); got != translate.ProxyCluster(d.Local.Addr()) && d.Local.Port() == 443 {
				t.Fatalf("cluster %q for destination %v", got, d.Local)
			}
			return
		}
		req, r := readRequest(d, chain.http)
		if r != nil {
			if r.Outcome == "" {
				t.Fatalf("request refused without an outcome: %v", r.Err)
			}
			return
		}
		route := chain.http.match(req)
		if route != nil && route.relayCluster != "" {
			// What goes on to Gardener's gateway is one CONNECT, naming the destination that
			// passed the guard once, and nothing the client smuggled in after it.
			v := req.Header.Values(translate.GardenerDestinationHeader)
			if len(v) != 1 || !route.headers[0].regex.MatchString(v[0]) {
				t.Fatalf("relayed %q past the guard", v)
			}
			out := relayedRequest(req)
			br := bufio.NewReader(bytes.NewReader(out))
			again, err := http.ReadRequest(br)
			if err != nil || again.Method != http.MethodConnect || br.Buffered() != 0 ||
				len(again.Header.Values(translate.GardenerDestinationHeader)) != 1 || again.Header.Get(translate.GardenerDestinationHeader) != v[0] {
				t.Fatalf("relayed request %q does not read back as the one CONNECT (%v)", out, err)
			}
			return
		}
		if route == nil || route.clusterHeader == "" {
			return
		}
		v := req.Header.Get(route.clusterHeader)
		if !route.headers[0].regex.MatchString(v) {
			t.Fatalf("route %s chosen for %s %q that its guard refuses", route.name, route.clusterHeader, v)
		}
		if _, err := netip.ParseAddrPort(v); err == nil || len(v) > 0 && v[0] != 'o' {
			t.Fatalf("a CONNECT header value outside the outbound| name space was routed: %q", v)
		}
	})
}
