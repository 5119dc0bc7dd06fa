package apiserverproxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
)

// ensureAddress makes sure the dummy link name exists, is up and holds addr as a host address
// (/32 or /128). Scope is global, not host: Cilium's BPF masquerading breaks on host-scoped
// addresses (gardener/apiserver-proxy#168).
func ensureAddress(name string, addr netip.Addr) error {
	link, err := netlink.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		if err := netlink.LinkAdd(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: name}}); err != nil {
			return fmt.Errorf("create dummy link %s: %w", name, err)
		}
		if link, err = netlink.LinkByName(name); err != nil {
			return fmt.Errorf("dummy link %s: %w", name, err)
		}
	case err != nil:
		return fmt.Errorf("dummy link %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	bits := addr.BitLen()
	want := &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(bits, bits)}}
	family := netlink.FAMILY_V4
	if addr.Is6() {
		family = netlink.FAMILY_V6
	}
	have, err := netlink.AddrList(link, family)
	if err != nil {
		return fmt.Errorf("addresses of %s: %w", name, err)
	}
	for _, a := range have {
		if a.IPNet.IP.Equal(want.IP) {
			return nil
		}
	}
	if err := netlink.AddrAdd(link, want); err != nil {
		return fmt.Errorf("add %s to %s: %w", addr, name, err)
	}
	return nil
}
