// Package netstack is a userspace TCP/IP stack (gVisor's) that is a wireguard-go TUN device: the
// packets WireGuard decrypts go into the stack and the stack's packets come back out to be
// encrypted. It dials and listens on its own inner addresses like package net does, and it can
// terminate TCP connections to other addresses inside configured prefixes and hand each to a
// Handler together with the destination the peer dialed (the shoot agent's forwarder into the
// shoot's networks). Connections to any other address are reset, never forwarded.
//
// It replaces wireguard-go's tun/netstack, which keeps its gVisor stack private (so nothing can
// forward), copies every outbound packet twice through a freshly zeroed buffer and hands them
// to WireGuard one at a time through an unbuffered channel, has gVisor copy every inbound
// packet a second time to read its headers (see headerSplit), and never releases inbound
// packets (so their buffers go to the garbage collector instead of back to gVisor's pools).
// Its TCP is tuned for a lossless stream transport with a large MTU (see setup).
//
// With Forward.UDP it also forwards UDP flows (DNS, above all) to addresses inside the prefixes,
// bounded in number. It does not resolve names (addresses are IP literals), answer pings, or
// forward ICMP: with forwarding on, packets for other addresses that are neither TCP nor
// forwarded UDP are dropped and counted.
package netstack

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/host/idlemem"
	"golang.zx2c4.com/wireguard/tun"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"
)

const (
	// DefaultMTU is the MTU when Config.MTU is 0: wireguard-go's default for a UDP transport.
	// Over a stream transport the caller passes a much larger one (tunnel/wg: 60,000).
	DefaultMTU = 1420

	// MinMTU is IPv6's minimum link MTU (RFC 8200).
	MinMTU = 1280

	// MaxMTU is the largest IP packet (the 16-bit total length).
	MaxMTU = 65535

	// DefaultQueueLen is how many outbound packets may wait for WireGuard when
	// Config.QueueLen is 0; beyond it the stack's packets are dropped (counted in
	// Stats.Dropped[DropQueueFull]) and TCP retransmits them. Queued packets share their
	// bytes with the TCP send buffers they came from, so the queue holds only references and
	// packet structs (about 400 bytes each: under 2 MiB when full); its length decides how
	// many windows may be in flight before drops start. A connection's 1 MiB send buffer is
	// 18 packets at MTU 60,000 and about 770 at 1420; at 1420 a queue of 1024 dropped packets
	// in a single bulk transfer (repaired by fast retransmit), 4096 did not.
	DefaultQueueLen = 4096

	// DefaultMaxInFlight bounds the forwarded connections that are between their SYN and the
	// Handler's Accept or Refuse (the Handler's dial to the real destination included) when
	// Forward.MaxInFlight is 0: twice the seed server's default cap on dials in flight through
	// one tunnel (256), so the bound only bites when something floods the agent. Beyond it a
	// SYN is dropped (counted) and the client retransmits it.
	DefaultMaxInFlight = 512

	// batchSize is how many packets Read hands WireGuard at once. wireguard-go encrypts a
	// batch on one goroutine, so a burst split into small batches is encrypted on every core
	// while a single batch of 32 occupies one: batches of 4 moved more than batches of 32 at
	// MTU 60,000 and no less at smaller ones; batches of 1 moved less at 1420 (tunnel/wg
	// BenchmarkThroughput; docs/performance.md, "Reversed VPN tunnel").
	batchSize = 4

	nicID tcpip.NICID = 1
)

// TCP receive buffer. The inner TCP runs over a reliable stream, so the window, not loss,
// limits a bulk connection. gVisor grows a connection's receive buffer (moderation) from
// tcpReceiveDefault while the reader keeps up, up to a maximum of 4 MiB, 70 segments at MTU
// 60,000. An 8 MiB maximum moves more at MTU 60,000, a larger one or a larger start no more,
// and moderation off moves much less (tunnel/wg BenchmarkThroughput; docs/performance.md,
// "Reversed VPN tunnel"). Only a connection whose reader keeps up while the window is the
// bottleneck grows that far.
const (
	tcpReceiveMin     = 4 << 10 // gVisor's tcp.MinBufferSize
	tcpReceiveDefault = 1 << 20 // gVisor's tcp.DefaultReceiveBufferSize
	tcpReceiveMax     = 8 << 20
)

// tcpSendMax caps a connection's send buffer, which bounds what it has in flight. gVisor grows
// the buffer with the congestion window (2 × window × MSS) up to 4 MiB, and a sending end holds
// what is in flight twice: in that buffer until the peer acknowledges it, and as WireGuard's
// 64 KiB packet buffers while the packets wait for the outer stream, which is the bottleneck.
// Under the tunnel ends' 32 MiB soft memory limit (idlemem.TunnelSoftLimitMiB) four bulk
// connections at 4 MiB (4 × 4 MiB × 2 = 32 MiB) kept tendril-server's garbage collector
// running all the time, and every cycle emptied WireGuard's and gVisor's buffer pools, so each
// packet took a fresh 64 KiB buffer and the CPU per MB rose far above one connection's. At
// 2 MiB (4 × 2 MiB × 2 = 16 MiB) it runs far less often, near one connection's CPU per MB, and
// one connection moves as much as at 4 MiB; 1 MiB in flight slows one connection, so a
// connection needs a little more than that (figures: docs/performance.md, "Several bulk
// connections: the collector under the soft limit").
const tcpSendMax = 2 << 20

// A connection whose round trip is long needs more in flight than tcpSendMax allows: what it
// has in flight is its bytes per second times the round trip, and gVisor's buffer holds about
// twice that (it sizes the buffer at twice the window and wakes a writer only when half of it
// is free). The cap above holds a carrier inside one region, where the outer stream, not the
// round trip, is the bottleneck and what waits for it is held twice; across regions the bytes
// in flight wait in the kernel's socket buffers and on the path, held once. So a connection
// whose handshake took longer than tcpSendMax covers (2 × tcpSendRate × RTT > tcpSendMax: a
// round trip over 12.5 ms) gets a fixed send buffer of that size, up to tcpSendMaxLong (reached
// at 50 ms). gVisor's own sizing stays for the rest (docs/performance.md, "Tunnel under loss
// and latency").
const (
	tcpSendRate    = 80 << 20 // bytes per second a connection should be able to keep moving
	tcpSendMaxLong = 8 << 20
)

// sendBufferFor is the send buffer for a connection with round trip rtt, or 0 when gVisor's
// sizing under tcpSendMax suffices.
func sendBufferFor(rtt time.Duration) int64 {
	n := int64(2 * tcpSendRate * rtt.Seconds())
	if n <= tcpSendMax {
		return 0
	}
	return min(n, tcpSendMaxLong)
}

// sizeSendBuffer gives an established connection the send buffer its handshake's round trip
// calls for (sendBufferFor).
func sizeSendBuffer(ep tcpip.Endpoint) {
	var info tcpip.TCPInfoOption
	if ep.GetSockOpt(&info) != nil {
		return
	}
	if n := sendBufferFor(info.RTT); n > 0 {
		ep.SocketOptions().SetSendBufferSize(n, true) // fixed from now on: gVisor stops sizing it
	}
}

// timeWait is how long a connection stays in TIME-WAIT after the side that closed first sent
// its last ACK (gVisor's default: 60 s). TIME-WAIT keeps delayed duplicates of an old connection
// out of a new one with the same addresses and ports, and re-acknowledges a retransmitted FIN;
// between two tendril stacks the inner path is one reliable, ordered stream that neither delays
// nor duplicates packets (a lost final ACK costs the peer a reset of a connection it already
// closed). A long TIME-WAIT did harm: a forwarded connection that the shoot side closed first
// (a pod that answers and hangs up) left the agent's endpoint in TIME-WAIT, and gVisor hands a
// new SYN for the same addresses and ports to a listener only, never to the forwarder: when the
// server's stack picked that source port again, its SYNs were dropped until TIME-WAIT ended
// and the dial stalled for its whole timeout. With source ports picked at random (gVisor's
// way), 20 ms still left a collision for the share of ports closed within timeWait — at 3,000
// dials/s, 60 of 49,536 — and a dial that hits one waits for a SYN retransmission (1 s), so
// DialTCP takes ports in turn (bindNextPort), and a port comes back only long after its
// TIME-WAIT ended (docs/performance.md, "Dial stalls and memory after a load").
const timeWait = 20 * time.Millisecond

// Keepalive for forwarded connections: an agent-side connection whose seed-side end vanished
// (the server restarted, the tunnel is gone) would otherwise keep its Handler and the Handler's
// connection to the real destination forever. A restarted server's stack answers the first
// probe with a reset; a dead tunnel ends the connection after forwardKeepaliveIdle +
// forwardKeepaliveCount × forwardKeepaliveInterval = 60 s + 4 × 15 s = 2 min.
const (
	forwardKeepaliveIdle     = 60 * time.Second
	forwardKeepaliveInterval = 15 * time.Second
	forwardKeepaliveCount    = 4
)

var (
	// ErrClosed reports use of a closed Stack. It wraps net.ErrClosed.
	ErrClosed = fmt.Errorf("netstack: %w", net.ErrClosed)
)

// Config describes a Stack. Addresses is required; every other zero field takes the default
// named in its comment.
type Config struct {
	// Addresses are the stack's own inner addresses.
	Addresses []netip.Addr
	// MTU is the link MTU, MinMTU … MaxMTU. 0 means DefaultMTU.
	MTU int
	// QueueLen bounds the outbound packets waiting for WireGuard. 0 means DefaultQueueLen.
	QueueLen int
	// Forward, if its Handler is set, terminates TCP connections to addresses inside its
	// Prefixes. The zero Forward forwards nothing: packets to other addresses are dropped.
	Forward Forward
}

// Stack is a gVisor network stack that is also a tun.Device for wireguard-go. Create it with
// New and hand it to device.NewDevice; the device calls Close when it closes. Its methods are
// safe for concurrent use.
type Stack struct {
	cfg    Config
	stack  *stack.Stack
	link   *link
	own    []netip.Addr // cfg.Addresses, unmapped
	fwd    *forwarder   // nil without Forward
	events chan tun.Event

	// gate keeps Write out of a closing stack: Write delivers under the read lock, Close takes
	// the write lock once closed is set, so no packet enters the stack after Close began
	// tearing it down.
	gate   sync.RWMutex
	closed atomic.Bool
	done   chan struct{} // closed by Close: Read returns

	dropped [numDropReasons]atomic.Uint64
	// held gives the pages of the buffers wireguard-go's TUN reader passes to Read back once
	// the packets have been small for a while; only that reader uses it.
	held idlemem.Held

	// nextPort is the last ephemeral port offset DialTCP took (bindNextPort); it starts at
	// random so that a restarted stack does not begin where its predecessor did.
	nextPort atomic.Uint32

	closeOnce sync.Once
}

var _ tun.Device = (*Stack)(nil)

// New validates cfg and returns a running Stack.
func New(cfg Config) (*Stack, error) {
	if cfg.MTU == 0 {
		cfg.MTU = DefaultMTU
	}
	if cfg.QueueLen <= 0 {
		cfg.QueueLen = DefaultQueueLen
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Stack{
		cfg:    cfg,
		events: make(chan tun.Event, 1),
		done:   make(chan struct{}),
	}
	for _, a := range cfg.Addresses {
		s.own = append(s.own, a.Unmap())
	}
	s.nextPort.Store(rand.Uint32())
	s.stack = stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, ipv6.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
		// A connection from the stack to one of its own addresses stays inside it. Not with
		// forwarding: in promiscuous mode every source address counts as local, so the stack
		// would drop every inbound packet as coming from itself. (A forwarding stack dialing
		// itself sends the SYN to WireGuard, which has no peer for it.)
		HandleLocal: cfg.Forward.Handler == nil,
	})
	s.link = newLink(uint32(cfg.MTU), cfg.QueueLen, &s.dropped[DropQueueFull])
	if err := s.setup(); err != nil {
		s.stack.Destroy()
		return nil, err
	}
	s.events <- tun.EventUp
	return s, nil
}

func (cfg *Config) validate() error {
	if len(cfg.Addresses) == 0 {
		return errors.New("netstack: config: Addresses is required")
	}
	for _, a := range cfg.Addresses {
		if !a.IsValid() || a.Zone() != "" || a.Unmap().IsUnspecified() {
			return fmt.Errorf("netstack: config: address %q is not a plain unicast IP address", a)
		}
	}
	if cfg.MTU < MinMTU || cfg.MTU > MaxMTU {
		return fmt.Errorf("netstack: config: MTU %d outside %d … %d", cfg.MTU, MinMTU, MaxMTU)
	}
	return cfg.Forward.validate()
}

// setup configures the stack: TCP options, the NIC, addresses, routes and the forwarder.
func (s *Stack) setup() error {
	opts := []tcpip.SettableTransportProtocolOption{
		// No selective acknowledgements (wireguard-go's netstack turns them on, for UDP).
		// Nothing between the two stacks loses or reorders packets, but with SACK gVisor also
		// runs RACK loss detection, whose reordering window (a fraction of a sub-millisecond
		// round trip) is shorter than the batching jitter between the stacks: it retransmits
		// segments spuriously, each time shrinking the window, and SACK off moves more, with
		// no retransmission at all (docs/performance.md, "Reversed VPN tunnel"). The only
		// loss left is a full outbound queue, which fast retransmit repairs.
		ptr(tcpip.TCPSACKEnabled(false)),
		ptr(tcpip.TCPModerateReceiveBufferOption(true)),
		ptr(tcpip.TCPTimeWaitTimeoutOption(timeWait)),
		&tcpip.TCPReceiveBufferSizeRangeOption{Min: tcpReceiveMin, Default: tcpReceiveDefault, Max: tcpReceiveMax},
		&tcpip.TCPSendBufferSizeRangeOption{Min: tcp.MinBufferSize, Default: tcp.DefaultSendBufferSize, Max: tcpSendMax},
	}
	for _, o := range opts {
		if err := s.stack.SetTransportProtocolOption(tcp.ProtocolNumber, o); err != nil {
			// tcpip.Error is not a Go error; its text is all there is.
			return fmt.Errorf("netstack: set TCP option %T: %v", o, err)
		}
	}
	if err := s.stack.CreateNIC(nicID, s.link); err != nil {
		return fmt.Errorf("netstack: create NIC: %v", err)
	}
	for _, a := range s.own {
		pa := tcpip.ProtocolAddress{
			Protocol:          protocol(a),
			AddressWithPrefix: tcpip.AddrFromSlice(a.AsSlice()).WithPrefix(),
		}
		if err := s.stack.AddProtocolAddress(nicID, pa, stack.AddressProperties{}); err != nil {
			return fmt.Errorf("netstack: add address %s: %v", a, err)
		}
	}
	// Everything not local goes to WireGuard, which picks the peer by its AllowedIPs. Both
	// families get a route even without an own address of that family: a forwarded
	// connection to an IPv4 destination answers from that (spoofed) IPv4 address.
	s.stack.SetRouteTable([]tcpip.Route{
		{Destination: header.IPv4EmptySubnet, NIC: nicID},
		{Destination: header.IPv6EmptySubnet, NIC: nicID},
	})
	if s.cfg.Forward.Handler == nil {
		return nil
	}
	// Promiscuous: accept packets for any destination, not only own addresses. Spoofing:
	// let the forwarded endpoints send from the destination address the peer dialed.
	if err := s.stack.SetPromiscuousMode(nicID, true); err != nil {
		return fmt.Errorf("netstack: promiscuous mode: %v", err)
	}
	if err := s.stack.SetSpoofing(nicID, true); err != nil {
		return fmt.Errorf("netstack: spoofing: %v", err)
	}
	s.fwd = newForwarder(s, s.cfg.Forward)
	s.stack.SetTransportProtocolHandler(tcp.ProtocolNumber, s.fwd.handlePacket)
	if s.cfg.Forward.UDP != nil {
		s.fwd.udp = newUDPForwarder(s.fwd, s.cfg.Forward)
		s.stack.SetTransportProtocolHandler(udp.ProtocolNumber, s.fwd.udp.handlePacket)
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

func protocol(a netip.Addr) tcpip.NetworkProtocolNumber {
	if a.Is4() {
		return ipv4.ProtocolNumber
	}
	return ipv6.ProtocolNumber
}

func fullAddr(ap netip.AddrPort) tcpip.FullAddress {
	fa := tcpip.FullAddress{Port: ap.Port()}
	if a := ap.Addr().Unmap(); a.IsValid() && !a.IsUnspecified() {
		fa.Addr = tcpip.AddrFromSlice(a.AsSlice())
	}
	return fa
}

// isOwn reports whether a is one of the stack's addresses.
func (s *Stack) isOwn(a netip.Addr) bool {
	for _, o := range s.own {
		if o == a {
			return true
		}
	}
	return false
}

// DialContext connects to addr, an IP literal with a port, over network "tcp", "tcp4",
// "tcp6", "udp", "udp4" or "udp6". A UDP connection is connected to addr and sends from the
// stack's address of addr's family.
func (s *Stack) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ap, err := parseAddrPort(network, addr)
	if err != nil {
		return nil, fmt.Errorf("netstack: dial %s %s: %w", network, addr, err)
	}
	if ap.Addr().IsUnspecified() {
		return nil, fmt.Errorf("netstack: dial %s %s: unspecified address", network, addr)
	}
	switch network {
	case "tcp", "tcp4", "tcp6":
		return s.DialTCP(ctx, ap)
	default:
		c, err := gonet.DialUDP(s.stack, nil, ptr(fullAddr(ap)), protocol(ap.Addr().Unmap()))
		if err != nil {
			return nil, fmt.Errorf("netstack: dial %s %s: %w", network, addr, err)
		}
		return c, nil
	}
}

// DialTCP connects to addr. The connection is a *TCPConn, which can CloseWrite. A
// failure is a *net.OpError whose Err is a syscall.Errno where the stack's error has one
// (ECONNREFUSED for a reset answer, ETIMEDOUT, EHOSTUNREACH, …), or ctx's error.
func (s *Stack) DialTCP(ctx context.Context, addr netip.AddrPort) (net.Conn, error) {
	opErr := func(err error) error {
		return fmt.Errorf("netstack: %w", &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(addr), Err: err})
	}
	if s.closed.Load() {
		return nil, opErr(net.ErrClosed)
	}
	// gonet.DialContextTCP does the same but returns the stack's errors as bare strings.
	wq := new(waiter.Queue)
	ep, terr := s.stack.NewEndpoint(tcp.ProtocolNumber, protocol(addr.Addr().Unmap()), wq)
	if terr != nil {
		return nil, opErr(errno(terr))
	}
	if terr := s.bindNextPort(ep, addr.Addr().Unmap()); terr != nil {
		ep.Close()
		return nil, opErr(errno(terr))
	}
	entry, connected := waiter.NewChannelEntry(waiter.WritableEvents)
	wq.EventRegister(&entry)
	defer wq.EventUnregister(&entry)
	terr = ep.Connect(fullAddr(addr))
	if _, ok := terr.(*tcpip.ErrConnectStarted); ok {
		select {
		case <-connected: // or failed; Close aborts it too
			terr = ep.LastError()
		case <-ctx.Done():
			ep.Close()
			return nil, opErr(ctx.Err())
		}
	}
	if terr != nil {
		ep.Close()
		return nil, opErr(errno(terr))
	}
	return newTCPConn(wq, ep), nil
}

// TCPConn is a connection of the stack: a *gonet.TCPConn whose Close also stops its deadline
// timers. gonet's deadlines are time.AfterFunc timers that its Close leaves running, and the
// runtime keeps a pending timer until it fires: a connection closed under a relay's 1 h idle
// deadline held about 2 KB for that hour (TestClosedConnKeepsNoTimers).
type TCPConn struct {
	*gonet.TCPConn
	// wq and ep are the connection's, for WaitReadable; nil for an accepted connection
	// (gonet's listener does not hand them out).
	wq *waiter.Queue
	ep tcpip.Endpoint
}

func newTCPConn(wq *waiter.Queue, ep tcpip.Endpoint) *TCPConn {
	sizeSendBuffer(ep)
	return &TCPConn{TCPConn: gonet.NewTCPConn(wq, ep), wq: wq, ep: ep}
}

// readReady are the events after which a Read does not block: bytes, the peer's end of
// stream, a reset or a local close.
const readReady = waiter.ReadableEvents | waiter.EventHUp | waiter.EventErr

// WaitReadable waits until a Read would not block, or deadline passes (os.ErrDeadlineExceeded;
// the zero Time: no deadline), without a buffer: a relay takes its copy buffer only then, so an
// idle connection holds none. On an accepted connection it returns at once.
func (c *TCPConn) WaitReadable(deadline time.Time) error {
	if c.ep == nil || c.ep.Readiness(readReady) != 0 {
		return nil
	}
	e, ready := waiter.NewChannelEntry(readReady)
	c.wq.EventRegister(&e)
	defer c.wq.EventUnregister(&e)
	if c.ep.Readiness(readReady) != 0 { // an event between the check and the registration
		return nil
	}
	var expired <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-ready:
		return nil
	case <-expired:
		return os.ErrDeadlineExceeded
	}
}

// Close closes the connection and stops its deadline timers.
func (c *TCPConn) Close() error {
	// A zero deadline stops both timers; nothing waits on them once the endpoint is closed.
	_ = c.TCPConn.SetDeadline(time.Time{})
	return c.TCPConn.Close()
}

// tcpListener hands out TCPConns.
type tcpListener struct {
	*gonet.TCPListener
}

func (l tcpListener) Accept() (net.Conn, error) {
	c, err := l.TCPListener.Accept()
	if err != nil {
		return nil, err
	}
	return &TCPConn{TCPConn: c.(*gonet.TCPConn)}, nil
}

// bindNextPort binds ep to the next free port of the stack's ephemeral range, in turn, instead
// of letting gVisor pick one at random for each connection.
//
// Why: the peer must not see a SYN for a connection whose previous incarnation it still holds in
// TIME-WAIT. A forwarding peer (the agent) is left in TIME-WAIT whenever the pod closed first
// (timeWait), and gVisor hands a SYN that hits a TIME-WAIT endpoint to a listener only, never to
// the forwarder: the SYN is dropped and the dial waits one SYN retransmission (1 s). With random
// ports a dial collides with one of the rate × timeWait ports in TIME-WAIT: at 3,000 dials/s to
// one pod, 60 of 49,536 ports, 9 dials of 5,000 took 1 s (tunnel/wg
// TestDialsAtHighRatePodClosesFirst). In turn, a port comes back only after the other 49,535
// (gVisor's range 16000–65535): at 20 ms TIME-WAIT that is safe below 49,536 / 0.02 s ≈ 2.5
// million dials per second. Ports still in use (a long-lived connection, a listener, an own
// TIME-WAIT) are skipped, up to maxPortTries of them in a row; past those gVisor picks.
//
// It binds the stack's own address of dst's family, the one the route to dst sends from, never
// the unspecified address: gVisor releases a connected endpoint's port under its local address,
// so a reservation made under the unspecified one would never be released (1.45 KiB and the
// port lost per dial).
func (s *Stack) bindNextPort(ep tcpip.Endpoint, dst netip.Addr) tcpip.Error {
	var local netip.Addr
	for _, a := range s.own {
		if a.Is4() == dst.Is4() {
			local = a
			break
		}
	}
	if !local.IsValid() {
		return nil // no address to send from: Connect reports it
	}
	first, last := s.stack.PortRange()
	n := uint32(last) - uint32(first) + 1
	for range maxPortTries {
		p := uint16(uint32(first) + s.nextPort.Add(1)%n)
		terr := ep.Bind(tcpip.FullAddress{Addr: tcpip.AddrFromSlice(local.AsSlice()), Port: p})
		if terr == nil {
			return nil
		}
		if _, inUse := terr.(*tcpip.ErrPortInUse); !inUse {
			return terr
		}
	}
	return nil
}

// maxPortTries bounds the ports bindNextPort tries for one dial: a run of this many ports in use
// means most of the range is (49,536 ports), where gVisor's own search does no worse.
const maxPortTries = 256

// errno translates the stack's errors that have a socket errno, so that callers can tell a
// refused connection from an unreachable or timed-out one with errors.Is.
func errno(e tcpip.Error) error {
	switch e.(type) {
	case *tcpip.ErrConnectionRefused:
		return syscall.ECONNREFUSED
	case *tcpip.ErrConnectionReset:
		return syscall.ECONNRESET
	case *tcpip.ErrConnectionAborted, *tcpip.ErrAborted:
		return syscall.ECONNABORTED
	case *tcpip.ErrTimeout:
		return syscall.ETIMEDOUT
	case *tcpip.ErrHostUnreachable, *tcpip.ErrHostDown:
		return syscall.EHOSTUNREACH
	case *tcpip.ErrNetworkUnreachable, *tcpip.ErrNoNet:
		return syscall.ENETUNREACH
	case *tcpip.ErrBadLocalAddress:
		return syscall.EADDRNOTAVAIL
	case *tcpip.ErrPortInUse:
		return syscall.EADDRINUSE
	}
	return errors.New(e.String())
}

// parseAddrPort parses an IP-literal address for a network and checks that they agree.
func parseAddrPort(network, addr string) (netip.AddrPort, error) {
	var want4, want6 bool
	switch network {
	case "tcp", "udp":
	case "tcp4", "udp4":
		want4 = true
	case "tcp6", "udp6":
		want6 = true
	default:
		return netip.AddrPort{}, net.UnknownNetworkError(network)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	var ip netip.Addr
	switch {
	case host != "":
		if ip, err = netip.ParseAddr(host); err != nil {
			return netip.AddrPort{}, err
		}
	case want4:
		ip = netip.IPv4Unspecified()
	default:
		ip = netip.IPv6Unspecified()
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("port %q: %w", port, err)
	}
	ip = ip.Unmap()
	if (want4 && !ip.Is4()) || (want6 && !ip.Is6()) {
		return netip.AddrPort{}, fmt.Errorf("address %s is not of network %s", ip, network)
	}
	return netip.AddrPortFrom(ip, uint16(p)), nil
}

// Listen listens on addr ("ip:port", "[ip]:port" or ":port") for network "tcp", "tcp4" or
// "tcp6".
func (s *Stack) Listen(network, addr string) (net.Listener, error) {
	if network != "tcp" && network != "tcp4" && network != "tcp6" {
		return nil, fmt.Errorf("netstack: listen %s %s: %w", network, addr, net.UnknownNetworkError(network))
	}
	ap, err := parseAddrPort(network, addr)
	if err != nil {
		return nil, fmt.Errorf("netstack: listen %s %s: %w", network, addr, err)
	}
	return s.ListenTCP(ap)
}

// ListenTCP listens on addr. The unspecified address listens on every own address of its
// family ("::" on IPv4 ones too: gVisor's IPv6 listeners are dual-stack). With Forward on it
// needs exactly one such own address, which the listener then binds: a listener on the
// unspecified address would match every destination the NIC accepts in promiscuous mode and
// take those ports over from the forwarder.
func (s *Stack) ListenTCP(addr netip.AddrPort) (net.Listener, error) {
	if s.closed.Load() {
		return nil, fmt.Errorf("netstack: listen tcp %s: %w", addr, ErrClosed)
	}
	a := addr.Addr().Unmap()
	if a.IsValid() && !a.IsUnspecified() && !s.isOwn(a) {
		return nil, fmt.Errorf("netstack: listen tcp %s: not an address of this stack", addr)
	}
	if s.fwd != nil && (!a.IsValid() || a.IsUnspecified()) {
		var match []netip.Addr
		for _, o := range s.own {
			if !a.IsValid() || a == netip.IPv6Unspecified() || o.Is4() == a.Is4() {
				match = append(match, o)
			}
		}
		if len(match) != 1 {
			return nil, fmt.Errorf("netstack: listen tcp %s: with forwarding on, the unspecified address needs exactly one own address of its family, have %d: listen on each address", addr, len(match))
		}
		a = match[0]
	}
	ap := netip.AddrPortFrom(a, addr.Port())
	pn := ipv6.ProtocolNumber
	if a.Is4() {
		pn = ipv4.ProtocolNumber
	}
	ln, err := gonet.ListenTCP(s.stack, fullAddr(ap), pn)
	if err != nil {
		return nil, fmt.Errorf("netstack: listen tcp %s: %w", addr, err)
	}
	return tcpListener{ln}, nil
}

// ListenUDP opens a UDP socket on addr (the unspecified address: every own address).
func (s *Stack) ListenUDP(addr netip.AddrPort) (net.PacketConn, error) {
	if s.closed.Load() {
		return nil, fmt.Errorf("netstack: listen udp %s: %w", addr, ErrClosed)
	}
	pn := ipv6.ProtocolNumber
	if addr.Addr().Unmap().Is4() {
		pn = ipv4.ProtocolNumber
	}
	c, err := gonet.DialUDP(s.stack, ptr(fullAddr(addr)), nil, pn)
	if err != nil {
		return nil, fmt.Errorf("netstack: listen udp %s: %w", addr, err)
	}
	return c, nil
}

// DropReason says why a packet was dropped between WireGuard and the stack.
type DropReason int

const (
	// DropQueueFull: the stack sent a packet while DefaultQueueLen (Config.QueueLen) packets
	// were waiting for WireGuard. TCP retransmits it.
	DropQueueFull DropReason = iota
	// DropNotIP: WireGuard delivered a packet that is neither IPv4 nor IPv6 or is shorter than
	// its header.
	DropNotIP
	// DropNotTCP: with forwarding on, a packet to an address that is not the stack's own was
	// not TCP, nor UDP with Forward.UDP set (ICMP, or IPv6 with an extension header), so nothing
	// could take it. Without forwarding the stack drops such packets itself, uncounted here.
	DropNotTCP

	numDropReasons
)

func (r DropReason) String() string {
	switch r {
	case DropQueueFull:
		return "queue-full"
	case DropNotIP:
		return "not-ip"
	case DropNotTCP:
		return "not-tcp"
	}
	return "unknown"
}

// Stats is a snapshot of a Stack's counters. All counters only grow (ForwardActive and
// ForwardInFlight excepted).
type Stats struct {
	// Forwarded counts connections the Handler accepted.
	Forwarded uint64
	// ForwardActive is how many Handlers are running.
	ForwardActive int
	// ForwardInFlight is how many forwarded connections are between SYN and Accept or Refuse.
	ForwardInFlight int
	// Refused counts connection attempts not forwarded, by reason (index: RefuseReason).
	// RefusedInFlight counts every SYN dropped, retransmissions included.
	Refused [numRefuseReasons]uint64
	// Dropped counts packets dropped between WireGuard and the stack, by reason (index:
	// DropReason).
	Dropped [numDropReasons]uint64
	// UDPFlows counts forwarded UDP flows opened; UDPFlowsActive is how many are open.
	UDPFlows       uint64
	UDPFlowsActive int
	// TCP are the stack's own TCP counters, over all its connections; nil where the stack is
	// not this one (the kernel's, behind a TUN device).
	TCP *TCPStats
}

// TCPStats are gVisor's TCP counters that tell how the tunnel's inner connections fare: a
// retransmission timeout stalls a connection for at least the minimum RTO (200 ms), and one
// that was spurious (the segment had only waited in a queue) resent a window for nothing.
type TCPStats struct {
	SegmentsSent, SegmentsReceived uint64
	// Retransmits counts segments sent again, for whatever reason.
	Retransmits uint64
	// Timeouts counts retransmission timer expiries (gVisor counts a zero-window probe, sent
	// to a peer whose reader stopped reading, as one too); SpuriousTimeouts those the peer's
	// acknowledgements showed were not needed.
	Timeouts, SpuriousTimeouts uint64
	// FastRetransmits counts losses repaired by duplicate acknowledgements, without a timeout.
	FastRetransmits uint64
}

// Stats returns a snapshot of the counters.
func (s *Stack) Stats() Stats {
	var st Stats
	for i := range st.Dropped {
		st.Dropped[i] = s.dropped[i].Load()
	}
	tcp := s.stack.Stats().TCP
	st.TCP = &TCPStats{
		SegmentsSent: tcp.SegmentsSent.Value(), SegmentsReceived: tcp.ValidSegmentsReceived.Value(),
		Retransmits: tcp.Retransmits.Value(), Timeouts: tcp.Timeouts.Value(),
		SpuriousTimeouts: tcp.SpuriousRTORecovery.Value(), FastRetransmits: tcp.FastRetransmit.Value(),
	}
	if s.fwd != nil {
		s.fwd.stats(&st)
	}
	return st
}

// StopForwarding refuses forwarded connections from now on, ends the Handlers' contexts,
// resets every forwarded connection and returns once every Handler has returned. The stack
// keeps serving its own addresses. Close calls it; a caller that owns the WireGuard device
// calls it before closing the device, so that Handlers wind down while the device still runs
// (and the resets may still reach the peer: WireGuard sends them unless the device closes
// first). Without Forward it does nothing.
func (s *Stack) StopForwarding() {
	if s.fwd != nil {
		s.fwd.stop()
	}
}

// Close stops forwarding (StopForwarding), ends every connection and listener of the stack,
// and releases it. wireguard-go's device.Close calls it; a second call does nothing. It
// returns nil.
func (s *Stack) Close() error {
	s.closeOnce.Do(func() {
		s.StopForwarding()
		s.closed.Store(true)
		close(s.done) // Read returns
		s.gate.Lock() // no Write is delivering from here on
		s.gate.Unlock()
		// Abort every endpoint: connections and listeners return errors.
		s.stack.Close()
		s.stack.Wait()
		s.link.drain()
		close(s.events)
	})
	return nil
}

// The tun.Device that wireguard-go drives. Nothing else calls these.

// Name returns a constant name: there is no kernel interface.
func (s *Stack) Name() (string, error) { return "tendril", nil }

// File returns nil: there is no file descriptor.
func (s *Stack) File() *os.File { return nil }

// MTU returns the configured MTU.
func (s *Stack) MTU() (int, error) { return s.cfg.MTU, nil }

// Events delivers tun.EventUp once and is closed by Close.
func (s *Stack) Events() <-chan tun.Event { return s.events }

// BatchSize is how many packets Read returns at most.
func (s *Stack) BatchSize() int { return batchSize }

// Read waits for the stack's next outbound packet and copies it, and whatever else is already
// queued, up to len(bufs), into bufs at offset: one copy per packet, straight from the stack's
// buffers. It returns an error wrapping os.ErrClosed once the Stack is closed.
func (s *Stack) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	s.held.Waiting(bufs)
	var pkt *stack.PacketBuffer
	select {
	case pkt = <-s.link.queue:
	case <-s.done:
		// os.ErrClosed: what wireguard-go takes for a TUN device closed on purpose.
		return 0, fmt.Errorf("netstack: read: %w", os.ErrClosed)
	}
	n := 0
	for {
		sizes[n] = copyPacket(bufs[n][offset:], pkt)
		s.held.Filled(sizes[n])
		pkt.DecRef()
		n++
		if n == len(bufs) || n == batchSize {
			return n, nil
		}
		select {
		case pkt = <-s.link.queue:
		default:
			return n, nil
		}
	}
}

// copyPacket copies pkt's headers and payload into dst and returns the length. dst is at least
// the MTU long (WireGuard's buffers are MaxMessageSize), and the stack never sends more.
func copyPacket(dst []byte, pkt *stack.PacketBuffer) int {
	n := 0
	for _, v := range pkt.AsSlices() {
		n += copy(dst[n:], v)
	}
	return n
}

// Write delivers packets WireGuard decrypted into the stack. Each is copied once, into buffers
// from gVisor's pool (link.deliver), which the stack keeps while TCP queues the data and then
// returns to the pool. Packets that are not IP, and with forwarding on non-TCP packets for
// other addresses, are dropped and counted. It reports every packet as written.
func (s *Stack) Write(bufs [][]byte, offset int) (int, error) {
	s.gate.RLock()
	defer s.gate.RUnlock()
	if s.closed.Load() {
		return 0, ErrClosed
	}
	for _, b := range bufs {
		pkt := b[offset:]
		if len(pkt) == 0 {
			continue
		}
		pn, ok := s.admit(pkt)
		if !ok {
			continue
		}
		s.link.deliver(pn, pkt)
	}
	return len(bufs), nil
}

// admit checks an inbound packet's IP version and, with forwarding on, lets a packet for
// another address in only if it is TCP, or UDP with Forward.UDP: promiscuous mode would
// otherwise have the stack answer pings and UDP for every address in the world. The forwarders
// drop or reset what is outside the prefixes. A TCP packet for another address goes in
// whether or not its destination is inside the prefixes; the forwarder resets those outside.
func (s *Stack) admit(pkt []byte) (tcpip.NetworkProtocolNumber, bool) {
	var pn tcpip.NetworkProtocolNumber
	var dst netip.Addr
	var proto uint8
	switch pkt[0] >> 4 {
	case 4:
		if len(pkt) < header.IPv4MinimumSize {
			s.dropped[DropNotIP].Add(1)
			return 0, false
		}
		pn, proto = ipv4.ProtocolNumber, pkt[9]
		dst = netip.AddrFrom4([4]byte(pkt[16:20]))
	case 6:
		if len(pkt) < header.IPv6MinimumSize {
			s.dropped[DropNotIP].Add(1)
			return 0, false
		}
		pn, proto = ipv6.ProtocolNumber, pkt[6]
		dst = netip.AddrFrom16([16]byte(pkt[24:40]))
	default:
		s.dropped[DropNotIP].Add(1)
		return 0, false
	}
	if s.fwd == nil || proto == uint8(tcp.ProtocolNumber) || s.isOwn(dst) ||
		(proto == uint8(udp.ProtocolNumber) && s.fwd.udp != nil) {
		return pn, true
	}
	s.dropped[DropNotTCP].Add(1)
	return 0, false
}
