package failover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"time"

	"github.com/tendril-net/tendril/bench/internal/vethnet"
)

// topology is the benchmark's network. The seed is this process's namespace; the shoot gets
// one of its own, linked to the seed by a veth pair, and holds the "pod" on its loopback:
// the seed has no route to the pod, so only a tunnel reaches it.
//
//	seed (host)  veth 10.235.N.1/30 ⇄ 10.235.N.2/30  shoot (agents, OpenVPN client)
//	shoot        lo 10.236.N.2/32 (in 10.236.N.0/24)  the pod
//
// The OpenVPN peer adds a namespace per server (seedA, seedB), each linked to the shoot:
//
//	seedX        veth 10.237.N.{1,5}/30 ⇄ 10.237.N.{2,6}/30  shoot
//
// N is derived from the process ID, so that two runs on one machine do not collide; names
// carry the PID, so that namespaces a killed run left behind are recognised and removed.
type topology struct {
	run                 vethnet.Run
	shootNS             string
	seedAddr, shootAddr netip.Addr   // the seed ⇄ shoot link
	podAddr             netip.Addr   // in the shoot, on its loopback
	podNet              netip.Prefix // the shoot's pod network (the tunnels' only target)
	// ovpn are the OpenVPN servers' namespaces and their ends of the links to the shoot,
	// made by addOpenVPNSeeds.
	ovpnNS   []string
	ovpnAddr []netip.Addr
	ovpnPeer []netip.Addr // the shoot's end of each link
	// nodeNS are the tendril-server replicas' "nodes" and nodeAddr their ends of the links to
	// the seed, made by addServerNodes.
	nodeNS   []string
	nodeAddr []netip.Addr
}

const nsPrefix = "tbfo-"

var nsRE = regexp.MustCompile(`^` + nsPrefix + `(\d+)-`)

func newTopology(ctx context.Context) (*topology, error) {
	run, err := vethnet.Start(ctx, nsPrefix, nsRE)
	if err != nil {
		return nil, err
	}
	t := &topology{
		run: run, shootNS: run.NS("shoot"),
		seedAddr: run.Addr(235, 1), shootAddr: run.Addr(235, 2),
		podAddr: run.Addr(236, 2), podNet: netip.PrefixFrom(run.Addr(236, 0), 24),
	}
	id := run.ID()
	seedShoot, shootSeed := "tfs"+id, "tfsn"+id // veth names: at most 15 bytes
	s := t.shootNS
	steps := [][]string{{"netns", "add", s}}
	steps = append(steps, vethnet.Veth("", seedShoot, netip.PrefixFrom(t.seedAddr, 30), s, shootSeed, netip.PrefixFrom(t.shootAddr, 30))...)
	steps = append(steps,
		[]string{"-n", s, "link", "set", "lo", "up"},
		// On the shoot's loopback: local to the shoot, and no dummy module needed.
		[]string{"-n", s, "addr", "add", netip.PrefixFrom(t.podAddr, 32).String(), "dev", "lo"},
	)
	if err := vethnet.IP(ctx, steps...); err != nil {
		return nil, errors.Join(err, t.close())
	}
	return t, nil
}

// addOpenVPNSeeds makes n namespaces for OpenVPN servers, each linked to the shoot; those made
// by an earlier call stay.
func (t *topology) addOpenVPNSeeds(ctx context.Context, n int) error {
	id := t.run.ID()
	for i := len(t.ovpnNS); i < n; i++ {
		ns := t.run.NS(fmt.Sprintf("ovpn%d", i))
		own := t.run.Addr(237, byte(4*i+1))
		peer := own.Next()
		t.ovpnNS = append(t.ovpnNS, ns)
		if err := linkNS(ctx, ns, t.shootNS, fmt.Sprintf("tfo%d%s", i, id), fmt.Sprintf("tfon%d%s", i, id), own, peer); err != nil {
			return err
		}
		t.ovpnAddr, t.ovpnPeer = append(t.ovpnAddr, own), append(t.ovpnPeer, peer)
	}
	return nil
}

// linkNS makes the namespace ns (loopback up) and a veth pair between it and other (this
// process's namespace if empty): end dev in ns with own/30, end peerDev in other with peer/30.
func linkNS(ctx context.Context, ns, other, dev, peerDev string, own, peer netip.Addr) error {
	steps := [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "set", "lo", "up"},
	}
	steps = append(steps, vethnet.Veth(other, peerDev, netip.PrefixFrom(peer, 30), ns, dev, netip.PrefixFrom(own, 30))...)
	return vethnet.IP(ctx, steps...)
}

// close deletes the namespaces, and with them the veth pairs.
func (t *topology) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return vethnet.Delete(ctx, append(append([]string{t.shootNS}, t.ovpnNS...), t.nodeNS...)...)
}
