package realseed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/host/sysctl"
)

// guardTable is the nft table that keeps the cluster's traffic on this machine.
const guardTable = "tendril-seed-guard"

// touchedSysctls are the kernel parameters that Start, kubelet (protectKernelDefaults=false
// sets its defaults) and kube-proxy change; Stop puts back what they were.
var touchedSysctls = []string{
	"net.ipv4.ip_forward",
	"net.ipv4.conf.all.route_localnet",
	"vm.overcommit_memory", "vm.panic_on_oom",
	"kernel.panic", "kernel.panic_on_oops",
	"kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
}

// baselinePath holds the machine's state before the running real seed changed it (host), on
// tmpfs: after a reboot neither the file nor the changes are there.
const baselinePath = "/run/tendril-realseed.machine.json"

// iptablesTables are the nft tables iptables-nft (kube-proxy, kube-router, kubelet) creates;
// Stop deletes those that were not there at Start.
var iptablesTables = []string{"filter", "nat", "mangle", "raw", "security"}

// host is what the machine was like before Start changed it, for Stop to restore. Start also
// writes it to baselinePath and Stop removes that file once the machine is restored: a run
// killed before its Stop leaves the file, and the next Start restores the machine to it first
// (what is there then, the killed run's tables and ipsets among it, is not the baseline).
type host struct {
	// Dir is the run's state directory (its processes' ids, its mounts).
	Dir          string
	Sysctls      map[string]string
	NetnsBind    bool     // Start made /run/netns a bind mount
	NetnsBefore  []string // /run/netns entries at Start
	TablesBefore []string // nft tables at Start, "family name"
	IpsetsBefore []string
	DirsBefore   map[string]bool // /var/lib/kubelet, /var/log/containers existed
}

// uplink finds the machine's address and the link of its default route.
func uplink() (netip.Addr, string, error) {
	// TEST-NET-3: only the route lookup, no packet is sent.
	routes, err := netlink.RouteGet(net.ParseIP("203.0.113.1"))
	if err != nil || len(routes) == 0 {
		return netip.Addr{}, "", fmt.Errorf("default route: %v", err)
	}
	link, err := netlink.LinkByIndex(routes[0].LinkIndex)
	if err != nil {
		return netip.Addr{}, "", fmt.Errorf("default route's link: %w", err)
	}
	ip, ok := netip.AddrFromSlice(routes[0].Src)
	if !ok {
		return netip.Addr{}, "", errors.New("default route has no source address")
	}
	return ip.Unmap(), link.Attrs().Name, nil
}

// prepare sets up the machine for the node: IP forwarding, /run/netns shared (see below), and
// the guard. It records what it found so that restore can undo it.
func (c *Cluster) prepare() error {
	h := &host{Dir: c.cfg.Dir, Sysctls: map[string]string{}, DirsBefore: map[string]bool{}}
	c.host = h
	for _, k := range touchedSysctls {
		if v, err := sysctl.Get(k); err == nil {
			h.Sysctls[k] = v
		}
	}
	for _, d := range []string{"/var/lib/kubelet", "/var/log/containers"} {
		_, err := os.Stat(d)
		h.DirsBefore[d] = err == nil
	}
	h.NetnsBefore, _ = filepath.Glob("/run/netns/*")
	tables, err := nftTables()
	if err != nil {
		return err
	}
	h.TablesBefore = tables
	h.IpsetsBefore, err = ipsets()
	if err != nil {
		return err
	}
	b, err := json.Marshal(h)
	if err != nil {
		return err
	}
	if err := os.WriteFile(baselinePath, b, 0o644); err != nil {
		return fmt.Errorf("record the machine's state: %w", err)
	}
	if err := sysctl.Ensure("net.ipv4.ip_forward", "1"); err != nil {
		return err
	}
	// containerd keeps each pod's network namespace as an nsfs mount on a file in /run/netns.
	// When another process's `ip netns add` (tendril's own tests make namespaces) later makes
	// /run/netns a bind mount of itself, those mounts end up hidden under it and containerd can
	// no longer remove them: pods stay Terminating ("unlinkat …: device or resource busy").
	// Making the shared bind first, as ip netns would, leaves one mount that both use.
	if err := os.MkdirAll("/run/netns", 0o755); err != nil {
		return err
	}
	if !isMountPoint("/run/netns") {
		if err := unix.Mount("/run/netns", "/run/netns", "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /run/netns: %w", err)
		}
		if err := unix.Mount("", "/run/netns", "", unix.MS_SHARED, ""); err != nil {
			return fmt.Errorf("share /run/netns: %w", err)
		}
		h.NetnsBind = true
	}
	return c.guard()
}

// guard installs a table that drops anything leaving the uplink from the cluster's own ranges
// (the seed's pods, the nodes' links, the shoots' pods) or for one of them or a Service
// address, so no cluster traffic leaves the machine even while kube-proxy is down. Only those
// ranges: the machine's resolver is a private address behind the uplink,
// and dropping all private ranges would break every lookup. The hook is postrouting, not
// output: in output, oifname is the device chosen before kube-proxy's DNAT re-routed a packet,
// so host → ClusterIP packets would still read as leaving through the uplink.
func (c *Cluster) guard() error {
	rules := fmt.Sprintf(`table inet %[1]s {
  chain postrouting {
    type filter hook postrouting priority 10; policy accept;
    oifname %[2]q ip saddr { %[3]s, %[5]s, %[7]s } counter drop
    oifname %[2]q ip daddr { %[3]s, %[4]s, %[5]s, %[7]s } counter drop
  }
  # The registry listens on every address for the nodes' links; not for the uplink.
  chain input {
    type filter hook input priority 0; policy accept;
    iifname %[2]q tcp dport %[6]d counter drop
  }
}
`, guardTable, c.uplink, PodCIDR, ServiceCIDR, NodeLinkCIDR, RegistryPort, ShootNetworks)
	_ = exec.Command("nft", "delete", "table", "inet", guardTable).Run() // a table a killed run left
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft guard: %v: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// RecoverKilledRun puts the machine back as it was before a real seed that did not stop (killed,
// or its test timed out) changed it, unless a real seed runs now. Start does this itself;
// TestRealSeed calls it before it notes the machine's state.
func RecoverKilledRun(out io.Writer) error {
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil // a live run: the record is its own
	}
	return recoverKilledRun(out)
}

// recoverKilledRun does RecoverKilledRun's work for a caller that holds the lock: it ends the
// killed run's processes (by the ids in its state directory), shims and containers, removes its
// mounts, its pods' and nodes' network namespaces, and restores what its record says the machine
// was (tables, ipsets, the bridge, cgroups, kernel parameters).
func recoverKilledRun(out io.Writer) error {
	b, err := os.ReadFile(baselinePath)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var old host
	if err := json.Unmarshal(b, &old); err != nil {
		return fmt.Errorf("%s: %w", baselinePath, err)
	}
	if old.Dir != "" {
		killStale(filepath.Join(old.Dir, "pids"))
		killShims(old.Dir)
	}
	killShims(socketDir)
	killCgroup("kubepods")
	killCgroup("tendril-node-*")
	removeStalePodNetns()
	nss, _ := filepath.Glob("/run/netns/tendril-node-*")
	for _, ns := range nss {
		_ = netns.IP(context.Background(), "netns", "del", filepath.Base(ns))
	}
	if links, err := netlink.LinkList(); err == nil {
		for _, l := range links {
			if strings.HasPrefix(l.Attrs().Name, "tsnode") {
				_ = netlink.LinkDel(l)
			}
		}
	}
	cgs, _ := filepath.Glob("/sys/fs/cgroup/memory/tendril-node-*")
	for _, cg := range cgs {
		_ = removeCgroups(filepath.Base(cg))
	}
	killed := &Cluster{cfg: Config{Dir: old.Dir, Out: out}, host: &old}
	if err := killed.restore(); err != nil {
		return fmt.Errorf("restore the machine as the run that did not stop found it: %w", err)
	}
	fmt.Fprintf(out, "restored the machine as a real seed that did not stop (state %s) found it\n", old.Dir)
	return os.Remove(baselinePath)
}

// restore undoes prepare and what the node's daemons left once they have ended: their
// containers' mounts, network namespaces and cgroups, the bridge, the iptables tables and
// ipsets that were not there before, the guard, the kernel parameters. It goes on past errors
// and returns them all.
func (c *Cluster) restore() error {
	h := c.host
	if h == nil {
		return nil
	}
	var errs []error
	// Mounts under the state directory (overlay root file systems, shm, volumes), deepest first.
	for _, m := range mountsUnder(c.cfg.Dir) {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	now, _ := filepath.Glob("/run/netns/cni-*")
	for _, n := range now {
		if slices.Contains(h.NetnsBefore, n) {
			continue
		}
		_ = unix.Unmount(n, unix.MNT_DETACH)
		if err := os.Remove(n); err != nil {
			errs = append(errs, err)
		}
	}
	if h.NetnsBind {
		if rest, _ := os.ReadDir("/run/netns"); len(rest) == 0 {
			if err := unix.Unmount("/run/netns", 0); err != nil {
				errs = append(errs, fmt.Errorf("unmount /run/netns: %w", err))
			}
		}
	}
	if l, err := netlink.LinkByName(Bridge); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", Bridge, err))
		}
	}
	if err := deleteNewTables(h.TablesBefore); err != nil {
		errs = append(errs, err)
	}
	// ipsets after the tables whose rules refer to them.
	sets, err := ipsets()
	if err != nil {
		errs = append(errs, err)
	}
	for _, s := range sets {
		if slices.Contains(h.IpsetsBefore, s) {
			continue
		}
		if out, err := exec.Command("ipset", "destroy", s).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ipset destroy %s: %v: %s", s, err, bytes.TrimSpace(out)))
		}
	}
	errs = append(errs, removeCgroups("kubepods")...)
	for _, n := range c.nodes {
		errs = append(errs, removeCgroups(n.cgroupRoot())...)
		if err := n.remove(); err != nil {
			errs = append(errs, err)
		}
	}
	_ = os.RemoveAll(socketDir)
	for d, existed := range h.DirsBefore {
		if !existed {
			_ = os.RemoveAll(d)
		}
	}
	for k, v := range h.Sysctls {
		if now, err := sysctl.Get(k); err == nil && now != v {
			if err := sysctl.Ensure(k, v); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func nftTables() ([]string, error) {
	conn, err := nftables.New()
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	ts, err := conn.ListTables()
	if err != nil {
		return nil, fmt.Errorf("nft tables: %w", err)
	}
	var out []string
	for _, t := range ts {
		out = append(out, fmt.Sprintf("%d %s", t.Family, t.Name))
	}
	return out, nil
}

// deleteNewTables deletes the guard and the iptables tables that were not there before; tables of
// other owners (tendril's tunnel tests make tendril-* tables) stay.
func deleteNewTables(before []string) error {
	conn, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	ts, err := conn.ListTables()
	if err != nil {
		return fmt.Errorf("nft tables: %w", err)
	}
	for _, t := range ts {
		ours := t.Name == guardTable || (slices.Contains(iptablesTables, t.Name) && !slices.Contains(before, fmt.Sprintf("%d %s", t.Family, t.Name)))
		if ours {
			conn.DelTable(t)
		}
	}
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("delete nft tables: %w", err)
	}
	return nil
}

func ipsets() ([]string, error) {
	out, err := exec.Command("ipset", "list", "-n").Output()
	if err != nil {
		return nil, fmt.Errorf("ipset list: %w", err)
	}
	return strings.Fields(string(out)), nil
}

// mountsUnder lists the mount points at or below dir, deepest first.
func mountsUnder(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var ms []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMount(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			ms = append(ms, mp)
		}
	}
	sort.Slice(ms, func(i, j int) bool { return len(ms[i]) > len(ms[j]) })
	return ms
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isMountPoint(dir string) bool {
	for _, m := range mountsUnder(dir) {
		if m == dir {
			return true
		}
	}
	return false
}

// removeCgroups removes the cgroup name (kubelet's cgroupfs driver makes kubepods) in every
// hierarchy, deepest first.
func removeCgroups(name string) []error {
	var errs []error
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + name)
	if _, err := os.Stat("/sys/fs/cgroup/" + name); err == nil {
		roots = append(roots, "/sys/fs/cgroup/"+name)
	}
	for _, r := range roots {
		var dirs []string
		_ = filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		slices.Reverse(dirs)
		for _, d := range dirs {
			if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
				break
			}
		}
	}
	return errs
}
