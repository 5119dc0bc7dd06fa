// Package testnet holds the small network fixtures tendril's tests share: a loopback listener, a
// serve loop whose handlers the test waits for (and one for datagrams), an echo that passes
// half-closes on, an echo round trip, a loopback TCP connection's two ends, forwarders, an HTTP
// CONNECT proxy, PROXY headers, an address that refuses connections and reserved ports. It is
// imported by tests only and does nothing on its own.
package testnet

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/internal/host/reserve"
)

// Listen returns a new loopback TCP listener, closed when the test ends if nothing closed it
// before.
func Listen(t testing.TB) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// Serve accepts on ln until the test ends and runs handle for each connection, closing it
// afterwards; cleanup closes ln and waits for every handler.
func Serve(t testing.TB, ln net.Listener, handle func(net.Conn)) {
	t.Helper()
	var wg sync.WaitGroup
	acceptEach(ln, &wg, func(c net.Conn) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			handle(c)
		}()
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
}

// acceptEach accepts on ln until it is closed, on a goroutine wg waits for, and passes each
// connection to handle on that goroutine.
func acceptEach(ln net.Listener, wg *sync.WaitGroup, handle func(net.Conn)) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			handle(c)
		}
	}()
}

// Forward relays TCP connections from a new loopback listener until the test ends and returns
// the listener's address. For each connection it accepts, dial opens the upstream (on an error
// the connection is closed) and carry(dst, src) copies one direction, each on a goroutine of
// its own. Cleanup closes the listener and every connection and waits for the goroutines.
func Forward(t testing.TB, dial func() (net.Conn, error), carry func(dst, src net.Conn)) string {
	t.Helper()
	ln := Listen(t)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		conns  []net.Conn
		closed bool
	)
	acceptEach(ln, &wg, func(c net.Conn) {
		up, err := dial()
		if err != nil {
			c.Close()
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if closed {
			c.Close()
			up.Close()
			return
		}
		conns = append(conns, c, up)
		wg.Add(2)
		go func() { defer wg.Done(); carry(up, c) }()
		go func() { defer wg.Done(); carry(c, up) }()
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// ServeUDP answers each datagram that arrives on pc with what answer returns for it, until the
// test ends; cleanup closes pc and waits for the server.
func ServeUDP(t testing.TB, pc net.PacketConn, answer func(datagram []byte) []byte) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(answer(buf[:n]), from)
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
}

// Echo copies everything back and half-closes when the client does.
func Echo(c net.Conn) {
	_, _ = io.Copy(c, c)
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// TCPPair returns both ends of a loopback TCP connection, closed when the test ends.
func TCPPair(t testing.TB) (client, server *net.TCPConn) {
	t.Helper()
	l := Listen(t)
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept() // nil if the listener fails: the dial below fails too
		accepted <- c
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		c.Close()
		t.Fatal("accept failed")
	}
	client, server = c.(*net.TCPConn), s.(*net.TCPConn)
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// EchoServer serves Echo on a new loopback listener until the test ends and returns its address.
func EchoServer(t testing.TB) string {
	t.Helper()
	ln := Listen(t)
	Serve(t, ln, Echo)
	return ln.Addr().String()
}

// RoundTrip sends payload on c, half-closes, and checks that the echo is identical.
func RoundTrip(c net.Conn, payload []byte) error {
	errc := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		if err == nil {
			err = c.(interface{ CloseWrite() error }).CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(c)
	if werr := <-errc; werr != nil {
		return fmt.Errorf("write: %w", werr)
	}
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("echo differs: got %d bytes, want %d identical bytes", len(got), len(payload))
	}
	return nil
}

// Proxy forwards TCP connections from a loopback listener to a target until the test ends.
// Blackhole makes the connections it carries so far stop forwarding without closing: what
// arrives on either side is read and discarded, as on a path that died silently (a proxy or NAT
// that lost its state). Connections accepted afterwards forward normally.
type Proxy struct {
	// Addr is the listener's address.
	Addr string

	accepted atomic.Int64

	mu     sync.Mutex
	holes  []*atomic.Bool
	cut    bool // Cut: new connections are blackholed too
	closed bool
	conns  []net.Conn
}

// NewProxy starts a Proxy to target.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln := Listen(t)
	p := &Proxy{Addr: ln.Addr().String()}
	var wg sync.WaitGroup
	acceptEach(ln, &wg, func(c net.Conn) {
		p.accepted.Add(1)
		up, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			return
		}
		hole := &atomic.Bool{}
		p.mu.Lock()
		hole.Store(p.cut)
		if p.closed {
			p.mu.Unlock()
			c.Close()
			up.Close()
			return
		}
		p.holes = append(p.holes, hole)
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		wg.Add(2)
		go func() { defer wg.Done(); copyUnlessHoled(up, c, hole) }()
		go func() { defer wg.Done(); copyUnlessHoled(c, up, hole) }()
	})
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		p.closed = true
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		wg.Wait()
	})
	return p
}

// Accepted is the number of connections the Proxy has accepted.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Blackhole stops forwarding on every connection accepted so far, without closing any.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range p.holes {
		h.Store(true)
	}
}

// Cut blackholes every connection, those accepted so far and those to come: a path that is gone
// for good (the connections are accepted, nothing passes).
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut = true
	p.mu.Unlock()
	p.Blackhole()
}

// Reset closes every connection accepted so far, as a restarting server or ingress does; new
// connections are accepted as before.
func (p *Proxy) Reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns, p.holes = nil, nil
}

// copyUnlessHoled copies src to dst until either ends, discarding what it reads once hole is
// set; at the end it closes both.
func copyUnlessHoled(dst, src net.Conn, hole *atomic.Bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !hole.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// ConnectProxy serves HTTP CONNECT with net/http, as a real HTTP proxy would, on a new loopback
// listener until the test ends and returns its address. A request ok refuses is answered 503;
// for the others, after the 200, tunnel gets the hijacked connection (closed when it returns)
// and the reader and writer that hold what the client sent after the request.
func ConnectProxy(t testing.TB, ok func(*http.Request) bool, tunnel func(c net.Conn, rw *bufio.ReadWriter)) string {
	t.Helper()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !ok(r) {
			http.Error(w, "no", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
		c, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		tunnel(c, rw)
	})}
	ln := Listen(t)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return ln.Addr().String()
}

// ProxyHeader is the PROXY protocol v2 header of a TCP connection from src to dst (ip:port).
func ProxyHeader(t testing.TB, src, dst string) []byte {
	t.Helper()
	h := proxyproto.HeaderProxyFromAddrs(2, net.TCPAddrFromAddrPort(netip.MustParseAddrPort(src)), net.TCPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
	b, err := h.Format()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// RefusedAddr is a loopback address that refuses connections until the test ends: a TCP socket
// bound to a port the kernel picked and never listening, so a connect gets a reset
// (ECONNREFUSED). Holding the port keeps another process from taking it, which a port that was
// listened on and closed ("a closed port") cannot.
func RefusedAddr(t testing.TB) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}

// Reserve reserves a port on host for a server the test starts that cannot take a listener
// (internal/host/reserve), until the test ends, and returns host:port.
func Reserve(t testing.TB, host string) string {
	t.Helper()
	p, err := reserve.TCP(host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p.Addr
}

// ReservePort is Reserve on 127.0.0.1, returning the port.
func ReservePort(t testing.TB) int {
	t.Helper()
	_, port, _ := net.SplitHostPort(Reserve(t, "127.0.0.1"))
	n, _ := strconv.Atoi(port)
	return n
}
