package tunnel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"regexp"
	"time"

	"github.com/tendril-net/tendril/bench/internal/impair"
	"github.com/tendril-net/tendril/bench/internal/vethnet"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// topology is the benchmark's network: the seed is this process's own
// namespace; the shoot and the pod get namespaces of their own, as in the
// reversed-VPN e2e test.
//
//	seed (host)  veth 10.231.N.1/30 ⇄ 10.231.N.2/30  shoot  (agents, OpenVPN client)
//	shoot        veth 10.232.N.1/24 ⇄ 10.232.N.2/24  pod    (the shoot's "pod network")
//	seed (host)  veth 10.233.N.1/30 ⇄ 10.233.N.2/30  pod    (direct: the physical limit)
//
// The pod's shoot address, podAddr, has no route from the seed: only a
// tunnel reaches it (an unreachable route in the seed keeps its packets from
// the seed's default route). The direct link gives the pod a second address that the
// seed reaches over one veth, for the direct target. The shoot forwards IPv4
// (OpenVPN's tun to the pod network); the pod's default route points back
// into the shoot. With an impairment the seed ⇄ shoot link is two TUN devices joined by
// package impair instead of a veth pair (same names and addresses), so that every tunnel's
// carrier crosses a link with loss and latency. N is derived from the process ID, so that two runs on one
// machine do not collide; names carry the PID, so that namespaces a killed
// run left behind are recognised and removed by the next.
type topology struct {
	run                  vethnet.Run
	shootNS, podNS       string
	seedAddr, shootAddr  netip.Addr   // the seed ⇄ shoot link
	podGW, podAddr       netip.Addr   // the shoot ⇄ pod link
	podNet               netip.Prefix // the shoot's pod network (the tunnels' only target)
	directSeed, directIP netip.Addr   // the seed ⇄ pod link
	vpnNet               netip.Prefix // OpenVPN's own tunnel network
	hostLinks            []string
	carrier              *impair.Link // the seed ⇄ shoot link when impaired; nil: a veth pair
}

const nsPrefix = "tbench-"

var nsRE = regexp.MustCompile(`^` + nsPrefix + `(\d+)-(shoot|pod)$`)

func newTopology(ctx context.Context, carrier *Impairment) (*topology, error) {
	run, err := vethnet.Start(ctx, nsPrefix, nsRE)
	if err != nil {
		return nil, err
	}
	a := run.Addr
	t := &topology{
		run:     run,
		shootNS: run.NS("shoot"), podNS: run.NS("pod"),
		seedAddr: a(231, 1), shootAddr: a(231, 2),
		podGW: a(232, 1), podAddr: a(232, 2), podNet: netip.PrefixFrom(a(232, 0), 24),
		directSeed: a(233, 1), directIP: a(233, 2),
		vpnNet: netip.PrefixFrom(a(234, 0), 24),
	}
	if err := t.setup(ctx, carrier); err != nil {
		return nil, errors.Join(err, t.close())
	}
	return t, nil
}

func (t *topology) setup(ctx context.Context, carrier *Impairment) error {
	id := t.run.ID()
	// veth names: at most 15 bytes.
	seedShoot, shootSeed := "tbs"+id, "tbsn"+id
	shootPod, podShoot := "tbp"+id, "tbpn"+id
	seedPod, podSeed := "tbd"+id, "tbdn"+id
	t.hostLinks = []string{seedShoot, seedPod}
	s, p := t.shootNS, t.podNS
	pfx := netip.PrefixFrom
	steps := [][]string{{"netns", "add", s}, {"netns", "add", p}}
	if carrier == nil {
		steps = append(steps, vethnet.Veth("", seedShoot, pfx(t.seedAddr, 30), s, shootSeed, pfx(t.shootAddr, 30))...)
	} else {
		if err := vethnet.IP(ctx, steps...); err != nil {
			return err
		}
		steps = nil
		var err error
		t.carrier, err = impair.NewLink(impair.LinkConfig{
			A:    impair.End{Name: seedShoot, Addr: pfx(t.seedAddr, 30)},
			B:    impair.End{NS: s, Name: shootSeed, Addr: pfx(t.shootAddr, 30)},
			AtoB: carrier.config(1), BtoA: carrier.config(2),
		})
		if err != nil {
			return fmt.Errorf("impaired carrier link: %w", err)
		}
	}
	steps = append(steps, []string{"-n", s, "link", "set", "lo", "up"})
	steps = append(steps, vethnet.Veth(s, shootPod, pfx(t.podGW, 24), p, podShoot, pfx(t.podAddr, 24))...)
	steps = append(steps,
		[]string{"-n", p, "link", "set", "lo", "up"},
		[]string{"-n", p, "route", "add", "default", "via", t.podGW.String()})
	steps = append(steps, vethnet.Veth("", seedPod, pfx(t.directSeed, 30), p, podSeed, pfx(t.directIP, 30))...)
	steps = append(steps,
		// Without a tunnel the seed must not send the pod network's
		// packets anywhere (its default route leads off this machine):
		// a low-priority unreachable route, below OpenVPN's own.
		[]string{"route", "add", "unreachable", t.podNet.String(), "metric", "4000"},
		[]string{"route", "add", "unreachable", t.vpnNet.String(), "metric", "4000"})
	if err := vethnet.IP(ctx, steps...); err != nil {
		return err
	}
	// The shoot routes OpenVPN's tun into the pod network.
	return netns.In(s, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644) })
}

// close deletes the namespaces (and with them the veth pairs) and any link
// left in the seed.
func (t *topology) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var errs []error
	if t.carrier != nil {
		errs = append(errs, t.carrier.Close())
	}
	errs = append(errs, vethnet.Delete(ctx, t.shootNS, t.podNS))
	for _, p := range []netip.Prefix{t.podNet, t.vpnNet} {
		_ = netns.IP(ctx, "route", "del", "unreachable", p.String(), "metric", "4000")
	}
	// Deleting a namespace deletes its veth ends and so their peers here,
	// asynchronously: a link is only an error if it outlives its own delete.
	for _, l := range t.hostLinks {
		if _, err := net.InterfaceByName(l); err == nil {
			if err := netns.IP(ctx, "link", "del", l); err != nil {
				if _, still := net.InterfaceByName(l); still == nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return errors.Join(errs...)
}

// impair sets the carrier link to imp; without an impaired link it does nothing.
func (t *topology) impair(imp Impairment) error {
	if t.carrier == nil {
		return nil
	}
	return t.carrier.Set(imp.config(1), imp.config(2))
}

// carrierStats are the carrier link's counts by direction, nil without an impaired link.
func (t *topology) carrierStats() map[string]impair.Stats {
	if t.carrier == nil {
		return nil
	}
	toShoot, fromShoot := t.carrier.Stats()
	return map[string]impair.Stats{ToShoot: toShoot, FromShoot: fromShoot}
}
