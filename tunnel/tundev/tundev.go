// Package tundev gives a WireGuard tunnel (package wg) the kernel's TCP/IP stack in place of the
// userspace netstack: a TUN device that carries the tunnel's inner addresses, routes to the
// peers' prefixes through it, sockets of package net bound to it, and, at the forwarding end
// (the shoot's agent), the kernel's IP forwarding into the configured prefixes behind a
// masquerade, as Gardener's vpn-shoot forwards. An nftables table of its own admits from the
// device only replies to this end's connections, the ports opened through the Stack and, when
// forwarding, new connections into the prefixes; every other packet from the device is dropped
// and counted. The kernel's TCP is what makes it fast: segmentation offloads on the device,
// and no userspace TCP at either end.
//
// It needs CAP_NET_ADMIN in its network namespace (vpn-seed-server and vpn-shoot have it) and,
// to forward, writable forwarding sysctls. Its device, routes and table are made in the network
// namespace of the thread that calls New, and its sockets in that of the thread that dials or
// listens: for the binaries, the process's one namespace. It does not encrypt (wireguard-go
// does), and it runs no handler for forwarded connections: the kernel forwards them, so
// package netstack's per-connection limits and counters do not apply.
package tundev

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"golang.zx2c4.com/wireguard/tun"

	"github.com/tendril-net/tendril/internal/host/sysctl"
	"github.com/tendril-net/tendril/tunnel/netstack"
)

// Config describes a Stack. Name and Addresses are required.
type Config struct {
	// Name is the TUN device's name (at most 15 bytes); a device of that name must not exist.
	Name string
	// Addresses are this end's inner addresses, put on the device.
	Addresses []netip.Addr
	// MTU is the device's MTU. 0 means netstack.DefaultMTU.
	MTU int
	// Routes are the prefixes routed into the device: the peers' allowed prefixes. Dials reach
	// nothing else (their sockets are bound to the device).
	Routes []netip.Prefix
	// Forward are the prefixes the kernel forwards to from the device, with the source
	// masqueraded to this end's address on the way out (the agent: the shoot's node, pod and
	// service networks). Empty: nothing is forwarded.
	Forward []netip.Prefix
	// Handler, if set, serves the TCP connections into Forward instead of the kernel's
	// forwarding: the table redirects them to a listener of the Stack (the agent then dials
	// each destination itself, as with the userspace netstack, and the tunnel keeps its large
	// MTU where the kernel would forward into the pod network's 1500 bytes). UDP into Forward
	// is forwarded by the kernel either way.
	Handler Handler
}

// Stack is a TUN device with the kernel's TCP/IP stack behind it. It is a wireguard-go
// tun.Device; its other methods are what package wg uses of a stack.
type Stack struct {
	tun.Device
	cfg    Config
	ns     *os.File // the network namespace New ran in
	rules  *rules
	fwd    *forwarder // with Config.Handler
	mu     sync.Mutex // routes, and the rules' connection
	routes []netip.Prefix
}

// New creates the device in the calling thread's network namespace, brings it up with its
// addresses and routes, and installs the table (and the forwarding sysctls if Forward is set).
func New(cfg Config) (_ *Stack, err error) {
	if cfg.Name == "" || len(cfg.Name) > unix.IFNAMSIZ-1 {
		return nil, fmt.Errorf("tundev: device name %q: want 1 to %d bytes", cfg.Name, unix.IFNAMSIZ-1)
	}
	if len(cfg.Addresses) == 0 {
		return nil, errors.New("tundev: no inner address")
	}
	if cfg.MTU == 0 {
		cfg.MTU = netstack.DefaultMTU
	}
	ns, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, fmt.Errorf("tundev: own network namespace: %w", err)
	}
	s := &Stack{cfg: cfg, ns: ns}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.Device, err = tun.CreateTUN(cfg.Name, cfg.MTU); err != nil {
		return nil, fmt.Errorf("tundev: create %s (needs CAP_NET_ADMIN and /dev/net/tun): %w", cfg.Name, err)
	}
	if err := s.configureLink(); err != nil {
		return nil, err
	}
	if err := s.AddRoutes(cfg.Routes); err != nil {
		return nil, err
	}
	var redirect map[int]uint16
	if cfg.Handler != nil && len(cfg.Forward) > 0 {
		if s.fwd, err = s.startForwarder(cfg.Handler); err != nil {
			return nil, err
		}
		redirect = s.fwd.ports
	}
	if s.rules, err = installRules(int(ns.Fd()), cfg, redirect); err != nil {
		return nil, fmt.Errorf("tundev: nftables: %w", err)
	}
	if len(cfg.Forward) > 0 {
		if err := enableForwarding(cfg.Forward); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// enableForwarding turns on the kernel's forwarding for the families of prefixes, unless it
// is on already (a container's /proc/sys is read-only; in a pod an init container sets it). It
// is a setting of the whole namespace (the table above limits what comes from the device).
func enableForwarding(prefixes []netip.Prefix) error {
	for _, name := range sysctl.Forwarding(prefixes) {
		if err := sysctl.Ensure(name, "1"); err != nil {
			return fmt.Errorf("tundev: enable forwarding (in a pod: set by a privileged init container): %w", err)
		}
	}
	return nil
}

// AddRoutes routes prefixes into the device too (a peer took over prefixes it was not
// configured with). Routes already there are kept.
func (s *Stack) AddRoutes(prefixes []netip.Prefix) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var h *netlink.Handle
	var l netlink.Link
	for _, p := range prefixes {
		p = p.Masked()
		if slices.Contains(s.routes, p) {
			continue
		}
		if h == nil { // one netlink handle for the batch, none if nothing is new
			var err error
			if h, l, err = s.handle(); err != nil {
				return err
			}
			defer h.Close()
		}
		if err := h.RouteReplace(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: ipNet(p), Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("tundev: route %s into %s: %w", p, s.cfg.Name, err)
		}
		s.routes = append(s.routes, p)
	}
	return nil
}

// ErrNoRoute reports a dial to an address that is not routed into the device.
var ErrNoRoute = errors.New("not routed into the tunnel")

// DialContext connects to addr (an IP literal with a port) through the device; network is
// "tcp", "tcp4", "tcp6", "udp", "udp4" or "udp6". An address outside the routes fails at once
// with ErrNoRoute (and the socket is bound to the device, so that nothing leaves this end's
// namespace any other way).
func (s *Stack) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	switch network {
	case "tcp", "tcp4", "tcp6", "udp", "udp4", "udp6":
	default:
		return nil, fmt.Errorf("tundev: dial %s %s: %w", network, addr, net.UnknownNetworkError(network))
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("tundev: dial %s %s: want an IP literal and a port: %w", network, addr, err)
	}
	if !s.routed(ap.Addr().Unmap()) {
		return nil, fmt.Errorf("tundev: dial %s %s: %w", network, addr, ErrNoRoute)
	}
	d := net.Dialer{Control: s.bindToDevice}
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("tundev: %w", err)
	}
	return c, nil
}

func (s *Stack) routed(a netip.Addr) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return inside(s.routes, a)
}

// inside reports whether a prefix of prefixes contains a.
func inside(prefixes []netip.Prefix, a netip.Addr) bool {
	return slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { return p.Contains(a) })
}

// ListenTCP listens on addr, for connections through the device only, and admits new
// connections from the device to its port.
func (s *Stack) ListenTCP(addr netip.AddrPort) (net.Listener, error) {
	lc := net.ListenConfig{Control: s.bindToDevice}
	l, err := lc.Listen(context.Background(), "tcp", addr.String())
	if err != nil {
		return nil, fmt.Errorf("tundev: %w", err)
	}
	if err := s.admit(unix.IPPROTO_TCP, l.Addr().(*net.TCPAddr).AddrPort().Port()); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// ListenUDP opens a UDP socket on addr, for datagrams through the device only, and admits
// datagrams from the device to its port.
func (s *Stack) ListenUDP(addr netip.AddrPort) (net.PacketConn, error) {
	lc := net.ListenConfig{Control: s.bindToDevice}
	c, err := lc.ListenPacket(context.Background(), "udp", addr.String())
	if err != nil {
		return nil, fmt.Errorf("tundev: %w", err)
	}
	if err := s.admit(unix.IPPROTO_UDP, c.LocalAddr().(*net.UDPAddr).AddrPort().Port()); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (s *Stack) admit(proto byte, port uint16) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.rules.admit(proto, port); err != nil {
		return fmt.Errorf("tundev: admit port %d from %s: %w", port, s.cfg.Name, err)
	}
	return nil
}

func (s *Stack) bindToDevice(_, _ string, rc syscall.RawConn) error {
	var serr error
	err := rc.Control(func(fd uintptr) { serr = unix.BindToDevice(int(fd), s.cfg.Name) })
	return errors.Join(err, serr)
}

// StopForwarding ends the Handlers' connections and waits for the Handlers (Config.Handler);
// what the kernel forwards ends at Close, with the rules that let it.
func (s *Stack) StopForwarding() {
	if s.fwd != nil {
		s.fwd.stop()
	}
}

// Stats reports the packets from the device that the table dropped (as DropNotTCP: neither a
// reply, nor to an admitted port, nor into a forwarded prefix) and, with a Handler, the
// connections it was given (Forwarded, ForwardActive) and those that reached its listener
// without a redirect (Refused[RefusedOutside]). The kernel keeps no other count per tunnel.
func (s *Stack) Stats() netstack.Stats {
	var st netstack.Stats
	if f := s.fwd; f != nil {
		st.Forwarded = f.accepted.Load()
		st.Refused[netstack.RefusedOutside] = f.outside.Load()
		st.ForwardActive = f.active()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rules != nil {
		st.Dropped[netstack.DropNotTCP] = s.rules.dropped()
	}
	return st
}

// Close removes the table and the device (and with it its addresses and routes). wireguard-go
// calls it when its device closes.
func (s *Stack) Close() error {
	s.StopForwarding()
	var errs []error
	s.mu.Lock()
	if s.rules != nil {
		errs = append(errs, s.rules.remove())
		s.rules = nil
	}
	s.mu.Unlock()
	if s.Device != nil {
		errs = append(errs, s.Device.Close())
	}
	if s.ns != nil {
		s.ns.Close()
	}
	return errors.Join(errs...)
}
