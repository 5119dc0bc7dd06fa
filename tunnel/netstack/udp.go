package netstack

import (
	"context"
	"net"
	"net/netip"
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"
)

// DefaultMaxUDPFlows bounds the forwarded UDP flows when Forward.MaxUDPFlows is 0. A flow is a
// gVisor endpoint, the Handler's goroutines and its socket to the real destination; the agent's
// Handler keeps two 64 KiB buffers per flow, so 256 flows cost at most 32 MiB. DNS flows end with
// their answer, so the bound limits queries in flight, not queries per second.
const DefaultMaxUDPFlows = 256

// UDPHandler serves one forwarded UDP flow, the datagrams from one source address and port
// (src, the seed's side) to one destination inside Forward.Prefixes (dst), in its own goroutine.
// c is connected: it receives the flow's datagrams, its first Read returns the datagram that
// opened the flow, and what is written to it goes back to src from dst. The Handler relays to the
// real destination and returns when the flow is over (idle, answered, or ctx ended); the Stack
// then closes c, and the next datagram from src to dst opens a new flow. ctx ends at
// StopForwarding, which also closes every c and waits for every Handler.
type UDPHandler func(ctx context.Context, src, dst netip.AddrPort, c net.Conn)

// udpForwarder admits datagrams that match no endpoint (the first of a flow) and runs the
// UDPHandler for each flow; the flow's later datagrams go to its endpoint directly.
type udpForwarder struct {
	f       *forwarder
	handler UDPHandler
	max     int
	gvisor  *udp.Forwarder

	// conns are the open flows' connections, under f.mu (so that stop, once it set f.closed,
	// finds every one).
	conns map[*gonet.UDPConn]struct{}

	flows atomic.Uint64 // flows opened
}

func newUDPForwarder(f *forwarder, cfg Forward) *udpForwarder {
	u := &udpForwarder{f: f, handler: cfg.UDP, max: cfg.MaxUDPFlows, conns: make(map[*gonet.UDPConn]struct{})}
	if u.max <= 0 {
		u.max = DefaultMaxUDPFlows
	}
	u.gvisor = udp.NewForwarder(f.s.stack, u.open)
	return u
}

// handlePacket is the stack's UDP handler for datagrams that match no endpoint. It returns false
// for what the stack should answer as an unreachable port (the stack's own addresses), true for
// what it handled or dropped.
func (u *udpForwarder) handlePacket(id stack.TransportEndpointID, pkt *stack.PacketBuffer) bool {
	f := u.f
	dst, _ := netip.AddrFromSlice(id.LocalAddress.AsSlice())
	switch {
	case f.s.isOwn(dst):
		return false
	case !f.inside(dst):
		f.refused[RefusedOutside].Add(1)
		return true
	}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		f.refused[RefusedClosed].Add(1)
		return true
	}
	if len(u.conns) >= u.max {
		f.mu.Unlock()
		f.refused[RefusedUDPFlows].Add(1)
		return true
	}
	f.handlers.Add(1)
	f.mu.Unlock()
	// gVisor calls open synchronously, with a clone of the datagram.
	return u.gvisor.HandlePacket(id, pkt)
}

// open creates the flow's endpoint (which takes the first datagram) and starts the Handler.
// handlePacket counted the Handler in f.handlers already.
func (u *udpForwarder) open(r *udp.ForwarderRequest) {
	f := u.f
	wq := new(waiter.Queue)
	ep, terr := r.CreateEndpoint(wq)
	if terr != nil {
		// The pair is in use by an endpoint of the stack's own, or the stack is closing.
		f.refused[RefusedHandshake].Add(1)
		f.handlers.Done()
		return
	}
	c := gonet.NewUDPConn(wq, ep)
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		_ = c.Close()
		f.refused[RefusedClosed].Add(1)
		f.handlers.Done()
		return
	}
	u.conns[c] = struct{}{}
	f.mu.Unlock()
	u.flows.Add(1)
	id := r.ID()
	go u.routineHandle(c, addrPort(id.RemoteAddress, id.RemotePort), addrPort(id.LocalAddress, id.LocalPort))
}

// routineHandle runs the UDPHandler for one flow and closes the flow when it returns.
func (u *udpForwarder) routineHandle(c *gonet.UDPConn, src, dst netip.AddrPort) {
	defer u.f.handlers.Done()
	defer func() {
		u.f.mu.Lock()
		delete(u.conns, c)
		u.f.mu.Unlock()
		_ = c.Close()
	}()
	u.handler(stopContext{u.f.done}, src, dst, c)
}

// closeAll closes every open flow's connection: a Handler blocked reading it returns. Called by
// stop after it set f.closed, so no flow opens afterwards.
func (u *udpForwarder) closeAll() {
	u.f.mu.Lock()
	defer u.f.mu.Unlock()
	for c := range u.conns {
		_ = c.Close()
	}
}

func (u *udpForwarder) stats(st *Stats) {
	u.f.mu.Lock()
	st.UDPFlowsActive = len(u.conns)
	u.f.mu.Unlock()
	st.UDPFlows = u.flows.Load()
}
