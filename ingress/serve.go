package ingress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

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
	outcomeProxied      = "proxied"
	outcomeNoListener   = "no_listener"
	outcomeOverloaded   = "overloaded"
	outcomeBadHello     = "bad_client_hello"
	outcomeHelloTimeout = "client_hello_timeout"
	outcomeNotTLS       = "not_tls"
	outcomeUnknownRoute = "unknown_route"
	outcomeNoEndpoint   = "no_endpoint"
	outcomeCircuitOpen  = "circuit_open"
	outcomeDialFailed   = "dial_failed"
	outcomeDialTimeout  = "dial_timeout"
)

// handle routes one connection: read the ClientHello (bounded in time and size), render the
// cluster name, dial an endpoint, replay the hello and splice.
func (s *server) handle(ctx context.Context, c net.Conn) {
	in := s.in
	cfg := in.current.Load()
	lc := cfg.listeners[s.name]
	if lc == nil {
		in.metrics.conn(s.name, "", outcomeNoListener)
		return
	}
	var ci connInfo
	var hello []byte
	if lc.tlsInspector {
		if in.pending.Add(1) > int64(in.cfg.MaxPending) {
			in.pending.Add(-1)
			in.metrics.conn(s.name, "", outcomeOverloaded)
			in.refusals.log("Connection refused", "listener", s.name, "remote", c.RemoteAddr().String(), "reason", outcomeOverloaded)
			return
		}
		_ = c.SetReadDeadline(time.Now().Add(lc.helloTimeout))
		name, raw, err := sni.ReadClientHello(c)
		in.pending.Add(-1)
		if err != nil {
			reason := helloOutcome(err)
			in.metrics.conn(s.name, "", reason)
			in.refusals.log("Connection refused", "listener", s.name, "remote", c.RemoteAddr().String(), "reason", reason, "error", err.Error())
			return
		}
		_ = c.SetReadDeadline(time.Time{})
		ci.serverName, hello = name, raw
		// The hello may have been read from a newer configuration's point of view: take the
		// configuration current now, when the route is chosen.
		cfg = in.current.Load()
		if lc = cfg.listeners[s.name]; lc == nil {
			in.metrics.conn(s.name, "", outcomeNoListener)
			return
		}
	}
	ci.localAddr = c.LocalAddr().String()

	clusterName := lc.defaultCluster
	if lc.clusterFormat != nil {
		clusterName = lc.clusterFormat.render(ci)
	}
	cl := cfg.clusters[clusterName]
	if cl == nil {
		in.metrics.conn(s.name, "", outcomeUnknownRoute)
		// The server name is the client's; quote it so that it cannot forge log fields.
		in.refusals.log("Connection refused", "listener", s.name, "remote", c.RemoteAddr().String(), "reason", outcomeUnknownRoute, "cluster", fmt.Sprintf("%q", clusterName))
		return
	}
	eps := cfg.upstreams(cl)
	if len(eps) == 0 {
		in.metrics.conn(s.name, cl.name, outcomeNoEndpoint)
		in.refusals.log("Connection refused", "listener", s.name, "remote", c.RemoteAddr().String(), "reason", outcomeNoEndpoint, "cluster", cl.name)
		return
	}
	release, ok := in.acquire(cl.name, cl.maxConnections)
	if !ok {
		in.metrics.conn(s.name, cl.name, outcomeCircuitOpen)
		in.refusals.log("Connection refused", "listener", s.name, "remote", c.RemoteAddr().String(), "reason", outcomeCircuitOpen, "cluster", cl.name)
		return
	}
	defer release()
	ep := eps[cl.next.Add(1)%uint64(len(eps))]

	dctx, cancel := context.WithTimeout(ctx, cl.connectTimeout)
	up, err := (&net.Dialer{}).DialContext(dctx, "tcp", ep.String())
	cancel()
	if err != nil {
		reason := outcomeDialFailed
		if errors.Is(err, context.DeadlineExceeded) {
			reason = outcomeDialTimeout
		}
		in.metrics.conn(s.name, cl.name, reason)
		in.refusals.log("Upstream dial failed", "listener", s.name, "cluster", cl.name, "endpoint", ep.String(), "error", err.Error())
		return
	}
	s.mu.Lock()
	if s.conns == nil || ctx.Err() != nil {
		s.mu.Unlock()
		up.Close()
		return
	}
	s.conns[up] = struct{}{}
	s.mu.Unlock()
	defer s.untrack(up)

	in.metrics.conn(s.name, cl.name, outcomeProxied)
	in.metrics.active.WithLabelValues(s.name).Inc()
	defer in.metrics.active.WithLabelValues(s.name).Dec()
	if len(hello) > 0 {
		if _, err := up.Write(hello); err != nil {
			return
		}
		in.metrics.bytes.WithLabelValues(s.name, "upstream").Add(float64(len(hello)))
	}
	splice(c, up, lc.idleTimeout, func(toUp, toDown int64) {
		in.metrics.bytes.WithLabelValues(s.name, "upstream").Add(float64(toUp))
		in.metrics.bytes.WithLabelValues(s.name, "downstream").Add(float64(toDown))
	})
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
