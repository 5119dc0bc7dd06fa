package netstack

import (
	"sync"
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// link is the stack's NIC: outbound packets wait in a bounded queue for Stack.Read, inbound
// packets from Stack.Write go straight to the stack's dispatcher. It replaces gVisor's
// link/channel, whose reader needs a context to wait and which clones every packet it queues.
type link struct {
	mtu     uint32
	queue   chan *stack.PacketBuffer // outbound; each entry holds one reference
	dropped *atomic.Uint64           // packets refused because queue was full

	mu         sync.RWMutex
	dispatcher stack.NetworkDispatcher
}

var _ stack.LinkEndpoint = (*link)(nil)

func newLink(mtu uint32, queueLen int, dropped *atomic.Uint64) *link {
	return &link{mtu: mtu, queue: make(chan *stack.PacketBuffer, queueLen), dropped: dropped}
}

// headerSplit is where deliver cuts an inbound packet into two buffers: past the largest IPv4
// or IPv6 header plus TCP header that matter here (60 + 60 or 40 + 60 bytes). gVisor's IPv6
// (and IPv4) input takes a second reference to the packet's buffers and then reads the headers
// through PullUp, which copies a buffer it finds shared: with the headers in a buffer of their
// own it copies 128 bytes instead of the whole packet (at MTU 60,000, a 64 KiB buffer zeroed
// and filled again for every packet).
const headerSplit = 128

// deliver copies an inbound packet into pooled gVisor buffers (headers and payload apart, see
// headerSplit) and hands it to the stack. The stack takes its own references to whatever it
// keeps, so ours is released at once and the buffers return to gVisor's pool when the stack is
// done with them.
func (l *link) deliver(pn tcpip.NetworkProtocolNumber, packet []byte) {
	l.mu.RLock()
	d := l.dispatcher
	l.mu.RUnlock()
	if d == nil {
		return
	}
	var payload buffer.Buffer
	if len(packet) > headerSplit {
		payload = buffer.MakeWithView(buffer.NewViewWithData(packet[:headerSplit]))
		_ = payload.Append(buffer.NewViewWithData(packet[headerSplit:])) // fails only for a nil view
	} else {
		payload = buffer.MakeWithData(packet)
	}
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: payload})
	d.DeliverNetworkPacket(pn, pkt)
	pkt.DecRef()
}

// drain releases the packets still queued (after the stack stopped sending).
func (l *link) drain() {
	for {
		select {
		case pkt := <-l.queue:
			pkt.DecRef()
		default:
			return
		}
	}
}

// WritePackets queues the stack's outbound packets for Stack.Read, taking a reference to each
// (the caller keeps and releases its own, as with gVisor's fifo queueing discipline). A full
// queue drops the rest of the list (counted); TCP retransmits them as after a loss on a wire.
func (l *link) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	n := 0
	for _, pkt := range pkts.AsSlice() {
		select {
		case l.queue <- pkt.IncRef():
			n++
		default:
			l.dropped.Add(uint64(pkts.Len() - n))
			if n == 0 {
				return 0, &tcpip.ErrNoBufferSpace{}
			}
			return n, nil
		}
	}
	return n, nil
}

// MTU implements stack.LinkEndpoint.
func (l *link) MTU() uint32 { return l.mtu }

// SetMTU implements stack.LinkEndpoint; the MTU is fixed by Config (WireGuard reads it once).
func (l *link) SetMTU(uint32) {}

// MaxHeaderLength implements stack.LinkEndpoint: packets carry no link header.
func (l *link) MaxHeaderLength() uint16 { return 0 }

// LinkAddress implements stack.LinkEndpoint: there is no link address.
func (l *link) LinkAddress() tcpip.LinkAddress { return "" }

// SetLinkAddress implements stack.LinkEndpoint.
func (l *link) SetLinkAddress(tcpip.LinkAddress) {}

// Capabilities implements stack.LinkEndpoint. No checksum offload: the checksums the peer's
// stack computed are checked as on any link, which keeps either end free to be another stack.
func (l *link) Capabilities() stack.LinkEndpointCapabilities { return 0 }

// Attach implements stack.LinkEndpoint; the stack detaches with nil when it removes the NIC.
func (l *link) Attach(d stack.NetworkDispatcher) {
	l.mu.Lock()
	l.dispatcher = d
	l.mu.Unlock()
}

// IsAttached implements stack.LinkEndpoint.
func (l *link) IsAttached() bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.dispatcher != nil
}

// Wait implements stack.LinkEndpoint: the link has no goroutines.
func (l *link) Wait() {}

// ARPHardwareType implements stack.LinkEndpoint.
func (l *link) ARPHardwareType() header.ARPHardwareType { return header.ARPHardwareNone }

// AddHeader implements stack.LinkEndpoint: there is no link header.
func (l *link) AddHeader(*stack.PacketBuffer) {}

// ParseHeader implements stack.LinkEndpoint: there is no link header.
func (l *link) ParseHeader(*stack.PacketBuffer) bool { return true }

// Close implements stack.LinkEndpoint; Stack.Close drains the queue.
func (l *link) Close() {}

// SetOnCloseAction implements stack.LinkEndpoint.
func (l *link) SetOnCloseAction(func()) {}
