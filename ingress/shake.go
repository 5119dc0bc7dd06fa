package ingress

import (
	"fmt"
	"net"

	"github.com/tendril-net/tendril/edge/loops"
	"github.com/tendril-net/tendril/ingress/preamble"
	"github.com/tendril-net/tendril/ingress/terminate"
)

// shake decides, on a relay loop, where one accepted connection goes: it runs the listener
// filters over the bytes the loop has read (PROXY headers, ClientHello), picks the filter chain
// and the cluster, and names an endpoint to dial (the next one per attempt), or refuses, or hands
// a CONNECT chain's connection to a goroutine. Its methods run on the loop (loops.Handshaker):
// nothing here blocks. Every path ends the server's joined count for the connection once.
type shake struct {
	s       *server
	hs      *loops.Handshake
	lc      *listenerConfig
	p       *pendingConn
	trusted bool
	// After the filters: what they learned and the chain.
	d     *preamble.Conn
	chain *chainConfig
	// While dialing: the cluster's endpoints, the attempts made, and the circuit-breaker slot
	// the connection holds until its pair ends (plan.release; nil once released).
	plan dialPlan
	// term is the proxy a terminating shoot's connection is handed to, for termCluster, whose
	// circuit-breaker slot (termRelease) it holds until it is closed, as a proxied connection
	// holds its cluster's: a terminating shoot's clients cannot take more of the ingress's
	// connections than a passthrough shoot's.
	term        *terminate.Proxy
	termCluster string
	termRelease func()
}

// releaseTerm frees the terminating connection's slot, once.
func (t *shake) releaseTerm() {
	if t.termRelease != nil {
		t.termRelease()
		t.termRelease = nil
	}
}

// conn is what the refusal log says of the connection: what the filters learned, or its
// addresses before them.
func (t *shake) conn() *preamble.Conn {
	if t.d != nil {
		return t.d
	}
	return &preamble.Conn{Peer: t.hs.Peer, Local: t.hs.Local, Source: t.hs.Peer}
}

// Read runs the filters over what the client sent so far.
func (t *shake) Read(data []byte, end error) loops.Verdict {
	in, lc := t.s.in, t.lc
	d, more, outcome, err := lc.filters().Parse(t.hs.Peer, t.hs.Local, t.trusted, data, end)
	if more {
		return loops.Verdict{Step: loops.StepMore}
	}
	t.d = d
	if outcome == "" {
		if t.chain = lc.chain(d.Local.Port()); t.chain == nil {
			outcome, err = outcomeNoChain, fmt.Errorf("no filter chain for destination port %d", d.Local.Port())
		}
	}
	if outcome == "" && t.chain.http != nil {
		return loops.Verdict{Step: loops.StepHandOff} // still pending while its request arrives
	}
	// The configuration current now picks the route: the listener filters may have taken a
	// while, and a route added meanwhile should be found.
	cfg := in.current.Load()
	var clusterName string
	var cl *clusterConfig
	full := false // the terminating shoot's circuit breaker is open
	if outcome == "" {
		clusterName = t.clusterName()
		cl = cfg.clusters[clusterName]
		// A terminating shoot's server name: its proxy takes the connection (still pending
		// through the TLS handshake, which it ends).
		if cl != nil && cl.internal != "" {
			if t.term = in.terms.get(cl.internal); t.term != nil {
				if release, ok := in.acquire(cl.name, cl.maxConnections); ok {
					t.termCluster, t.termRelease = cl.name, release
					return loops.Verdict{Step: loops.StepHandOff}
				}
				t.term, full = nil, true
			}
		}
	}
	if !in.pending.release(t.p) {
		return t.close() // evicted: counted by the eviction
	}
	if outcome != "" {
		return t.refuse("", outcome, err)
	}
	if cl == nil {
		// The name comes from the client; quoting keeps it from forging log fields.
		return t.refuse("", outcomeUnknownRoute, fmt.Errorf("no cluster %q", clusterName))
	}
	if full {
		return t.refuse(cl.name, outcomeCircuitOpen, nil)
	}
	if cl.internal != "" {
		return t.refuse(cl.name, outcomeNoEndpoint, fmt.Errorf("terminating listener %s is not served yet (its secrets or clusters are missing)", cl.internal))
	}
	if t.plan, outcome = t.s.newDialPlan(cl, cfg.upstreams(cl), t.chain.tcp.connectAttempts); outcome != "" {
		return t.refuse(cl.name, outcome, nil)
	}
	return t.dial()
}

// clusterName is the cluster the chain's tcp_proxy picks for the connection.
func (t *shake) clusterName() string {
	if t.chain.tcp.clusterFormat != nil {
		return t.chain.tcp.clusterFormat.render(connInfo{serverName: t.d.ServerName, localAddr: t.d.Local.String()})
	}
	return t.chain.tcp.defaultCluster
}

// dial names the plan's next endpoint; the loops dial it.
func (t *shake) dial() loops.Verdict {
	return loops.Verdict{Step: loops.StepDial, Addr: t.plan.next(), Timeout: t.plan.cl.connectTimeout,
		First: t.d.First, Idle: t.chain.tcp.idleTimeout, Done: t.done}
}

// DialFailed retries with the next endpoint while the chain allows attempts; a refusal reports
// the last one's outcome.
func (t *shake) DialFailed(err error) loops.Verdict {
	retry, outcome := t.plan.failed(err, false)
	if retry {
		return t.dial()
	}
	return t.refuse(t.plan.cl.name, outcome, err)
}

// Joined counts the connection as proxied; done ends it. The pair holds the shake (its done func)
// for as long as it is open, an idle watch for hours: what the handshake needed (its bytes, the
// filters' findings, the configuration's pieces) is let go here, so it holds a few pointers.
func (t *shake) Joined() {
	m := t.s.in.metrics
	m.active.WithLabelValues(t.s.name).Inc()
	m.conn(t.s.name, t.plan.cl.name, outcomeProxied)
	t.hs, t.lc, t.p, t.d, t.chain, t.plan.eps = nil, nil, nil, nil, nil, nil
}

func (t *shake) done(toUp, toDown int64) {
	m := t.s.in.metrics
	m.bytes.WithLabelValues(t.s.name, "upstream").Add(float64(toUp))
	m.bytes.WithLabelValues(t.s.name, "downstream").Add(float64(toDown))
	m.active.WithLabelValues(t.s.name).Dec()
	t.plan.release()
	t.s.joined.Done()
}

// Closed: the connection was closed in its handshake (evicted, or the ingress shuts down).
func (t *shake) Closed() {
	t.s.in.pending.release(t.p)
	if t.plan.release != nil {
		t.plan.release()
	}
	t.releaseTerm()
	t.s.joined.Done()
}

// HandOff serves a CONNECT chain's request on a goroutine of its own, or gives a terminating
// shoot's connection to its proxy.
func (t *shake) HandOff(c net.Conn, err error) {
	s := t.s
	if err != nil {
		s.in.pending.release(t.p)
		t.releaseTerm()
		s.refuse(t.conn(), t.termCluster, outcomeRelayFailed, err)
		s.joined.Done()
		return
	}
	if t.term != nil {
		t.terminate(c)
		return
	}
	if !s.in.pending.rebind(t.p, c) || !s.handed.Add(c) {
		// Evicted meanwhile (counted there), or shutting down: c is closed.
		s.in.pending.release(t.p)
		s.joined.Done()
		return
	}
	t.d.Continue(c)
	go func() {
		defer s.joined.Done()
		defer func() {
			if s.handed.Forget(c) {
				c.Close()
			}
		}()
		s.serveConnect(s.ctx, &downstream{Conn: t.d, conns: s.handed}, t.chain.http, t.p)
	}()
}

// terminate gives c, its ClientHello replayed, to the shoot's proxy. It stays pending (and
// evictable) until the proxy's TLS handshake ends; it counts as joined until it is closed.
func (t *shake) terminate(c net.Conn) {
	s, p := t.s, t.p
	m := s.in.metrics
	release := t.termRelease
	t.termRelease = nil // from here on rc's close frees the slot
	var rc *replayConn
	// The handed set tracks c itself: a drain's CloseAll closes it under the set's lock, and
	// the proxy then closes rc, which forgets c (rc's Close would take that lock again).
	rc = newReplayConn(c, t.d.First, func() {
		s.handed.Forget(c)
		m.active.WithLabelValues(s.name).Dec()
		release()
		s.joined.Done()
	})
	if !s.in.pending.rebind(p, c) {
		// Evicted meanwhile (counted there): c is closed.
		s.in.pending.release(p)
		release()
		s.joined.Done()
		return
	}
	m.active.WithLabelValues(s.name).Inc()
	if !s.handed.Add(c) {
		// Shutting down: c is closed.
		s.in.pending.release(p)
		rc.Close()
		return
	}
	m.conn(s.name, t.termCluster, outcomeTerminated)
	// Its proxy may have stopped since Read found it: ServeConn then closes rc.
	_ = t.term.ServeConn(rc, func() { s.in.pending.release(p) })
	t.hs, t.lc, t.d, t.chain, t.term = nil, nil, nil, nil, nil
}

// refuse counts and logs a refusal and closes the connection.
func (t *shake) refuse(cluster, outcome string, err error) loops.Verdict {
	t.s.refuse(t.conn(), cluster, outcome, err)
	return t.close()
}

func (t *shake) close() loops.Verdict {
	t.s.joined.Done()
	return loops.Verdict{Step: loops.StepClose}
}

// filters are the listener's filters, for preamble.Parse: its deadline is the loops' (the
// handshake's timeout).
func (lc *listenerConfig) filters() preamble.Filters {
	return preamble.Filters{LBProxyProtocol: lc.lbProxyProtocol, ProxyProtocol: lc.proxyProtocol != nil, TLSInspector: lc.tlsInspector}
}
