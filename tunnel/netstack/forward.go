package netstack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"
)

// Forward terminates TCP connections to destinations that are not the stack's own addresses.
type Forward struct {
	// Prefixes are the destinations that are forwarded (for the agent: the shoot's node, pod
	// and service networks). A connection attempt to any other address that is not the
	// stack's own is reset. Required with Handler.
	Prefixes []netip.Prefix
	// Handler serves each connection attempt to an address inside Prefixes. If nil, nothing
	// is forwarded and packets to other addresses are dropped.
	Handler Handler
	// MaxInFlight bounds the connection attempts between their SYN and the Handler's Accept or
	// Refuse; beyond it a SYN is dropped (counted as RefusedInFlight) and the client's TCP
	// retransmits it after its retransmission timeout (1 s, then 2 s, …). 0 means
	// DefaultMaxInFlight.
	MaxInFlight int
	// UDP, if set (with Handler), serves UDP datagrams to destinations inside Prefixes, one
	// call per flow (the agent: DNS queries to the shoot's resolvers). Without it such
	// datagrams are dropped (DropNotTCP).
	UDP UDPHandler
	// MaxUDPFlows bounds the UDP flows served at once; a datagram that would open one more is
	// dropped (counted as RefusedUDPFlows), and the client retries as after a loss. 0 means
	// DefaultMaxUDPFlows.
	MaxUDPFlows int
}

// Handler serves one forwarded connection attempt in its own goroutine. It should dial the
// real destination first (with a timeout: the attempt holds one of Forward.MaxInFlight until
// then, and the peer's SYN waits unanswered) and then call r.Accept, or r.Refuse if the dial
// failed, so that the peer sees the connection refused (a reset) where the real destination
// refused it. It then copies between the two connections. A Handler that returns without
// either refuses. ctx ends at StopForwarding (which Close calls); the accepted connection is
// reset then too, and StopForwarding waits for every Handler to return, so a Handler must not
// block on anything but ctx and its connections.
type Handler func(ctx context.Context, r *Request)

func (f *Forward) validate() error {
	if f.Handler == nil {
		if len(f.Prefixes) > 0 {
			return errors.New("netstack: config: Forward.Prefixes without a Handler")
		}
		if f.UDP != nil {
			return errors.New("netstack: config: Forward.UDP without a (TCP) Handler")
		}
		return nil
	}
	if len(f.Prefixes) == 0 {
		return errors.New("netstack: config: Forward.Handler without Prefixes would forward nothing")
	}
	for i, p := range f.Prefixes {
		if !p.IsValid() || p.Addr().Zone() != "" {
			return fmt.Errorf("netstack: config: Forward.Prefixes[%d] %q is not a valid prefix", i, p)
		}
		if p.Addr().Is4In6() {
			// Packets carry IPv4 destinations as IPv4; a mapped prefix would match none.
			return fmt.Errorf("netstack: config: Forward.Prefixes[%d] %s: write IPv4 prefixes in IPv4 form", i, p)
		}
	}
	return nil
}

// RefuseReason says why a connection attempt was not forwarded. Each has a counter in
// Stats.Refused.
type RefuseReason int

const (
	// RefusedOutside: the destination is neither an own address nor inside Forward.Prefixes.
	// The peer gets a reset.
	RefusedOutside RefuseReason = iota
	// RefusedLocalPort: the destination is an own address on which nothing listens. The peer
	// gets a reset, as from any stack.
	RefusedLocalPort
	// RefusedInFlight: Forward.MaxInFlight attempts were in flight. The SYN is dropped, not
	// reset: the client retries it.
	RefusedInFlight
	// RefusedByHandler: the Handler called Refuse or returned without Accept. The peer gets a
	// reset.
	RefusedByHandler
	// RefusedHandshake: Accept failed to complete the handshake (the peer reset or went away,
	// or the Stack closed).
	RefusedHandshake
	// RefusedClosed: the Stack was closing (at the SYN or at Accept). The peer gets a reset.
	RefusedClosed
	// RefusedUDPFlows: Forward.MaxUDPFlows UDP flows were open; the datagram is dropped.
	RefusedUDPFlows

	numRefuseReasons
)

func (r RefuseReason) String() string {
	switch r {
	case RefusedOutside:
		return "outside-prefixes"
	case RefusedLocalPort:
		return "local-port-closed"
	case RefusedInFlight:
		return "in-flight-limit"
	case RefusedByHandler:
		return "handler"
	case RefusedHandshake:
		return "handshake"
	case RefusedClosed:
		return "closed"
	case RefusedUDPFlows:
		return "udp-flow-limit"
	}
	return "unknown"
}

// errRequestDone reports a second Accept, or an Accept after Refuse.
var errRequestDone = errors.New("netstack: connection request already accepted or refused")

// forwarder decides on SYNs that reach no endpoint of the stack and runs the Handler for those
// it forwards.
//
// gVisor's tcp.Forwarder starts a goroutine per SYN it takes, without a handle to wait for it.
// To own those goroutines the forwarder keeps its own set of attempts in flight and admits a SYN
// only if gVisor's would too (not a duplicate, below the same limit); an admitted SYN that gVisor
// then reports handled has therefore started a goroutine, which was counted in handlers before it
// existed.
type forwarder struct {
	s        *Stack
	prefixes []netip.Prefix
	handler  Handler
	max      int
	gvisor   *tcp.Forwarder
	udp      *udpForwarder // nil without Forward.UDP

	mu       sync.Mutex
	closed   bool
	inFlight map[stack.TransportEndpointID]struct{}

	done     chan struct{} // closed by stop: the Handlers' contexts end
	stopOnce sync.Once
	// handlers counts each admitted SYN from admission until its Handler returned. Add runs
	// only under mu while !closed, so that stop, once it set closed, waits for every one.
	handlers sync.WaitGroup

	forwarded atomic.Uint64
	active    atomic.Int64
	refused   [numRefuseReasons]atomic.Uint64
}

func newForwarder(s *Stack, cfg Forward) *forwarder {
	f := &forwarder{
		s:        s,
		handler:  cfg.Handler,
		max:      cfg.MaxInFlight,
		inFlight: make(map[stack.TransportEndpointID]struct{}),
		done:     make(chan struct{}),
	}
	if f.max <= 0 {
		f.max = DefaultMaxInFlight
	}
	for _, p := range cfg.Prefixes {
		f.prefixes = append(f.prefixes, p.Masked())
	}
	// The receive window offered in the SYN-ACK: the stack's default receive buffer, as for
	// a connection a listener accepts.
	f.gvisor = tcp.NewForwarder(s.stack, tcpReceiveDefault, f.max, f.routineHandle)
	return f
}

func (f *forwarder) inside(a netip.Addr) bool {
	for _, p := range f.prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// handlePacket is the stack's TCP handler for segments that match no endpoint. It returns
// false for what the stack should answer with a reset (and for anything that is not a SYN,
// which the stack resets as a segment of no connection).
func (f *forwarder) handlePacket(id stack.TransportEndpointID, pkt *stack.PacketBuffer) bool {
	th := header.TCP(pkt.TransportHeader().Slice())
	if len(th) < header.TCPMinimumSize || th.Flags()&(header.TCPFlagSyn|header.TCPFlagAck|header.TCPFlagRst) != header.TCPFlagSyn {
		return false
	}
	dst, _ := netip.AddrFromSlice(id.LocalAddress.AsSlice())
	switch {
	case f.s.isOwn(dst):
		f.refused[RefusedLocalPort].Add(1)
		return false
	case !f.inside(dst):
		f.refused[RefusedOutside].Add(1)
		return false
	}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		f.refused[RefusedClosed].Add(1)
		return false
	}
	if _, dup := f.inFlight[id]; dup {
		// A retransmitted SYN of an attempt the Handler is still on.
		f.mu.Unlock()
		return true
	}
	if len(f.inFlight) >= f.max {
		f.mu.Unlock()
		f.refused[RefusedInFlight].Add(1)
		return true
	}
	f.inFlight[id] = struct{}{}
	f.handlers.Add(1)
	f.mu.Unlock()
	if f.gvisor.HandlePacket(id, pkt) {
		return true // gVisor started routineHandle
	}
	// gVisor found the segment malformed (a bad checksum) and started nothing.
	f.release(id)
	f.handlers.Done()
	return false
}

func (f *forwarder) release(id stack.TransportEndpointID) {
	f.mu.Lock()
	delete(f.inFlight, id)
	f.mu.Unlock()
}

// routineHandle runs the Handler for one admitted SYN, in the goroutine gVisor started.
func (f *forwarder) routineHandle(fr *tcp.ForwarderRequest) {
	defer f.handlers.Done()
	f.active.Add(1)
	defer f.active.Add(-1)
	id := fr.ID()
	r := &Request{f: f, fr: fr, id: id}
	r.src = addrPort(id.RemoteAddress, id.RemotePort)
	r.dst = addrPort(id.LocalAddress, id.LocalPort)
	defer r.finish()
	f.handler(stopContext{f.done}, r)
}

func (f *forwarder) isClosed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.closed
}

// abortEvery is how often stop aborts forwarded endpoints while Handlers are still running.
const abortEvery = 20 * time.Millisecond

// stop refuses SYNs and Accepts from now on, ends the Handlers' contexts, resets every
// forwarded connection, and returns once every Handler has. The stack itself keeps running.
//
// An Accept that passed its closed check just before stop may register its handshake after
// the first round of resets, and a handshake whose peer never answers waits about a minute for
// its SYN-ACK retries; resetting whatever forwarded endpoint is registered until the Handlers
// are done bounds stop instead.
func (f *forwarder) stop() {
	f.stopOnce.Do(func() {
		f.mu.Lock()
		f.closed = true
		f.mu.Unlock()
		close(f.done)
	})
	if f.udp != nil {
		f.udp.closeAll()
	}
	done := make(chan struct{})
	go func() {
		f.handlers.Wait()
		close(done)
	}()
	f.abortForwarded()
	tick := time.NewTicker(abortEvery)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
			f.abortForwarded()
		}
	}
}

// abortForwarded resets every TCP endpoint whose local address is not the stack's own: the
// forwarded connections and their handshakes.
func (f *forwarder) abortForwarded() {
	for _, ep := range f.s.stack.RegisteredEndpoints() {
		e, ok := ep.(interface{ Info() tcpip.EndpointInfo })
		if !ok {
			continue
		}
		info, ok := e.Info().(*stack.TransportEndpointInfo)
		if !ok || info.TransProto != tcp.ProtocolNumber {
			continue
		}
		local, _ := netip.AddrFromSlice(info.ID.LocalAddress.AsSlice())
		if local.IsValid() && !f.s.isOwn(local) {
			ep.Abort()
		}
	}
}

func (f *forwarder) stats(st *Stats) {
	f.mu.Lock()
	st.ForwardInFlight = len(f.inFlight)
	f.mu.Unlock()
	st.Forwarded = f.forwarded.Load()
	st.ForwardActive = int(f.active.Load())
	if f.udp != nil {
		f.udp.stats(st)
	}
	for i := range st.Refused {
		st.Refused[i] = f.refused[i].Load()
	}
}

func addrPort(a tcpip.Address, port uint16) netip.AddrPort {
	ip, _ := netip.AddrFromSlice(a.AsSlice())
	return netip.AddrPortFrom(ip, port)
}

// Request is one forwarded connection attempt, handed to a Handler. It is valid until the
// Handler returns.
type Request struct {
	f        *forwarder
	id       stack.TransportEndpointID
	src, dst netip.AddrPort

	mu   sync.Mutex
	fr   *tcp.ForwarderRequest // nil once accepted or refused
	conn net.Conn              // the accepted connection, closed when the Handler returns
}

// Src is the address the peer connects from (the seed server's inner address).
func (r *Request) Src() netip.AddrPort { return r.src }

// Dst is the destination the peer dialed, inside Forward.Prefixes.
func (r *Request) Dst() netip.AddrPort { return r.dst }

// Accept completes the handshake and returns the connection, a *TCPConn (it can
// CloseWrite). Its LocalAddr is Dst and its RemoteAddr Src. The Stack closes it when the
// Handler returns. It fails if the peer gave up meanwhile or the Stack is closing.
func (r *Request) Accept() (net.Conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fr := r.fr
	if fr == nil {
		return nil, errRequestDone
	}
	r.fr = nil
	if r.f.isClosed() {
		fr.Complete(true)
		r.f.release(r.id)
		r.f.refused[RefusedClosed].Add(1)
		return nil, fmt.Errorf("netstack: accept %s to %s: %w", r.src, r.dst, ErrClosed)
	}
	wq := new(waiter.Queue)
	ep, terr := fr.CreateEndpoint(wq)
	if terr != nil {
		fr.Complete(true)
		r.f.release(r.id)
		r.f.refused[RefusedHandshake].Add(1)
		// tcpip.Error is not a Go error; its text is all there is.
		return nil, fmt.Errorf("netstack: accept %s to %s: %s", r.src, r.dst, terr)
	}
	fr.Complete(false)
	r.f.release(r.id)
	if r.f.isClosed() {
		// stop began during the handshake and may have missed this endpoint.
		ep.Abort()
		r.f.refused[RefusedClosed].Add(1)
		return nil, fmt.Errorf("netstack: accept %s to %s: %w", r.src, r.dst, ErrClosed)
	}
	ep.SocketOptions().SetKeepAlive(true)
	idle := tcpip.KeepaliveIdleOption(forwardKeepaliveIdle)
	interval := tcpip.KeepaliveIntervalOption(forwardKeepaliveInterval)
	_ = ep.SetSockOpt(&idle)
	_ = ep.SetSockOpt(&interval)
	_ = ep.SetSockOptInt(tcpip.KeepaliveCountOption, forwardKeepaliveCount)
	r.conn = newTCPConn(wq, ep)
	r.f.forwarded.Add(1)
	return r.conn, nil
}

// Refuse answers the attempt with a reset, as a closed port would. It does nothing after Accept
// or a first Refuse.
func (r *Request) Refuse() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refuseLocked()
}

func (r *Request) refuseLocked() {
	if r.fr == nil {
		return
	}
	r.fr.Complete(true)
	r.fr = nil
	r.f.release(r.id)
	r.f.refused[RefusedByHandler].Add(1)
}

// finish runs when the Handler returns: an attempt still open is refused, an accepted
// connection closed.
func (r *Request) finish() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refuseLocked()
	if r.conn != nil {
		_ = r.conn.Close()
	}
}

// stopContext is the Handlers' context: done when the Stack closes. It is built on the Stack's
// done channel rather than a context kept in the Stack, since the Stack is not started with one.
type stopContext struct{ done <-chan struct{} }

func (c stopContext) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c stopContext) Done() <-chan struct{}       { return c.done }
func (c stopContext) Value(any) any               { return nil }

func (c stopContext) Err() error {
	select {
	case <-c.done:
		return context.Canceled
	default:
		return nil
	}
}
