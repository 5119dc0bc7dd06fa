// Package modeltest generates synthetic shoot routes for scale tests and benchmarks: the i-th
// shoot of a set is always the same, so a set of any size is reproducible. It holds no
// assertions and is not used by production code.
package modeltest

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/tendril-net/tendril/xds/model"
)

// Shoot is the i-th shoot of a generated set: two server names, one kube-apiserver endpoint,
// an advertised address and one tunnel endpoint, which is what a Gardener shoot gives tendril.
func Shoot(i int) model.Shoot {
	return model.Shoot{
		Name: fmt.Sprintf("shoot--p%d--s%d", i/100, i),
		Hosts: []string{
			fmt.Sprintf("api.s%d.p%d.bench.tendril.local", i, i/100),
			fmt.Sprintf("api.s%d.p%d.internal.bench.tendril.local", i, i/100),
		},
		APIServers:        []netip.AddrPort{netip.AddrPortFrom(Addr(10, 0, i), 443)},
		AdvertisedAddress: Addr(100, 64, i),
		VPNServers:        []netip.AddrPort{netip.AddrPortFrom(Addr(10, 128, i), 8132)},
	}
}

// Addr is a.b.0.0 plus i+1: a distinct IPv4 address per shoot in a /16 (i < 65535).
func Addr(a, b byte, i int) netip.Addr {
	var v [4]byte
	binary.BigEndian.PutUint32(v[:], uint32(a)<<24|uint32(b)<<16+uint32(i+1))
	return netip.AddrFrom4(v)
}
