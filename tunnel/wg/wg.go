// Package wg runs a userspace WireGuard device (golang.zx2c4.com/wireguard) with a gVisor
// netstack (package netstack) as its interface, over the framed streams of package bind: no
// TUN device, no privileges, no UDP. With Config.TUN it uses a TUN device and the kernel's
// TCP/IP stack instead (package tundev; privileged, opt-in). A Tunnel dials and listens on its own inner addresses like
// package net does, optionally terminates TCP connections to destinations inside configured
// prefixes and hands them to a handler (the agent's forwarder into the shoot's networks), and
// reports per-peer handshake and byte counters. It does not dial or accept the outer streams
// (the caller does and attaches them), does not dial the real destinations of forwarded
// connections (the handler does), and does not resolve names (inner addresses are IP literals).
package wg

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"golang.zx2c4.com/wireguard/device"
	"golang.zx2c4.com/wireguard/tun"

	"github.com/tendril-net/tendril/tunnel/bind"
	"github.com/tendril-net/tendril/tunnel/frame"
	"github.com/tendril-net/tendril/tunnel/netstack"
	"github.com/tendril-net/tendril/tunnel/tundev"
)

const (
	// DefaultMTU is the inner MTU when Config.MTU is 0. Over a stream the outer TCP connection
	// segments and retransmits, so the inner packets can be as large as a frame allows and each
	// costs one encryption and one pass through both netstacks: the larger the MTU, the more two
	// netstacks over one TCP stream move (docs/performance.md, "Reversed VPN tunnel").
	DefaultMTU = 60000

	// MaxMTU is the largest inner MTU: a transport message is the padded packet (never beyond
	// the MTU) plus 32 bytes (16-byte header, 16-byte Poly1305 tag), and must fit one frame:
	// 65,535 − 32 = 65,503.
	MaxMTU = frame.MaxSize - device.MessageTransportSize

	// MinMTU is IPv6's minimum link MTU (RFC 8200), which the inner addresses may use.
	MinMTU = 1280
)

var (
	// ErrUnknownPeer reports a public key that is not one of the Tunnel's peers.
	ErrUnknownPeer = errors.New("wg: unknown peer")
)

// Config describes a Tunnel. PrivateKey and LocalAddresses are required; every other zero
// field takes the default named in its comment.
type Config struct {
	// PrivateKey is this end's WireGuard identity.
	PrivateKey Key
	// Peers are the only keys this end completes a handshake with. A packet from an inner
	// address goes to the peer whose AllowedIPs contain it.
	Peers []Peer
	// LocalAddresses are this end's inner addresses (for tendril, from Gardener's VPN range
	// fd8f:6d53:b97a:1::/96: the server ::1, agents from ::2 on).
	LocalAddresses []netip.Addr
	// MTU is the inner MTU, MinMTU … MaxMTU. 0 means DefaultMTU. Both ends should agree: each
	// end's TCP announces an MSS from its own MTU, so a smaller one on either side wins.
	MTU int
	// Bind tunes the streams (limits, buffers, write timeout); its zero value is valid. Its
	// Logger defaults to Logger.
	Bind bind.Config
	// Forward, if its Handler is set, terminates TCP connections to destinations inside its
	// Prefixes (the agent: the shoot's node, pod and service networks) and hands each to the
	// Handler, and with its UDP handler UDP flows too; connection attempts to other addresses
	// are reset. The zero value forwards
	// nothing. The server must route those prefixes here (its Peer for the agent lists them in
	// AllowedIPs) and needs an inner address of each family it dials: an IPv4 one, which the
	// agent's Peer for the server allows, to reach IPv4 networks.
	Forward netstack.Forward
	// TUN, if set, is the name of a TUN device to create: the kernel's TCP/IP stack then
	// carries the inner connections (package tundev) in place of the userspace netstack, which
	// needs CAP_NET_ADMIN. Forward's Prefixes are then reached through the kernel (see
	// TUNHandler; UDP forwarded with a masquerade) and its handlers and limits are not used.
	// The default, empty, needs no privilege.
	TUN string
	// TUNHandler, with TUN, serves each TCP connection into Forward's Prefixes, which the
	// kernel completed for this end (the agent: dial the destination, then relay). Without it
	// the kernel forwards TCP as well; UDP it forwards either way.
	TUNHandler tundev.Handler
	// Logger receives the tunnel's and WireGuard's log lines: WireGuard's errors at V(0),
	// rate-limited to about one a second (a dead stream would otherwise log every packet), its
	// verbose lines at V(2). The zero Logger discards.
	Logger logr.Logger
}

// Peer is a WireGuard peer of a Tunnel.
type Peer struct {
	// PublicKey identifies the peer.
	PublicKey Key
	// AllowedIPs are the inner addresses the peer may send from and that are routed to it.
	AllowedIPs []netip.Prefix
	// PersistentKeepalive, if non-zero, sends a keepalive after this much silence (whole
	// seconds, at most 65,535 s). The dialing side (the agent) sets it, so that the accepting
	// side always knows the agent's current stream and a dead stream shows up within it.
	PersistentKeepalive time.Duration
}

// Tunnel is a running WireGuard device with a netstack. Its methods are safe for concurrent
// use.
type Tunnel struct {
	cfg   Config
	log   logr.Logger
	bind  *bind.Bind
	dev   *device.Device
	stack innerStack
	peers []Key // in Config order, for Peers

	// Persistent keepalives start with a peer's first AttachPeer, not at Up: a keepalive due
	// at Up finds no endpoint, yet counts as a handshake attempt, and WireGuard then refuses
	// the next initiation for 5 s (RekeyTimeout), which would delay the first stream that long.
	kaMu sync.Mutex
	kaOn map[Key]bool

	// seen is each peer's rx_bytes at the last reading of the device's state and when it last
	// grew (observe): WireGuard counts only packets it accepted (a consumed handshake message,
	// a decrypted transport packet that passed the replay check), so growth means authenticated
	// traffic, which arrived on the peer's endpoint.
	seenMu sync.Mutex
	seen   map[Key]rxSeen
	// state and byKey are the last reading of the device's state, kept for the next one
	// (guarded by seenMu): a reading then allocates next to nothing.
	state bytes.Buffer
	byKey map[Key]PeerStatus

	// muted silences wireguard-go's log lines from Close on: its peer routines log their
	// "stopped" line after the device stopped waiting for them, which would otherwise reach the
	// Logger after Close returned.
	muted     atomic.Bool
	closeOnce sync.Once
}

// innerStack is what a Tunnel uses of its netstack. It is a *netstack.Stack, or a
// *tundev.Stack with Config.TUN; the throughput benchmark puts wireguard-go's own tun/netstack
// behind it for comparison.
type innerStack interface {
	tun.Device
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
	ListenTCP(addr netip.AddrPort) (net.Listener, error)
	ListenUDP(addr netip.AddrPort) (net.PacketConn, error)
	StopForwarding()
	Stats() netstack.Stats
}

// New validates cfg, starts the device and returns the Tunnel. No stream is attached yet.
func New(cfg Config) (*Tunnel, error) {
	if cfg.TUN != "" {
		return newTunnel(cfg, func(nc netstack.Config) (innerStack, error) {
			tc := tundev.Config{Name: cfg.TUN, Addresses: nc.Addresses, MTU: nc.MTU, Forward: nc.Forward.Prefixes, Handler: cfg.TUNHandler}
			for _, p := range cfg.Peers {
				tc.Routes = append(tc.Routes, p.AllowedIPs...)
			}
			return tundev.New(tc)
		})
	}
	return newTunnel(cfg, func(cfg netstack.Config) (innerStack, error) { return netstack.New(cfg) })
}

func newTunnel(cfg Config, newStack func(netstack.Config) (innerStack, error)) (*Tunnel, error) {
	cfg.MTU = cmp.Or(cfg.MTU, DefaultMTU)
	uapi, err := cfg.uapi()
	if err != nil {
		return nil, err
	}
	bcfg := cfg.Bind
	if bcfg.Logger.GetSink() == nil {
		bcfg.Logger = cfg.Logger
	}
	// Frames carry at most MTU + 32 bytes; refusing larger ones bounds every stream buffer.
	bcfg.MaxFrameSize = cmp.Or(bcfg.MaxFrameSize, cfg.MTU+device.MessageTransportSize)
	st, err := newStack(netstack.Config{Addresses: cfg.LocalAddresses, MTU: cfg.MTU, Forward: cfg.Forward})
	if err != nil {
		return nil, fmt.Errorf("wg: create netstack: %w", err)
	}
	t := &Tunnel{cfg: cfg, log: cfg.Logger, stack: st, kaOn: make(map[Key]bool), seen: make(map[Key]rxSeen), byKey: make(map[Key]PeerStatus)}
	t.bind = bind.New(bcfg)
	t.dev = device.NewDevice(st, t.bind, deviceLogger(cfg.Logger, &t.muted))
	for _, p := range cfg.Peers {
		t.peers = append(t.peers, p.PublicKey)
	}
	if err := t.dev.IpcSet(uapi); err != nil {
		t.Close()
		return nil, fmt.Errorf("wg: configure device: %w", err)
	}
	if err := t.dev.Up(); err != nil {
		t.Close()
		return nil, fmt.Errorf("wg: bring device up: %w", err)
	}
	return t, nil
}

// uapi validates the configuration and renders it in WireGuard's configuration protocol.
func (cfg *Config) uapi() (string, error) {
	if cfg.PrivateKey.IsZero() {
		return "", errors.New("wg: config: PrivateKey is required")
	}
	if len(cfg.LocalAddresses) == 0 {
		return "", errors.New("wg: config: LocalAddresses is required")
	}
	for _, a := range cfg.LocalAddresses {
		if !a.IsValid() || a.Zone() != "" {
			return "", fmt.Errorf("wg: config: local address %q is not a plain IP address", a)
		}
	}
	if cfg.MTU < MinMTU || cfg.MTU > MaxMTU {
		return "", fmt.Errorf("wg: config: MTU %d outside %d … %d", cfg.MTU, MinMTU, MaxMTU)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "private_key=%s\nreplace_peers=true\n", cfg.PrivateKey.hex())
	seen := make(map[Key]bool, len(cfg.Peers))
	for i, p := range cfg.Peers {
		if p.PublicKey.IsZero() {
			return "", fmt.Errorf("wg: config: peer %d: PublicKey is required", i)
		}
		if seen[p.PublicKey] {
			return "", fmt.Errorf("wg: config: peer %s listed twice", p.PublicKey)
		}
		seen[p.PublicKey] = true
		ka := p.PersistentKeepalive
		if ka < 0 || ka > 65535*time.Second || ka%time.Second != 0 {
			return "", fmt.Errorf("wg: config: peer %s: PersistentKeepalive %v is not 0 … 65535 whole seconds", p.PublicKey, ka)
		}
		// persistent_keepalive_interval stays 0 until AttachPeer (see Tunnel.kaOn).
		fmt.Fprintf(&b, "public_key=%s\nreplace_allowed_ips=true\npersistent_keepalive_interval=0\n", p.PublicKey.hex())
		for _, pfx := range p.AllowedIPs {
			if !pfx.IsValid() {
				return "", fmt.Errorf("wg: config: peer %s: invalid allowed IP prefix", p.PublicKey)
			}
			fmt.Fprintf(&b, "allowed_ip=%s\n", pfx.Masked())
		}
	}
	return b.String(), nil
}

// Attach adds c as a stream that the Tunnel now owns (the accepting side: the seed server, for
// each agent connection). No peer is pointed at it: WireGuard assigns it to the peer whose
// authenticated packets arrive on it, and roams that peer to it from the old stream. The
// returned endpoint's Done is closed when the stream ends. The stream must carry an
// authenticated packet within the Bind's AuthTimeout, as a reading of the device's state
// (Peers, PruneStreams, Attach) sees it, or it is detached; until then a newer stream may evict
// it when every slot is taken.
func (t *Tunnel) Attach(c net.Conn) (*bind.Endpoint, error) {
	// Record which streams carried authenticated packets since the last reading first, so
	// that a stream whose handshake just completed is not the one evicted for c.
	if _, err := t.Peers(); err != nil {
		_ = c.Close()
		return nil, err
	}
	ep, err := t.bind.Attach(c)
	if err != nil {
		return nil, fmt.Errorf("wg: %w", err)
	}
	return ep, nil
}

// AttachPeer adds c as a stream that the Tunnel now owns and makes it the endpoint of the peer
// with public key peer at once (the dialing side: the agent, after each successful dial). It
// sends a keepalive, which moves the other side to this stream if the current session is
// still valid, and starts a handshake, which re-establishes a session the other side lost (a
// restarted server). WireGuard sends at most one handshake initiation per 5 s (RekeyTimeout);
// a stream attached sooner after the previous one gets its handshake from the retry timer,
// within about 5 s.
func (t *Tunnel) AttachPeer(c net.Conn, peer Key) (*bind.Endpoint, error) {
	// A new stream often means a new server process (a restart): its WireGuard knows no session
	// of ours, and wireguard-go allows one handshake initiation per 5 s, so our stale session
	// would stay in use until a rekey timer fires (up to 2 min). Starting the peer afresh makes
	// the stream's first packet a handshake. A stream to the same server costs one handshake.
	if err := t.resetPeer(peer); err != nil {
		_ = c.Close()
		return nil, err
	}
	p := t.dev.LookupPeer(device.NoisePublicKey(peer))
	if p == nil {
		_ = c.Close()
		return nil, fmt.Errorf("wg: attach stream for peer %s: %w", peer, ErrUnknownPeer)
	}
	ep, err := t.bind.Attach(c)
	if err != nil {
		return nil, fmt.Errorf("wg: attach stream for peer %s: %w", peer, err)
	}
	// The dialing side chose this stream for peer itself: it is trusted from the start.
	ep.MarkAuthenticated(time.Now())
	p.SetEndpointFromPacket(ep)
	if err := t.startKeepalive(peer); err != nil {
		_ = ep.Close()
		return nil, err
	}
	p.SendKeepalive()
	if err := p.SendHandshakeInitiation(false); err != nil {
		// The stream failed already; its Done says so and the caller dials again.
		t.log.V(1).Info("handshake initiation on a new stream failed", "peer", peer.String(), "endpoint", ep.DstToString(), "error", err.Error())
	}
	return ep, nil
}

// startKeepalive turns the peer's persistent keepalive on, once, now that it has an endpoint.
// resetPeer removes peer from the device and adds it again with its allowed IPs: no session, no
// handshake state, no endpoint. The keepalive stays off until the caller has set the endpoint:
// turning it on sends at once, and a send without an endpoint would spend the one handshake
// initiation wireguard-go allows per 5 s.
func (t *Tunnel) resetPeer(peer Key) error {
	var cfg *Peer
	for i := range t.cfg.Peers {
		if t.cfg.Peers[i].PublicKey == peer {
			cfg = &t.cfg.Peers[i]
		}
	}
	if cfg == nil {
		return fmt.Errorf("wg: attach stream for peer %s: %w", peer, ErrUnknownPeer)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "public_key=%s\nremove=true\npublic_key=%s\npersistent_keepalive_interval=0\n", peer.hex(), peer.hex())
	for _, pfx := range cfg.AllowedIPs {
		fmt.Fprintf(&b, "allowed_ip=%s\n", pfx.Masked())
	}
	t.kaMu.Lock()
	defer t.kaMu.Unlock()
	if err := t.dev.IpcSet(b.String()); err != nil {
		return fmt.Errorf("wg: reset peer %s: %w", peer, err)
	}
	t.kaOn[peer] = false
	return nil
}

func (t *Tunnel) startKeepalive(peer Key) error {
	t.kaMu.Lock()
	defer t.kaMu.Unlock()
	if t.kaOn[peer] {
		return nil
	}
	var ka time.Duration
	for _, p := range t.cfg.Peers {
		if p.PublicKey == peer {
			ka = p.PersistentKeepalive
		}
	}
	if ka == 0 {
		return nil
	}
	err := t.dev.IpcSet(fmt.Sprintf("public_key=%s\nupdate_only=true\npersistent_keepalive_interval=%d\n", peer.hex(), int(ka/time.Second)))
	if err != nil {
		return fmt.Errorf("wg: start keepalive for peer %s: %w", peer, err)
	}
	t.kaOn[peer] = true
	return nil
}

// DialContext connects to addr (an IP literal with a port) over the tunnel. network is "tcp",
// "tcp4", "tcp6", "udp", "udp4" or "udp6". TCP connections can CloseWrite.
func (t *Tunnel) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := t.stack.DialContext(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("wg: %w", err) // the netstack's error names network and address
	}
	return c, nil
}

// Listen listens on addr ("[ip]:port", "ip:port" or ":port" for every local address) for
// network "tcp", "tcp4" or "tcp6" inside the tunnel.
func (t *Tunnel) Listen(network, addr string) (net.Listener, error) {
	switch network {
	case "tcp", "tcp4", "tcp6":
	default:
		return nil, fmt.Errorf("wg: listen %s %s: %w", network, addr, net.UnknownNetworkError(network))
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("wg: listen %s %s: %w", network, addr, err)
	}
	ap, err := netip.ParseAddrPort(net.JoinHostPort(orUnspecified(host, network), port))
	if err != nil {
		return nil, fmt.Errorf("wg: listen %s %s: %w", network, addr, err)
	}
	return t.ListenTCP(ap)
}

func orUnspecified(host, network string) string {
	switch {
	case host != "":
		return host
	case network == "tcp4":
		return "0.0.0.0"
	default:
		// gVisor's unspecified IPv6 listener accepts IPv4 too (dual stack).
		return "::"
	}
}

// ListenTCP listens on addr inside the tunnel; the unspecified address listens on every local
// address. With Forward on, the unspecified address needs exactly one local address of its
// family (see netstack.Stack.ListenTCP).
func (t *Tunnel) ListenTCP(addr netip.AddrPort) (net.Listener, error) {
	ln, err := t.stack.ListenTCP(addr)
	if err != nil {
		return nil, fmt.Errorf("wg: %w", err)
	}
	return ln, nil
}

// ListenUDP opens a UDP socket on addr inside the tunnel; the unspecified address receives on
// every local address.
func (t *Tunnel) ListenUDP(addr netip.AddrPort) (net.PacketConn, error) {
	c, err := t.stack.ListenUDP(addr)
	if err != nil {
		return nil, fmt.Errorf("wg: %w", err)
	}
	return c, nil
}

// Route makes peer the one the prefixes are routed to, taking them from whichever peer had
// them: WireGuard keeps each prefix with exactly one peer, both to pick where a packet goes and
// to check where a received packet may come from. Packets of connections that went through the
// previous peer now go to peer, which does not know them (its stack answers with a reset), and
// the previous peer's packets from those prefixes are dropped: those connections end. It is for
// the accepting side, whose peers AttachPeer never resets (a reset re-adds the peer's
// configured AllowedIPs, taking them back from whoever has them).
func (t *Tunnel) Route(peer Key, prefixes []netip.Prefix) error {
	var b strings.Builder
	fmt.Fprintf(&b, "public_key=%s\nupdate_only=true\n", peer.hex())
	for _, pfx := range prefixes {
		if !pfx.IsValid() {
			return fmt.Errorf("wg: route to peer %s: invalid prefix", peer)
		}
		fmt.Fprintf(&b, "allowed_ip=%s\n", pfx.Masked())
	}
	if t.dev.LookupPeer(device.NoisePublicKey(peer)) == nil {
		return fmt.Errorf("wg: route to peer %s: %w", peer, ErrUnknownPeer)
	}
	if err := t.dev.IpcSet(b.String()); err != nil {
		return fmt.Errorf("wg: route to peer %s: %w", peer, err)
	}
	if r, ok := t.stack.(interface{ AddRoutes([]netip.Prefix) error }); ok {
		// The kernel's stack routes into the device only what it was told to.
		if err := r.AddRoutes(prefixes); err != nil {
			return fmt.Errorf("wg: route to peer %s: %w", peer, err)
		}
	}
	return nil
}

// DetachPeer closes the stream that is peer's endpoint now, if it is still attached, and
// reports whether it closed one. Whatever WireGuard still sends to the peer fails at once
// instead of waiting for the stream's write timeout; the side that dialed the stream dials
// again.
func (t *Tunnel) DetachPeer(peer Key) (bool, error) {
	ps, err := t.Peers()
	if err != nil {
		return false, err
	}
	for _, p := range ps {
		if p.PublicKey != peer || p.Endpoint == "" {
			continue
		}
		ep, err := t.bind.ParseEndpoint(p.Endpoint)
		if err != nil {
			return false, nil // detached already
		}
		_ = ep.(*bind.Endpoint).Close()
		return true, nil
	}
	return false, nil
}

// PruneStreams detaches attached streams that are no peer's endpoint and have carried no
// authenticated packet for idle (since they were attached, if never): streams a peer left for a
// newer one (an agent that reconnected while the old path hung without closing). Frames that
// WireGuard did not accept do not count, so junk keeps no stream. Without it such a stream
// would hold its place among Bind.MaxStreams until its TCP connection ends (streams that never
// authenticated end at the Bind's AuthTimeout anyway). It returns how many it detached.
func (t *Tunnel) PruneStreams(idle time.Duration) (int, error) {
	ps, err := t.Peers()
	if err != nil {
		return 0, err
	}
	used := make(map[string]bool, len(ps))
	for _, p := range ps {
		used[p.Endpoint] = true
	}
	n := 0
	for _, ep := range t.bind.Endpoints() {
		last := ep.LastAuthenticated()
		if last.IsZero() {
			last = ep.Attached()
		}
		if !used[ep.DstToString()] && time.Since(last) > idle {
			ep.Prune()
			n++
		}
	}
	return n, nil
}

// BindStats returns the stream counters.
func (t *Tunnel) BindStats() bind.Stats { return t.bind.Stats() }

// StackStats returns the netstack's counters: forwarded connections, refusals by reason, and
// dropped packets by reason.
func (t *Tunnel) StackStats() netstack.Stats { return t.stack.Stats() }

// PeerStatus is the state of one peer, for health checks and metrics.
type PeerStatus struct {
	PublicKey Key
	// Endpoint is the stream the peer is reached over ("stream/7"), or "" before the first
	// authenticated packet (accepting side) or AttachPeer (dialing side). It may name a stream
	// that has ended since: Attached says whether it is still attached.
	Endpoint string
	Attached bool
	// LastReceive is when the peer's stream last delivered a frame (the zero Time unless
	// Attached). Every authenticated packet of the peer arrives on it: keepalives, heartbeats,
	// data.
	LastReceive time.Time
	// LastAuthenticated is when a reading of the device's state (any Peers, Attach or
	// PruneStreams call) first found that WireGuard had accepted more of the peer's packets
	// than at the reading before; the zero Time if none was ever seen. It lags the packet by
	// at most the interval between readings (tendril-server reads every 250 ms), and unlike
	// LastReceive no frame that WireGuard refused moves it.
	LastAuthenticated time.Time
	// LastHandshake is when the last handshake completed; the zero Time if none has. A
	// session lives at most 180 s after it (RejectAfterTime), and a healthy peer handshakes
	// again every 120 s while traffic flows (RekeyAfterTime).
	LastHandshake time.Time
	RxBytes       uint64
	TxBytes       uint64
}

// Peers returns every peer's status, in Config order.
func (t *Tunnel) Peers() ([]PeerStatus, error) {
	t.seenMu.Lock()
	defer t.seenMu.Unlock()
	t.state.Reset()
	if err := t.dev.IpcGetOperation(&t.state); err != nil {
		return nil, fmt.Errorf("wg: read device state: %w", err)
	}
	if err := parsePeers(t.state.Bytes(), t.byKey); err != nil {
		return nil, err
	}
	now := time.Now()
	st := make([]PeerStatus, 0, len(t.peers))
	for _, k := range t.peers {
		p, ok := t.byKey[k]
		if !ok {
			continue
		}
		var ep *bind.Endpoint
		if p.Endpoint != "" {
			if e, err := t.bind.ParseEndpoint(p.Endpoint); err == nil {
				ep = e.(*bind.Endpoint)
				p.Attached, p.LastReceive = true, ep.LastReceive()
			}
		}
		// rx_bytes only grows, except that AttachPeer's reset of a peer starts it at 0 again:
		// any other value than the last one means accepted packets.
		prev := t.seen[k]
		if p.RxBytes != prev.rx && p.RxBytes > 0 {
			prev.at = now
			// The peer's endpoint is the stream of the last packet WireGuard accepted from it.
			if ep != nil {
				ep.MarkAuthenticated(now)
			}
		}
		prev.rx = p.RxBytes
		t.seen[k] = prev
		p.LastAuthenticated = prev.at
		st = append(st, p)
	}
	return st, nil
}

// rxSeen is one peer's entry in Tunnel.seen.
type rxSeen struct {
	rx uint64
	at time.Time
}

// Close stops the device, detaches (and closes) every stream and shuts the netstack down:
// connections and listeners of the tunnel fail from then on. It returns nil; a second call does
// nothing.
func (t *Tunnel) Close() error {
	t.closeOnce.Do(func() {
		// Forwarded connections first, while the device runs: a Handler that queries the
		// Tunnel does not wait on the device's lock, which device.Close holds while it closes
		// the netstack, and their resets may still reach the server (best effort: closing
		// the device drops what WireGuard has not sent yet).
		t.stack.StopForwarding()
		t.muted.Store(true)
		t.dev.Close()
		<-t.dev.Wait()
	})
	return nil
}
