package ingress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/tendril-net/tendril/ingress/sni"
)

// server accepts the connections of one listener and owns their goroutines.
type server struct {
	in   *Ingress
	name string
	l    net.Listener

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// serve accepts until ctx ends, then closes the listener and every connection it accepted and
// waits for their goroutines.
func (s *server) serve(ctx context.Context) error {
	s.conns = make(map[net.Conn]struct{})
	stop := context.AfterFunc(ctx, func() {
		s.l.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
	})
	defer stop()
	defer s.wg.Wait()
	var delay time.Duration
	for {
		c, err := s.l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Out of file descriptors and the like: back off rather than spin, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.in.log.Error(err, "Accept failed", "listener", s.name, "retryIn", delay.String())
			select {
			case <-time.After(delay):
				continue
			case <-ctx.Done():
				return nil
			}
		}
		delay = 0
		if !s.track(c) {
			c.Close()
			return nil
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.untrack(c)
			s.handle(ctx, c)
		}()
	}
}

func (s *server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conns == nil {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *server) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	c.Close()
}

// Outcomes of a connection, the values of the metrics' outcome label.
const (
	outcomeProxied        = "proxied"
	outcomeNoListener     = "no_listener"
	outcomeNoChain        = "no_filter_chain"
	outcomeOverloaded     = "overloaded"
	outcomeBadHello       = "bad_client_hello"
	outcomeHelloTimeout   = "client_hello_timeout"
	outcomeNotTLS         = "not_tls"
	outcomeBadProxyHeader = "bad_proxy_header"
	outcomeProxyTimeout   = "proxy_header_timeout"
	outcomeNoProxyHeader  = "missing_proxy_header"
	outcomeBadRequest     = "bad_request"
	outcomeRequestTimeout = "request_timeout"
	outcomeHeadersTooBig  = "request_headers_too_large"
	outcomeNoRoute        = "no_route"
	outcomeDirectResponse = "direct_response"
	outcomeUnknownRoute   = "unknown_route"
	outcomeNoEndpoint     = "no_endpoint"
	outcomeCircuitOpen    = "circuit_open"
	outcomeDialFailed     = "dial_failed"
	outcomeDialTimeout    = "dial_timeout"
)

// maxProxyHeader bounds a PROXY header: go-proxyproto's own v2 limit (MaxV2HeaderSize, 4 KiB)
// plus the 16-byte fixed part; a v1 header is at most 107 bytes.
const maxProxyHeader = 4096 + 16

// downstream is what the listener filters learned about a connection.
type downstream struct {
	c net.Conn
	// r reads the connection's remaining bytes: the connection itself, or a buffered reader
	// that holds bytes read past a PROXY header.
	r io.Reader
	// br is that buffered reader, if one was needed.
	br *bufio.Reader
	// limit bounds the bytes the listener filters and an HTTP request may read.
	limit *io.LimitedReader
	// local and source are the connection's destination and origin, from the PROXY header
	// when there is one.
	local, source netip.AddrPort
	serverName    string
	// hello is the ClientHello, to replay to the upstream.
	hello []byte
}

// handle runs the listener filters (PROXY header, ClientHello; bounded in time and size), picks
// the filter chain, and hands the connection to it.
func (s *server) handle(ctx context.Context, c net.Conn) {
	in := s.in
	lc := in.current.Load().listeners[s.name]
	if lc == nil {
		in.metrics.conn(s.name, "", outcomeNoListener)
		return
	}
	d := &downstream{c: c, r: c, local: addrPort(c.LocalAddr()), source: addrPort(c.RemoteAddr())}
	if in.pending.Add(1) > int64(in.cfg.MaxPending) {
		in.pending.Add(-1)
		s.refuse(d, "", outcomeOverloaded, nil)
		return
	}
	chain, outcome, err := s.filters(lc, d)
	in.pending.Add(-1)
	if outcome != "" {
		s.refuse(d, "", outcome, err)
		return
	}
	if chain.http != nil {
		s.serveConnect(ctx, d, chain.http)
		return
	}
	// The configuration current now picks the route: the listener filters may have taken a
	// while, and a route added meanwhile should be found.
	cfg := in.current.Load()
	clusterName := chain.tcp.defaultCluster
	if chain.tcp.clusterFormat != nil {
		clusterName = chain.tcp.clusterFormat.render(connInfo{serverName: d.serverName, localAddr: d.local.String()})
	}
	cl := cfg.clusters[clusterName]
	if cl == nil {
		// The name comes from the client; quoting keeps it from forging log fields.
		s.refuse(d, "", outcomeUnknownRoute, fmt.Errorf("no cluster %q", clusterName))
		return
	}
	up, release, outcome, err := s.dial(ctx, cfg, cl)
	if outcome != "" {
		s.refuse(d, cl.name, outcome, err)
		return
	}
	defer release()
	defer s.untrack(up)
	s.pipe(d, up, cl.name, d.hello, chain.tcp.idleTimeout)
}

// filters runs the listener filters and returns the chain, or the outcome that refuses the
// connection.
func (s *server) filters(lc *listenerConfig, d *downstream) (*chainConfig, string, error) {
	_ = d.c.SetReadDeadline(time.Now().Add(lc.filterTimeout))
	defer d.c.SetReadDeadline(time.Time{})
	if lc.proxyProtocol != nil {
		d.limit = &io.LimitedReader{R: d.c, N: maxProxyHeader}
		d.br = bufio.NewReaderSize(d.limit, 4096)
		d.r = d.br
		h, err := proxyproto.Read(d.br)
		switch {
		case errors.Is(err, proxyproto.ErrNoProxyProtocol):
			if !lc.proxyProtocol.allowWithout {
				return nil, outcomeNoProxyHeader, err
			}
		case err != nil:
			if isTimeout(err) {
				return nil, outcomeProxyTimeout, err
			}
			return nil, outcomeBadProxyHeader, err
		case h.Command.IsProxy():
			src, dst, ok := h.TCPAddrs()
			if !ok {
				return nil, outcomeBadProxyHeader, fmt.Errorf("PROXY header for %v, want TCP", h.TransportProtocol)
			}
			d.source, d.local = src.AddrPort(), dst.AddrPort()
			d.source = netip.AddrPortFrom(d.source.Addr().Unmap(), d.source.Port())
			d.local = netip.AddrPortFrom(d.local.Addr().Unmap(), d.local.Port())
		}
		// LOCAL (a health check from the sender itself) keeps the connection's own addresses.
	}
	if lc.tlsInspector {
		if d.limit != nil {
			d.limit.N += sni.MaxHelloSize
		}
		name, raw, err := sni.ReadClientHello(d.r)
		if err != nil {
			return nil, helloOutcome(err), err
		}
		d.serverName, d.hello = name, raw
	}
	chain := lc.chain(d.local.Port())
	if chain == nil {
		return nil, outcomeNoChain, fmt.Errorf("no filter chain for destination port %d", d.local.Port())
	}
	return chain, "", nil
}

// refuse counts and logs (rate-limited) a connection the ingress closes without proxying it.
func (s *server) refuse(d *downstream, cluster, outcome string, err error) {
	s.in.metrics.conn(s.name, cluster, outcome)
	kv := []any{"listener", s.name, "remote", d.c.RemoteAddr().String(), "reason", outcome}
	if d.source != addrPort(d.c.RemoteAddr()) {
		kv = append(kv, "source", d.source.String())
	}
	if cluster != "" {
		kv = append(kv, "cluster", cluster)
	}
	if err != nil {
		kv = append(kv, "error", fmt.Sprintf("%q", err.Error()))
	}
	s.in.refusals.log("Connection refused", kv...)
}

// dial connects to an endpoint of cl within the cluster's connect timeout and a slot of its
// circuit breaker. On success the upstream is tracked for shutdown; the caller releases the
// slot and untracks the connection.
func (s *server) dial(ctx context.Context, cfg *config, cl *clusterConfig) (net.Conn, func(), string, error) {
	eps := cfg.upstreams(cl)
	if len(eps) == 0 {
		return nil, nil, outcomeNoEndpoint, nil
	}
	release, ok := s.in.acquire(cl.name, cl.maxConnections)
	if !ok {
		return nil, nil, outcomeCircuitOpen, nil
	}
	ep := eps[cl.next.Add(1)%uint64(len(eps))]
	dctx, cancel := context.WithTimeout(ctx, cl.connectTimeout)
	up, err := (&net.Dialer{}).DialContext(dctx, "tcp", ep.String())
	cancel()
	if err != nil {
		release()
		if errors.Is(err, context.DeadlineExceeded) {
			return nil, nil, outcomeDialTimeout, err
		}
		return nil, nil, outcomeDialFailed, err
	}
	if !s.track(up) {
		release()
		up.Close()
		return nil, nil, outcomeDialFailed, net.ErrClosed
	}
	return up, release, "", nil
}

// pipe sends the bytes already read from downstream (replay, then whatever the buffered
// reader holds) to up, and splices the two connections.
func (s *server) pipe(d *downstream, up net.Conn, cluster string, replay []byte, idle time.Duration) {
	in := s.in
	in.metrics.conn(s.name, cluster, outcomeProxied)
	in.metrics.active.WithLabelValues(s.name).Inc()
	defer in.metrics.active.WithLabelValues(s.name).Dec()
	if d.br != nil && d.br.Buffered() > 0 {
		buffered, _ := d.br.Peek(d.br.Buffered())
		replay = append(replay, buffered...)
	}
	if len(replay) > 0 {
		if _, err := up.Write(replay); err != nil {
			return
		}
		in.metrics.bytes.WithLabelValues(s.name, "upstream").Add(float64(len(replay)))
	}
	splice(d.c, up, idle, func(toUp, toDown int64) {
		in.metrics.bytes.WithLabelValues(s.name, "upstream").Add(float64(toUp))
		in.metrics.bytes.WithLabelValues(s.name, "downstream").Add(float64(toDown))
	})
}

func addrPort(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		ap := ta.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return ap
}

func helloOutcome(err error) string {
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout(), errors.Is(err, os.ErrDeadlineExceeded):
		return outcomeHelloTimeout
	case errors.Is(err, sni.ErrNotTLS):
		return outcomeNotTLS
	default:
		return outcomeBadHello
	}
}

// spliceChunk is how much one splice call may move before the idle deadline is pushed out again:
// large enough that the deadline costs nothing per byte (one syscall per MiB), small enough that
// byte counters move during a long transfer.
const spliceChunk = 1 << 20

// splice copies both directions until both have ended, closing each write side when its read
// side ends (half-close, as tcp_proxy does), and reports the bytes moved each way. Between TCP
// connections io.Copy uses splice(2), so payload never enters user space. A direction idle for
// idle (0: no limit) ends the connection.
func splice(down, up net.Conn, idle time.Duration, count func(toUp, toDown int64)) {
	var wg sync.WaitGroup
	var toUp int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		toUp = copyHalf(up, down, idle)
	}()
	toDown := copyHalf(down, up, idle)
	wg.Wait()
	count(toUp, toDown)
}

// copyHalf copies src to dst and then half-closes dst. A read error other than EOF (a reset, an
// idle timeout) closes both connections, so the other direction ends too.
func copyHalf(dst, src net.Conn, idle time.Duration) int64 {
	var total int64
	for {
		if idle > 0 {
			_ = src.SetReadDeadline(time.Now().Add(idle))
		}
		n, err := io.Copy(dst, io.LimitReader(src, spliceChunk))
		total += n
		if err == nil && n == spliceChunk {
			continue // chunk done, more to come
		}
		if err == nil { // EOF: the peer finished sending
			closeWrite(dst)
			return total
		}
		if isTimeout(err) && n > 0 {
			continue // bytes moved within the window: not idle
		}
		src.Close()
		dst.Close()
		return total
	}
}

func isTimeout(err error) bool {
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
