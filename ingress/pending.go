package ingress

import (
	"container/list"
	"net"
	"net/netip"
	"sync"

	"github.com/tendril-net/tendril/edge/accept"
)

// Defaults of the pending-connection limits (Config).
const (
	// DefaultMaxPending bounds pending connections across all listeners: ≈ 10,000 × 16 KiB
	// worst-case hello or request buffers = 160 MiB.
	DefaultMaxPending = 10000
	// DefaultMaxPendingPerListener is half the total, so a flood on one listener leaves the other
	// listeners at least 5,000 pending connections between them.
	DefaultMaxPendingPerListener = DefaultMaxPending / 2
	// DefaultMaxPendingPerSource: one address (an IPv6 /64) needs 10 of its kind to reach the
	// total, and 1,000 handshakes in flight at once is far more than a NAT gateway's legitimate
	// clients or a node's apiserver-proxy have (each handshake takes a round trip or two).
	DefaultMaxPendingPerSource = DefaultMaxPending / 10
)

// Outcomes of the pending limits.
const (
	// outcomePendingSource refuses a new connection whose source already holds its limit.
	outcomePendingSource = "pending_source_limit"
	// outcomePendingEvicted closes the oldest pending connection of a listener at its limit (or of
	// the fullest listener at the total limit) to make room for a new one.
	outcomePendingEvicted = "pending_evicted"
)

// pendingSet tracks the connections still in their handshake (PROXY header, ClientHello, CONNECT
// request) and bounds them per source address, per listener and in total.
//
// A source at its limit has its new connections refused: it can only hurt itself. A listener (or
// the whole ingress) at its limit evicts its oldest pending connection instead of refusing the
// new one: a legitimate handshake takes a round trip or two, so the oldest pending connections
// are the slow ones a flood holds open, and a new client is only evicted if a limit's worth of
// connections arrive during its own handshake. Refusing the new connection, as a single counter
// did, let one flood shut every listener for the handshake timeout (10 s).
//
// Memory: the source map holds an entry only while its source has a pending connection, so at
// most maxTotal entries (its bucket array keeps its peak size, which is bounded the same way);
// at ~64 B an entry (a 24-byte netip.Addr key, an int, map overhead) that is 640 KiB at 10,000.
// The per-listener lists hold one element (~48 B) and one pendingConn (~80 B) per pending
// connection: 1.3 MB at 10,000. Both are small next to the connections' own buffers (160 MiB).
type pendingSet struct {
	maxTotal, maxListener, maxSource int
	// trusted reports a peer exempt from the per-source limit: a load balancer carries many
	// clients, whose own addresses are only known once its PROXY header is read.
	trusted func(netip.Addr) bool

	mu        sync.Mutex
	total     int
	listeners map[string]*list.List // of *pendingConn, oldest first
	sources   map[netip.Addr]int
}

// pendingCloser is what the set closes to evict a connection: a loops.Handshake on the loops, or
// the net.Conn a CONNECT request is read from.
type pendingCloser interface {
	Close() error
	RemoteAddr() net.Addr
}

// pendingConn is one connection in its handshake. Its fields are guarded by the set's mutex.
type pendingConn struct {
	c        pendingCloser
	listener string
	source   netip.Addr // the per-source key; invalid when exempt
	elem     *list.Element
	evicted  bool
	released bool
}

func newPendingSet(maxTotal, maxListener, maxSource int, trusted func(netip.Addr) bool) *pendingSet {
	return &pendingSet{
		maxTotal: maxTotal, maxListener: maxListener, maxSource: maxSource, trusted: trusted,
		listeners: map[string]*list.List{}, sources: map[netip.Addr]int{},
	}
}

// admit registers c, accepted on listener from source, as pending. It refuses it (nil and the
// outcome) when its source is at its limit; when a listener or the total is at its limit it
// evicts the oldest pending connection, which the caller closes and counts.
func (p *pendingSet) admit(listener string, c pendingCloser, source netip.Addr) (pc, victim *pendingConn, outcome string) {
	key := netip.Addr{}
	if !p.trusted(source.Unmap()) {
		key = accept.SourceKey(source)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if key.IsValid() && p.sources[key] >= p.maxSource {
		return nil, nil, outcomePendingSource
	}
	l := p.listeners[listener]
	if l == nil {
		l = list.New()
		p.listeners[listener] = l
	}
	switch {
	case l.Len() >= p.maxListener:
		victim = p.oldest(l)
	case p.total >= p.maxTotal:
		var fullest *list.List
		for _, o := range p.listeners {
			if fullest == nil || o.Len() > fullest.Len() {
				fullest = o
			}
		}
		victim = p.oldest(fullest)
	}
	if victim != nil {
		victim.evicted = true
		p.remove(victim)
	}
	pc = &pendingConn{c: c, listener: listener, source: key}
	pc.elem = l.PushBack(pc)
	p.total++
	if key.IsValid() {
		p.sources[key]++
	}
	return pc, victim, ""
}

func (p *pendingSet) oldest(l *list.List) *pendingConn {
	if l == nil || l.Len() == 0 {
		return nil
	}
	return l.Front().Value.(*pendingConn)
}

// remove takes pc out of the set; the caller holds the mutex.
func (p *pendingSet) remove(pc *pendingConn) {
	if pc.released {
		return
	}
	pc.released = true
	p.listeners[pc.listener].Remove(pc.elem)
	p.total--
	if pc.source.IsValid() {
		if n := p.sources[pc.source] - 1; n > 0 {
			p.sources[pc.source] = n
		} else {
			delete(p.sources, pc.source)
		}
	}
}

// release ends pc's handshake. It reports false if pc was evicted meanwhile: its connection is
// closed and already counted, and the caller stops serving it.
func (p *pendingSet) release(pc *pendingConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.remove(pc)
	return !pc.evicted
}

// rebind makes c what evicting pc closes (the connection moved from the loops to a goroutine);
// if pc was evicted meanwhile, it closes c and reports false.
func (p *pendingSet) rebind(pc *pendingConn, c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pc.evicted {
		c.Close()
		return false
	}
	pc.c = c
	return true
}

// count is the number of pending connections.
func (p *pendingSet) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total
}
