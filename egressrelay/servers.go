package egressrelay

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc/connectivity"
)

// Several tendril-servers (an HA shoot's replicas, Config.Servers): each tunnel goes to the first
// server that answers its dial. kube-apiserver's egress cannot go through the Service: kube-proxy
// spreads connections over every endpoint and keeps a lost node's pod among them until the node
// is marked unreachable, so half of the dials would wait for a server that is gone. The relay
// keeps one pooled connection per server (upstream.go), each reconnected by gRPC with its own
// backoff, and races the servers per tunnel:
//
//   - Order: servers whose connection is READY first, then those connecting or idle, last those
//     whose connection failed or that failed a recent attempt (avoidFor); among equals the start
//     rotates, so that healthy servers share the tunnels.
//   - Race: the first server in that order is tried at once; the next one when an attempt failed
//     or was refused, or when attemptDelay passed without an answer; the first that answers the
//     dial (a stream opened and tendril-server's DIAL_RSP without an error) carries the tunnel,
//     and the attempts still running are cancelled, their streams closed (tendril-server closes
//     what it dialled for them). If every server refused, the tunnel gets the first refusal.
//
// A READY connection says nothing about a server whose node vanished a moment ago: that
// connection stays READY until keepalive gives it up (upstreamKeepalive). The race does not wait
// for it: it waits for the dial's answer, which such a server never sends.
//
// With one server there is no race: its attempt is the tunnel's, as it always was.

// attemptDelay is how long an attempt may go unanswered before the next server is tried too. An
// answer includes tendril-server's dial into the shoot, so the delay must leave room for a dial
// that is merely slow: a shorter one would dial many targets twice (webhooks, kubelets see a
// second connection opened and closed). A longer one would add itself to every tunnel that went
// first to a server that is gone. 250 ms is RFC 8305's recommended connection attempt delay for
// the same trade, and the cost a lost server adds to a tunnel before avoidFor puts it last.
const attemptDelay = 250 * time.Millisecond

// avoidFor is how long a server that failed, or did not answer within attemptDelay while
// another did, is tried last: long enough that a lost server whose connection still looks READY
// delays one tunnel now and then rather than its share of them, until keepalive ends that
// connection; short enough that a server that lost a race only to a slow dial gets its share back
// soon.
const avoidFor = 10 * time.Second

// Outcomes of one attempt on one server, the label of tendril_egress_relay_server_attempts_total.
const (
	attemptAnswered    = "answered"    // the server answered the dial and carries the tunnel
	attemptRefused     = "refused"     // the server answered the dial with an error (the target's or its own)
	attemptUnavailable = "unavailable" // no stream (connection refused, TLS, certificate) or the stream broke before an answer
	attemptTimeout     = "timeout"     // no stream, or no answer, within HandshakeTimeout
	attemptCancelled   = "cancelled"   // another server answered first, or the tunnel ended meanwhile
)

// pool is the relay's connections to its tendril-servers, one upstreams per server in
// Config.Servers order.
type pool struct {
	servers []*upstreams
	certs   *clientTLS
	log     logr.Logger
	metrics *metrics
	next    atomic.Uint32 // rotates the start of the order
}

func newPool(servers []string, handshakeTimeout time.Duration, certs *clientTLS, log logr.Logger, m *metrics) *pool {
	p := &pool{certs: certs, log: log, metrics: m}
	for _, s := range servers {
		p.servers = append(p.servers, &upstreams{server: s, handshakeTimeout: handshakeTimeout, certs: certs})
	}
	return p
}

// connections is the number of connections to tendril-servers the relay holds.
func (p *pool) connections() int {
	n := 0
	for _, u := range p.servers {
		n += u.connections()
	}
	return n
}

// close ends every connection; streams still on them fail. Called once the relay's streams ended.
func (p *pool) close() {
	for _, u := range p.servers {
		u.close()
	}
}

// order returns the servers in the order a new tunnel tries them.
func (p *pool) order() []*upstreams {
	if len(p.servers) == 1 {
		return p.servers
	}
	tlsCfg, err := p.certs.config()
	now := time.Now()
	rank := make(map[*upstreams]int, len(p.servers))
	for _, u := range p.servers {
		st := connectivity.Idle // without certificates the attempt itself fails and says why
		if err == nil {
			st = u.state(tlsCfg)
		}
		// A server that failed is put last for avoidFor only, not until it answers: tried last,
		// it might never get to answer while another does, and the tunnels would not come back
		// to it once it recovered.
		u.mu.Lock()
		avoided := now.Before(u.avoidUntil)
		if st == connectivity.TransientFailure {
			// Put last, it may never be tried while another answers: its failure is logged here.
			p.failingLocked(u, "connection", "its connection failed; gRPC reconnects it with backoff")
		}
		u.mu.Unlock()
		switch {
		case avoided || st == connectivity.TransientFailure || st == connectivity.Shutdown:
			rank[u] = 2
		case st == connectivity.Ready:
			rank[u] = 0
		default: // idle or connecting: not known yet
			rank[u] = 1
		}
	}
	start := int(p.next.Add(1)-1) % len(p.servers) // the first tunnel starts with the first server
	order := append(slices.Clone(p.servers[start:]), p.servers[:start]...)
	slices.SortStableFunc(order, func(a, b *upstreams) int { return cmp.Compare(rank[a], rank[b]) })
	return order
}

// observe records one attempt's outcome for u and logs a change between answering and failing.
// With one server there is nothing to choose and nothing recorded: the tunnels' outcomes are its
// (tendril_egress_relay_connections_total, and Relay.failures logs them).
func (p *pool) observe(u *upstreams, outcome string, err error) {
	if len(p.servers) == 1 {
		return
	}
	p.metrics.attempts.WithLabelValues(u.server, outcome).Inc()
	u.mu.Lock()
	defer u.mu.Unlock()
	switch outcome {
	case attemptAnswered, attemptRefused: // a refusal is an answer: the server is there
		if u.failing {
			p.log.Info("tendril-server answers again", "server", u.server)
		}
		u.failing, u.avoidUntil = false, time.Time{}
	case attemptUnavailable, attemptTimeout:
		p.failingLocked(u, outcome, err.Error())
		u.avoidUntil = time.Now().Add(avoidFor)
	}
}

// failingLocked records that u fails (how: an attempt's outcome, or "connection") and logs it if
// it did not before. u.mu is held.
func (p *pool) failingLocked(u *upstreams, how, why string) {
	if !u.failing {
		p.log.Info("tendril-server failing, tunnels go to the others first (logged again once it answers; "+
			"attempts counted in tendril_egress_relay_server_attempts_total)", "server", u.server, "failed", how, "error", why)
	}
	u.failing = true
}

// slow records that u did not answer within attemptDelay while another server did.
func (p *pool) slow(u *upstreams) {
	u.mu.Lock()
	u.avoidUntil = time.Now().Add(avoidFor)
	u.mu.Unlock()
}

// Stages of an attempt that failed.
const (
	stageOpen = iota // opening the stream
	stageDial        // waiting for tendril-server's answer to the dial
)

// attemptError is why one server's attempt failed.
type attemptError struct {
	server  string
	outcome string // the tunnel's outcome (relay.go) had this been its only attempt
	stage   int
	err     error
}

func (e *attemptError) Error() string { return e.err.Error() }
func (e *attemptError) Unwrap() error { return e.err }

// asAttemptError is err as an *attemptError (every tryFunc returns one; anything else counts as
// the server unavailable), nil for nil.
func asAttemptError(u *upstreams, err error) *attemptError {
	if err == nil {
		return nil
	}
	var ae *attemptError
	if errors.As(err, &ae) {
		return ae
	}
	return &attemptError{server: u.server, outcome: outcomeUnavailable, stage: stageOpen, err: err}
}

// attemptOutcome is the attempt label for a failure.
func (e *attemptError) attemptOutcome() string {
	switch e.outcome {
	case outcomeTimeout:
		return attemptTimeout
	case outcomeShutdown:
		return attemptCancelled
	}
	return attemptUnavailable
}

// failure is why no server carries a tunnel: every attempt's error, by server.
type failure struct {
	attempts []*attemptError
	several  bool // several servers: the message names each
}

func (f *failure) Error() string {
	if !f.several && len(f.attempts) == 1 {
		return f.attempts[0].err.Error()
	}
	parts := make([]string, len(f.attempts))
	for i, a := range f.attempts {
		parts[i] = a.server + ": " + a.err.Error()
	}
	return "no tendril-server answered (" + strings.Join(parts, "; ") + ")"
}

// outcome is the tunnel's outcome: the worst reason among the attempts, in the order shutdown
// (the tunnel or the relay ended), no_certs, unavailable, timeout.
func (f *failure) outcome() string {
	best := outcomeTimeout
	for _, a := range f.attempts {
		switch {
		case a.outcome == outcomeShutdown:
			return outcomeShutdown
		case a.outcome == outcomeNoCerts:
			best = outcomeNoCerts
		case a.outcome == outcomeUnavailable && best != outcomeNoCerts:
			best = outcomeUnavailable
		}
	}
	return best
}

// dialStage returns the first attempt that failed after its stream opened, if any: with one
// server such a failure is the dial's (CONNECT: 502), not the connection's.
func (f *failure) dialStage() *attemptError {
	for _, a := range f.attempts {
		if a.stage == stageDial {
			return a
		}
	}
	return nil
}

// tryFunc is one server's attempt at a tunnel under ctx, which cancel ends (and with it the
// stream). It returns the stream (v) when the server answered; refused when that answer was a
// refusal (v is then still usable: its answer can be relayed); an *attemptError when there was
// no answer, v's stream then released.
type tryFunc[T any] func(ctx context.Context, cancel context.CancelFunc, u *upstreams) (v T, refused error, err error)

// race tries the servers for one tunnel under ctx, as described at the top of this file, and
// returns the answer that carries it: v (refused if every server refused) with the cancel that
// ends its stream, to be called when the tunnel ends. drop releases a v that does not carry the
// tunnel. The error, when no server answered, is a *failure. race returns once every attempt it
// started has ended.
func race[T any](ctx context.Context, p *pool, try tryFunc[T], drop func(T)) (v T, refused error, cancel context.CancelFunc, err error) {
	servers := p.order()
	if len(servers) == 1 { // no race: the one attempt, in this goroutine
		return tryOne(ctx, p, servers[0], try, &failure{several: len(p.servers) > 1})
	}
	r := &racer[T]{ctx: ctx, p: p, try: try, drop: drop, servers: servers, winner: -1, fallback: -1,
		results: make(chan raceResult[T], len(servers)), cancels: make([]context.CancelFunc, len(servers)),
		failed: make([]*attemptError, len(servers))}
	defer r.wg.Wait()
	r.startNext()
	delay := time.NewTimer(attemptDelay)
	defer delay.Stop()
	for r.running > 0 {
		select {
		case <-delay.C:
			if r.winner < 0 {
				r.startNext()
				delay.Reset(attemptDelay)
			}
		case res := <-r.results:
			r.running--
			if r.take(res) {
				// No answer from this one that carries the tunnel (a failure, a refusal): the
				// next server at once.
				r.startNext()
				delay.Reset(attemptDelay)
			} else if r.winner >= 0 {
				delay.Stop()
			}
		}
	}
	switch {
	case r.winner >= 0:
		return r.v, nil, r.cancels[r.winner], nil
	case r.fallback >= 0:
		return r.fallbackV, r.fallbackRefused, r.cancels[r.fallback], nil
	}
	f := &failure{several: len(p.servers) > 1}
	for _, ae := range r.failed {
		if ae != nil {
			f.attempts = append(f.attempts, ae)
		}
	}
	var zero T
	return zero, nil, nil, f
}

// tryOne is race with one server: its attempt is the tunnel's.
func tryOne[T any](ctx context.Context, p *pool, u *upstreams, try tryFunc[T], f *failure) (v T, refused error, cancel context.CancelFunc, err error) {
	actx, acancel := context.WithCancel(ctx)
	v, refused, err = try(actx, acancel, u)
	switch ae := asAttemptError(u, err); {
	case ae != nil:
		p.observe(u, ae.attemptOutcome(), err)
		acancel()
		f.attempts = append(f.attempts, ae)
		var zero T
		return zero, nil, nil, f
	case refused != nil:
		p.observe(u, attemptRefused, nil)
	default:
		p.observe(u, attemptAnswered, nil)
	}
	return v, refused, acancel, nil
}

// raceResult is one attempt's end.
type raceResult[T any] struct {
	i       int
	v       T
	refused error
	err     error
}

// racer is the state of one race over several servers; race owns it, and its attempts'
// goroutines (wg) end before race returns.
type racer[T any] struct {
	ctx     context.Context
	p       *pool
	try     tryFunc[T]
	drop    func(T)
	servers []*upstreams
	results chan raceResult[T]
	cancels []context.CancelFunc
	wg      sync.WaitGroup

	started, running int
	// winner is the attempt whose answer carries the tunnel (v), fallback the first refusal:
	// -1 while there is none.
	winner, fallback int
	v                T
	fallbackV        T
	fallbackRefused  error
	failed           []*attemptError
}

// startNext starts the next server's attempt, if any is left and the tunnel is still wanted.
func (r *racer[T]) startNext() {
	if r.started == len(r.servers) || r.ctx.Err() != nil {
		return
	}
	i := r.started
	actx, acancel := context.WithCancel(r.ctx)
	r.cancels[i] = acancel
	r.started++
	r.running++
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		v, refused, err := r.try(actx, acancel, r.servers[i])
		r.results <- raceResult[T]{i: i, v: v, refused: refused, err: err}
	}()
}

// take records an attempt's end and reports whether the next server is to be tried now.
func (r *racer[T]) take(res raceResult[T]) (next bool) {
	p, u := r.p, r.servers[res.i]
	switch ae := asAttemptError(u, res.err); {
	case r.winner >= 0: // a late one: the tunnel went elsewhere
		if res.err == nil {
			r.drop(res.v)
		}
		r.cancels[res.i]()
		p.observe(u, attemptCancelled, nil)
		return false
	case ae != nil:
		r.cancels[res.i]()
		if r.ctx.Err() != nil {
			p.observe(u, attemptCancelled, nil)
		} else {
			p.observe(u, ae.attemptOutcome(), res.err)
		}
		r.failed[res.i] = ae
		return true
	case res.refused != nil:
		p.observe(u, attemptRefused, nil)
		if r.fallback < 0 {
			r.fallback, r.fallbackV, r.fallbackRefused = res.i, res.v, res.refused
		} else {
			r.drop(res.v)
			r.cancels[res.i]()
		}
		return true
	}
	p.observe(u, attemptAnswered, nil)
	r.win(res.i, res.v)
	return false
}

// win makes attempt i's answer the tunnel's: the others still running end now, the refusal
// kept as a fallback is released, and the servers tried before it that had not answered in
// time are put last for a while.
func (r *racer[T]) win(i int, v T) {
	r.winner, r.v = i, v
	for j := range r.started {
		if j != i && j != r.fallback {
			r.cancels[j]()
		}
	}
	if r.fallback >= 0 {
		r.drop(r.fallbackV)
		r.cancels[r.fallback]()
	}
	for j := range i {
		if r.failed[j] == nil && j != r.fallback {
			r.p.slow(r.servers[j])
		}
	}
	if i > 0 {
		r.p.metrics.failovers.Inc()
	}
}
