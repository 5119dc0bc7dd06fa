package failover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/tendril-net/tendril/internal/host/netns"
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
	pid, n              int
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
	if err := netns.Check(); err != nil {
		return nil, err
	}
	netns.RemoveStale(ctx, nsRE)
	pid := os.Getpid()
	n := pid%250 + 1
	a := func(b, c, d byte) netip.Addr { return netip.AddrFrom4([4]byte{10, b, c, d}) }
	t := &topology{
		pid: pid, n: n, shootNS: fmt.Sprintf("%s%d-shoot", nsPrefix, pid),
		seedAddr: a(235, byte(n), 1), shootAddr: a(235, byte(n), 2),
		podAddr: a(236, byte(n), 2), podNet: netip.PrefixFrom(a(236, byte(n), 0), 24),
	}
	id := strconv.Itoa(pid)
	seedShoot, shootSeed := "tfs"+id, "tfsn"+id // veth names: at most 15 bytes
	s := t.shootNS
	steps := [][]string{
		{"netns", "add", s},
		{"link", "add", seedShoot, "type", "veth", "peer", "name", shootSeed},
		{"link", "set", shootSeed, "netns", s},
		{"addr", "add", netip.PrefixFrom(t.seedAddr, 30).String(), "dev", seedShoot},
		{"link", "set", seedShoot, "up"},
		{"-n", s, "addr", "add", netip.PrefixFrom(t.shootAddr, 30).String(), "dev", shootSeed},
		{"-n", s, "link", "set", shootSeed, "up"},
		{"-n", s, "link", "set", "lo", "up"},
		// On the shoot's loopback: local to the shoot, and no dummy module needed.
		{"-n", s, "addr", "add", netip.PrefixFrom(t.podAddr, 32).String(), "dev", "lo"},
	}
	for _, st := range steps {
		if err := netns.IP(ctx, st...); err != nil {
			return nil, errors.Join(err, t.close())
		}
	}
	return t, nil
}

// addOpenVPNSeeds makes n namespaces for OpenVPN servers, each linked to the shoot.
func (t *topology) addOpenVPNSeeds(ctx context.Context, n int) error {
	id := strconv.Itoa(t.pid)
	for i := range n {
		ns := fmt.Sprintf("%s%d-ovpn%d", nsPrefix, t.pid, i)
		own := netip.AddrFrom4([4]byte{10, 237, byte(t.n), byte(4*i + 1)})
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
	on := func(namespace string, args ...string) []string {
		if namespace == "" {
			return args
		}
		return append([]string{"-n", namespace}, args...)
	}
	steps := [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "set", "lo", "up"},
		{"link", "add", dev, "type", "veth", "peer", "name", peerDev},
		{"link", "set", dev, "netns", ns},
		{"-n", ns, "addr", "add", netip.PrefixFrom(own, 30).String(), "dev", dev},
		{"-n", ns, "link", "set", dev, "up"},
	}
	if other != "" {
		steps = append(steps, []string{"link", "set", peerDev, "netns", other})
	}
	steps = append(steps, on(other, "addr", "add", netip.PrefixFrom(peer, 30).String(), "dev", peerDev), on(other, "link", "set", peerDev, "up"))
	for _, st := range steps {
		if err := netns.IP(ctx, st...); err != nil {
			return err
		}
	}
	return nil
}

// close deletes the namespaces, and with them the veth pairs.
func (t *topology) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var errs []error
	for _, ns := range append(append([]string{t.shootNS}, t.ovpnNS...), t.nodeNS...) {
		if _, err := os.Stat(filepath.Join("/run/netns", ns)); err == nil {
			errs = append(errs, netns.IP(ctx, "netns", "del", ns))
		}
	}
	return errors.Join(errs...)
}
