// Package modeltest generates synthetic shoot routes for scale tests and benchmarks: the i-th
// shoot of a set is always the same, so a set of any size is reproducible. It holds no
// assertions and is not used by production code. Termination gives a shoot the certificates
// of the terminating mode.
package modeltest

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
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

// Termination returns a valid terminating route for host: a serving certificate of a new CA
// (also kube-apiserver's, for the name kube-apiserver), a client CA, and a front-proxy
// certificate of a third.
func Termination(host string) (*model.Termination, error) {
	var cas [3]*testpki.CA
	for i := range cas {
		ca, err := testpki.NewCA(fmt.Sprintf("%s ca %d", host, i))
		if err != nil {
			return nil, err
		}
		cas[i] = ca
	}
	serving, err := cas[0].Leaf(host, "kube-apiserver")
	if err != nil {
		return nil, err
	}
	front, err := cas[2].Client("front-proxy", nil, time.Time{}, time.Time{})
	if err != nil {
		return nil, err
	}
	tm := &model.Termination{ClientCA: cas[1].PEM(), APIServerCA: cas[0].PEM(), APIServerName: "kube-apiserver"}
	if tm.ServingCert, tm.ServingKey, err = testpki.PEM(serving); err != nil {
		return nil, err
	}
	if tm.FrontProxyCert, tm.FrontProxyKey, err = testpki.PEM(front); err != nil {
		return nil, err
	}
	return tm, nil
}
