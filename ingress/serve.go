package ingress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/tendril-net/tendril/ingress/preamble"
	"github.com/tendril-net/tendril/internal/acceptor"
	"github.com/tendril-net/tendril/internal/connect"
	"github.com/tendril-net/tendril/internal/relay"
)

// server serves one listener: an acceptor.Server whose handler runs the listener filters and
// hands each established connection to the relay loops.
type server struct {
	in   *Ingress
	name string
	// acc accepts and tracks the clients' connections in their handshake or dial; it closes
	// them when serve's context ends (no drain of its own: Ingress.drain drains every listener
	// at once).
	acc acceptor.Server
	l   net.Listener
	// loops relay the established connections; pairs holds this listener's, to close them on
	// shutdown, and joined counts them until each has ended.
	loops  *relay.Loops
	pairs  relay.Group
	joined sync.WaitGroup
}

func newServer(in *Ingress, name string, l net.Listener, loops *relay.Loops) *server {
	s := &server{in: in, name: name, l: l, loops: loops}
	// Out of file descriptors and the like: back off rather than spin, as net/http does.
	s.acc = acceptor.Server{Handle: s.handle, RetryAccept: true, Log: in.log.WithValues("listener", name)}
	return s
}

// serve accepts until the listener is closed (stopAccepting) or ctx ends, and returns once the
// connections it accepted have ended. When ctx ends it closes the listener and every connection.
func (s *server) serve(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { s.loops.CloseGroup(&s.pairs) })
	defer stop()
	defer s.joined.Wait()
	return s.acc.Serve(ctx, s.l)
}

// stopAccepting closes the listener: the kernel refuses new connections from now on, and the
// accept loop ends.
func (s *server) stopAccepting() { s.acc.StopAccepting() }

// closeAll closes the listener and every client's connection, in its handshake or relayed, and
// returns how many. From then on the acceptor refuses, and so does the relay for this
// listener's pairs, so a late upstream dial is closed at once.
func (s *server) closeAll() int { return s.acc.CloseAll() + s.loops.CloseGroup(&s.pairs) }

// downstreams reports how many clients' connections are open.
func (s *server) downstreams() int { return s.pairs.Len() + s.acc.Open() }

// Outcomes of a connection, the values of the metrics' outcome label.
const (
	outcomeProxied        = "proxied"
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

// downstream is a client's connection in the ingress's hands: its preamble as read so far, and
// the tracking that holds it until the relay loops take it over.
type downstream struct {
	*preamble.Conn
	conns *acceptor.Conns
}

// handle runs the listener filters (PROXY header, ClientHello; bounded in time and size), picks
// the filter chain, and hands the connection to it.
func (s *server) handle(ctx context.Context, c net.Conn, conns *acceptor.Conns) {
	in := s.in
	lc := in.current.Load().listeners[s.name]
	if lc == nil {
		in.metrics.conn(s.name, "", outcomeNoListener)
		return
	}
	d := &downstream{Conn: preamble.New(c, false), conns: conns}
	d.TrustedPeer = in.trusted(d.Peer.Addr())
	p, victim, outcome := in.pending.admit(s.name, c, d.Peer.Addr())
	if victim != nil {
		s.evict(victim)
	}
	if p == nil {
		s.refuse(d, "", outcome, fmt.Errorf("%d connections of this source are in their handshake", in.cfg.MaxPendingPerSource))
		return
	}
	chain, outcome, err := listenerFilters(lc, d.Conn)
	if chain != nil && chain.http != nil && outcome == "" {
		s.serveConnect(ctx, d, chain.http, p) // still pending while its request arrives
		return
	}
	if !in.pending.release(p) {
		return // evicted meanwhile: closed and counted
	}
	if outcome != "" {
		s.refuse(d, "", outcome, err)
		return
	}
	// The configuration current now picks the route: the listener filters may have taken a
	// while, and a route added meanwhile should be found.
	cfg := in.current.Load()
	clusterName := chain.tcp.defaultCluster
	if chain.tcp.clusterFormat != nil {
		clusterName = chain.tcp.clusterFormat.render(connInfo{serverName: d.ServerName, localAddr: d.Local.String()})
	}
	cl := cfg.clusters[clusterName]
	if cl == nil {
		// The name comes from the client; quoting keeps it from forging log fields.
		s.refuse(d, "", outcomeUnknownRoute, fmt.Errorf("no cluster %q", clusterName))
		return
	}
	up, release, outcome, err := s.dial(ctx, cfg, cl, chain.tcp.connectAttempts)
	if outcome != "" {
		s.refuse(d, cl.name, outcome, err)
		return
	}
	s.join(d, up, release, cl.name, d.Hello, chain.tcp.idleTimeout)
}

// evict closes a pending connection another one displaced, and counts it on its own listener.
func (s *server) evict(victim *pendingConn) {
	victim.c.Close()
	s.in.metrics.conn(victim.listener, "", outcomePendingEvicted)
	s.in.refusals.Info("Connection refused", "listener", victim.listener, "remote", victim.c.RemoteAddr().String(), "reason", outcomePendingEvicted,
		"error", fmt.Sprintf("%q", "the oldest of the pending connections, closed for a new one"))
}

// listenerFilters runs the listener filters and returns the chain, or the outcome that refuses the
// connection.
func listenerFilters(lc *listenerConfig, d *preamble.Conn) (*chainConfig, string, error) {
	f := preamble.Filters{LBProxyProtocol: lc.lbProxyProtocol, ProxyProtocol: lc.proxyProtocol != nil, TLSInspector: lc.tlsInspector, Timeout: lc.filterTimeout}
	if outcome, err := f.Read(d); outcome != "" {
		return nil, outcome, err
	}
	chain := lc.chain(d.Local.Port())
	if chain == nil {
		return nil, outcomeNoChain, fmt.Errorf("no filter chain for destination port %d", d.Local.Port())
	}
	return chain, "", nil
}

// refuse counts and logs (rate-limited) a connection the ingress closes without proxying it.
func (s *server) refuse(d *downstream, cluster, outcome string, err error) {
	s.in.metrics.conn(s.name, cluster, outcome)
	kv := []any{"listener", s.name, "remote", d.C.RemoteAddr().String(), "reason", outcome}
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

// dial connects to an endpoint of cl within the cluster's connect timeout and a slot of its
// circuit breaker, making up to attempts dials, each to the next endpoint in round-robin order
// (as Envoy's tcp_proxy picks a host per attempt). The relay loops dial, so the socket goes to
// the pair as it is. The caller joins or closes the socket and releases the slot. A failure
// reports the last attempt's outcome; every failed attempt is counted.
func (s *server) dial(ctx context.Context, cfg *config, cl *clusterConfig, attempts int) (*relay.Socket, func(), string, error) {
	eps := cfg.upstreams(cl)
	if len(eps) == 0 {
		return nil, nil, outcomeNoEndpoint, nil
	}
	release, ok := s.in.acquire(cl.name, cl.maxConnections)
	if !ok {
		return nil, nil, outcomeCircuitOpen, nil
	}
	var outcome string
	var err error
	for attempt := range max(attempts, 1) {
		if attempt > 0 {
			s.in.metrics.retries.WithLabelValues(s.name, cl.name, outcome).Inc()
			if ctx.Err() != nil {
				break
			}
		}
		ep := eps[cl.next.Add(1)%uint64(len(eps))]
		dctx, cancel := context.WithTimeout(ctx, cl.connectTimeout)
		var up *relay.Socket
		up, err = s.loops.Dial(dctx, ep)
		cancel()
		if err == nil {
			return up, release, "", nil
		}
		outcome = outcomeDialFailed
		if errors.Is(err, context.DeadlineExceeded) {
			outcome = outcomeDialTimeout
		}
	}
	release()
	return nil, nil, outcome, err
}

// join hands the connection and its upstream to the relay loops, with the bytes already read
// from downstream (replay, then whatever the buffered reader holds) to be sent first, and returns
// at once: the pair is no longer tracked by the acceptor but in s.pairs, and s.joined waits for
// it. release
// frees the cluster's circuit-breaker slot when the pair ends.
func (s *server) join(d *downstream, up *relay.Socket, release func(), cluster string, replay []byte, idle time.Duration) {
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
		s.refuse(d, cluster, outcomeRelayFailed, err)
		return
	}
	in.metrics.conn(s.name, cluster, outcomeProxied)
}
