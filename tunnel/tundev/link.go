package tundev

import (
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// handle is a netlink handle in the Stack's namespace, whichever thread uses it.
func (s *Stack) handle() (*netlink.Handle, netlink.Link, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(s.ns.Fd()))
	if err != nil {
		return nil, nil, fmt.Errorf("tundev: netlink: %w", err)
	}
	l, err := h.LinkByName(s.cfg.Name)
	if err != nil {
		h.Close()
		return nil, nil, fmt.Errorf("tundev: find %s: %w", s.cfg.Name, err)
	}
	return h, l, nil
}

// configureLink puts the inner addresses on the device and brings it up. IPv6 addresses skip
// duplicate address detection: nothing else is on the link, and a tentative address could not
// be bound for a second or more.
func (s *Stack) configureLink() error {
	h, l, err := s.handle()
	if err != nil {
		return err
	}
	defer h.Close()
	addrs := s.cfg.Addresses
	if s.cfg.Handler != nil && hasFamily(s.cfg.Forward, true) && !slices.ContainsFunc(addrs, netip.Addr.Is4) {
		addrs = append(slices.Clone(addrs), redirectAddr4)
	}
	for _, a := range addrs {
		a = a.Unmap()
		addr := &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, a.BitLen()))}
		if a.Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("tundev: add %s to %s: %w", a, s.cfg.Name, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("tundev: bring %s up: %w", s.cfg.Name, err)
	}
	return nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
