package ingress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/loops"
	"github.com/tendril-net/tendril/ingress/preamble"
)

// server serves one listener: the relay loops accept its connections and read their listener
// filters' bytes (a shake each decides where one goes), dial the upstream and relay the pair; a
// connection for an HTTP connection manager (CONNECT) is handed to a goroutine for its request.
type server struct {
	in   *Ingress
	name string
	ln   *loops.Listener
	// loops run the handshakes and relay the established connections; pairs holds this
	// listener's (and its handshakes), to close them on shutdown.
	loops *loops.Loops
	pairs loops.Group
	// handed tracks the connections handed to a goroutine (a CONNECT request); ctx is theirs.
	handed *accept.Conns
	ctx    context.Context
	// joined counts every accepted connection until it has ended: closed in its handshake,
	// relayed to its end, or served by its goroutine.
	joined sync.WaitGroup
	log    logr.Logger
}

func newServer(in *Ingress, name string, l net.Listener, ls *loops.Loops) (*server, error) {
	ln, err := loops.Listen(l, clientKeepAlive)
	if err != nil {
		return nil, fmt.Errorf("listener %s: %w", name, err)
	}
	return &server{in: in, name: name, ln: ln, loops: ls, handed: accept.NewConns(), log: in.log.WithValues("listener", name)}, nil
}

// serve accepts until the listener is closed (stopAccepting) or ctx ends, and returns once the
// connections it accepted have ended. When ctx ends it closes the listener and every connection.
func (s *server) serve(ctx context.Context) error {
	s.ctx = ctx
	stop := context.AfterFunc(ctx, func() { s.closeAll() })
	defer stop()
	defer s.joined.Wait()
	// An accept that failed (out of file descriptors, say) is retried after a pause that grows,
	// as net/http's does, so that the ingress does not spin while the connections it holds go
	// on. Serve accepted in between if it returned only after a while: the pause starts over.
	var pause time.Duration
	for {
		start := time.Now()
		err := s.loops.Serve(&s.pairs, s.ln, s.accepted)
		if err == nil {
			return nil
		}
		if time.Since(start) > time.Second {
			pause = 0
		}
		if !accept.Pause(ctx, s.log, err, &pause) {
			return nil
		}
	}
}

// stopAccepting closes the listener: the kernel refuses new connections from now on, and the
// accept loop ends.
func (s *server) stopAccepting() { _ = s.ln.Close() }

// closeAll closes the listener and every client's connection, in its handshake or relayed, and
// returns how many. From then on the loops refuse this listener's pairs, so a late upstream dial
// is closed at once.
func (s *server) closeAll() int {
	s.stopAccepting()
	return s.handed.CloseAll() + s.loops.CloseGroup(&s.pairs)
}

// downstreams reports how many clients' connections are open.
func (s *server) downstreams() int { return s.pairs.Len() + s.pairs.Handshakes() + s.handed.Len() }

// Outcomes of a connection, the values of the metrics' outcome label.
const (
	outcomeProxied = "proxied"
	// outcomeTerminated: handed to a terminating shoot's proxy (ingress/terminate counts its
	// own refusals).
	outcomeTerminated     = "terminated"
	outcomeNoListener     = "no_listener"
	outcomeNoChain        = "no_filter_chain"
	outcomeBadHello       = preamble.OutcomeBadHello
	outcomeHelloTimeout   = preamble.OutcomeHelloTimeout
	outcomeNotTLS         = preamble.OutcomeNotTLS
	outcomeBadProxyHeader = preamble.OutcomeBadProxyHeader
	outcomeProxyTimeout   = preamble.OutcomeProxyTimeout
	outcomeNoProxyHeader  = preamble.OutcomeNoProxyHeader
	outcomeUntrustedProxy = preamble.OutcomeUntrustedProxy
	outcomeBadRequest     = connect.OutcomeBadRequest
	outcomeRequestTimeout = connect.OutcomeRequestTimeout
	outcomeHeadersTooBig  = connect.OutcomeHeadersTooBig
	outcomeNoRoute        = "no_route"
	outcomeDirectResponse = "direct_response"
	outcomeUnknownRoute   = "unknown_route"
	outcomeNoEndpoint     = "no_endpoint"
	outcomeCircuitOpen    = "circuit_open"
	outcomeDialFailed     = "dial_failed"
	outcomeDialTimeout    = "dial_timeout"
	// outcomeRelayFailed: the upstream was connected, but the pair could not be handed to the
	// relay loops (shutting down, or no descriptor left to duplicate a socket).
	outcomeRelayFailed = "relay_failed"
)

// downstream is a client's connection handed to a goroutine (a CONNECT request): its preamble
// as read so far, and the tracking that holds it until the relay loops take it over.
type downstream struct {
	*preamble.Conn
	conns *accept.Conns
}

// accepted admits a connection the loops accepted to the pending set and gives it a shake, which
// decides on the loop where it goes.
func (s *server) accepted(hs *loops.Handshake) (loops.Handshaker, time.Duration, int) {
	in := s.in
	lc := in.current.Load().listeners[s.name]
	if lc == nil {
		in.metrics.conn(s.name, "", outcomeNoListener)
		return nil, 0, 0
	}
	t := &shake{s: s, hs: hs, lc: lc, trusted: in.trusted(hs.Peer.Addr())}
	p, victim, outcome := in.pending.admit(s.name, hs, hs.Peer.Addr())
	if victim != nil {
		s.evict(victim)
	}
	if p == nil {
		s.refuse(t.conn(), "", outcome, fmt.Errorf("%d connections of this source are in their handshake", in.cfg.MaxPendingPerSource))
		return nil, 0, 0
	}
	t.p = p
	s.joined.Add(1)
	return t, lc.filterTimeout, preamble.MaxBytes
}

// evict closes a pending connection another one displaced, and counts it on its own listener.
func (s *server) evict(victim *pendingConn) {
	victim.c.Close()
	s.in.metrics.conn(victim.listener, "", outcomePendingEvicted)
	s.in.refusals.Info("Connection refused", "listener", victim.listener, "remote", victim.c.RemoteAddr().String(), "reason", outcomePendingEvicted,
		"error", fmt.Sprintf("%q", "the oldest of the pending connections, closed for a new one"))
}

// refuse counts and logs (rate-limited) a connection the ingress closes without proxying it.
func (s *server) refuse(d *preamble.Conn, cluster, outcome string, err error) {
	s.in.metrics.conn(s.name, cluster, outcome)
	kv := []any{"listener", s.name, "remote", d.Peer.String(), "reason", outcome}
	if d.Client.IsValid() {
		kv = append(kv, "client", d.Client.String())
	}
	if d.Source != d.Peer {
		kv = append(kv, "source", d.Source.String())
	}
	if cluster != "" {
		kv = append(kv, "cluster", cluster)
	}
	if err != nil {
		kv = append(kv, "error", fmt.Sprintf("%q", err.Error()))
	}
	s.in.refusals.Info("Connection refused", kv...)
}

// dial connects a CONNECT request's tunnel to an endpoint of cl within the cluster's connect
// timeout and a slot of its circuit breaker, making up to attempts dials (a dialPlan, as the
// loops' handshakes use); a DNS cluster's names are resolved first. The relay loops dial, so the
// socket goes to the pair as it is. The caller joins or closes the socket and releases the slot.
// A failure reports the last attempt's outcome.
func (s *server) dial(ctx context.Context, cfg *config, cl *clusterConfig, attempts int) (*loops.Socket, func(), string, error) {
	eps := cfg.upstreams(cl)
	if len(cl.dns) > 0 {
		var err error
		if eps, err = resolve(ctx, cl); err != nil {
			return nil, nil, outcomeNoEndpoint, err
		}
	}
	p, outcome := s.newDialPlan(cl, eps, attempts)
	if outcome != "" {
		return nil, nil, outcome, nil
	}
	for {
		dctx, cancel := context.WithTimeout(ctx, cl.connectTimeout)
		up, err := s.loops.Dial(dctx, p.next())
		cancel()
		if err == nil {
			return up, p.release, "", nil
		}
		if retry, outcome := p.failed(err, ctx.Err() != nil); !retry {
			return nil, nil, outcome, err
		}
	}
}

// dialPlan is how one connection reaches a cluster, for both ways the ingress dials (the loops'
// handshakes, and the CONNECT listener's goroutines): its endpoints in round-robin order (as
// Envoy's tcp_proxy picks a host per attempt), the attempts allowed, and the cluster's
// circuit-breaker slot, held from the first attempt until the pair ends. Kept by value in a
// handshake: an idle pair holds its shake.
type dialPlan struct {
	s                 *server
	cl                *clusterConfig
	eps               []netip.AddrPort
	attempts, allowed int
	// release frees the slot; nil once freed by failed.
	release func()
}

// newDialPlan takes a slot of cl's circuit breaker for a connection to eps, with up to attempts
// dials (at least one); outcome says why not (no endpoint, the breaker open).
func (s *server) newDialPlan(cl *clusterConfig, eps []netip.AddrPort, attempts int) (dialPlan, string) {
	if len(eps) == 0 {
		return dialPlan{}, outcomeNoEndpoint
	}
	release, ok := s.in.acquire(cl.name, cl.maxConnections)
	if !ok {
		return dialPlan{}, outcomeCircuitOpen
	}
	return dialPlan{s: s, cl: cl, eps: eps, allowed: max(attempts, 1), release: release}, ""
}

// next is the endpoint of the next attempt.
func (p *dialPlan) next() netip.AddrPort {
	p.attempts++
	return p.eps[p.cl.next.Add(1)%uint64(len(p.eps))]
}

// failed takes an attempt's error: retry (the retry counted) while attempts remain and not stop;
// otherwise the slot is released. outcome is the attempt's (dial_failed, dial_timeout).
func (p *dialPlan) failed(err error, stop bool) (retry bool, outcome string) {
	outcome = outcomeDialFailed
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) {
		outcome = outcomeDialTimeout
	}
	if p.attempts < p.allowed && !stop {
		p.s.in.metrics.retries.WithLabelValues(p.s.name, p.cl.name, outcome).Inc()
		return true, outcome
	}
	p.release()
	p.release = nil
	return false, outcome
}

// join hands the connection and its upstream to the relay loops, with the bytes already read
// from downstream (replay, then whatever the buffered reader holds) to be sent first, and returns
// at once: the pair is no longer tracked by the acceptor but in s.pairs, and s.joined waits for
// it. release
// frees the cluster's circuit-breaker slot when the pair ends.
func (s *server) join(d *downstream, up *loops.Socket, release func(), cluster string, replay []byte, idle time.Duration) {
	in := s.in
	replay = append(replay, d.Buffered()...)
	d.conns.Forget(d.C)
	in.metrics.active.WithLabelValues(s.name).Inc()
	s.joined.Add(1)
	err := s.loops.JoinDialed(&s.pairs, d.C, up, replay, idle, func(toUp, toDown int64) {
		in.metrics.bytes.WithLabelValues(s.name, "upstream").Add(float64(toUp))
		in.metrics.bytes.WithLabelValues(s.name, "downstream").Add(float64(toDown))
		in.metrics.active.WithLabelValues(s.name).Dec()
		release()
		s.joined.Done()
	})
	if err != nil {
		// Shutting down (the group is closed), or out of descriptors for the duplicates: both
		// connections are closed already.
		in.metrics.active.WithLabelValues(s.name).Dec()
		release()
		s.joined.Done()
		s.refuse(d.Conn, cluster, outcomeRelayFailed, err)
		return
	}
	in.metrics.conn(s.name, cluster, outcomeProxied)
}

// resolve looks up a DNS cluster's names within its connect timeout: the addresses of all of
// them, in the resolver's order. A name that does not resolve is skipped while another does.
func resolve(ctx context.Context, cl *clusterConfig) ([]netip.AddrPort, error) {
	ctx, cancel := context.WithTimeout(ctx, cl.connectTimeout)
	defer cancel()
	var eps []netip.AddrPort
	var errs []error
	for _, hp := range cl.dns {
		host, p, _ := net.SplitHostPort(hp) // joined by parseAssignment
		port, _ := strconv.ParseUint(p, 10, 16)
		ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			errs = append(errs, fmt.Errorf("resolve %s: %w", host, err))
			continue
		}
		for _, ip := range ips {
			eps = append(eps, netip.AddrPortFrom(ip.Unmap(), uint16(port)))
		}
	}
	if len(eps) == 0 {
		return nil, errors.Join(errs...)
	}
	return eps, nil
}
