package realseed

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/host/procgroup"
)

// NodeLinkCIDR holds the links between the machine and the extra nodes: node i has
// 10.198.i.0/30, the machine .1, the node .2. The guard keeps it on the machine too.
const NodeLinkCIDR = "10.198.0.0/16"

// NodeConfig is one more node: a kubelet with a containerd of its own, in a network namespace
// of its own joined to the machine by a veth pair, registered with the API server Kubeconfig
// names (the seed's, or a shoot's: a shoot's node).
type NodeConfig struct {
	// Name is the node's name; Index (1–250) numbers its link and namespace.
	Name  string
	Index int
	// Kubeconfig is the API server the kubelet registers with (the seed's when empty).
	Kubeconfig string
	// PodCIDR is the range of its pods' addresses, on a bridge inside its namespace; the
	// machine routes it to the node.
	PodCIDR string
	// ClusterDNS is kubelet's clusterDNS (the seed's kube-dns when empty).
	ClusterDNS string
	// KubeProxy runs a kube-proxy in the node's namespace too, against the same API server: the
	// node's pods and processes then reach that cluster's Services (a shoot's node).
	KubeProxy bool
	// NetworkPolicy runs a kube-router (firewall only) in the node's namespace too, against the
	// same API server: that cluster's NetworkPolicies are then enforced for the node's pods.
	// ServiceCIDR is that cluster's Service range, which kube-router needs.
	NetworkPolicy bool
	ServiceCIDR   string
}

// Node is a running extra node.
type Node struct {
	cfg NodeConfig
	// IP is its address (the node's end of its link), where the API server reaches the kubelet.
	IP   netip.Addr
	host netip.Addr
	dir  string
}

func (n *Node) netns() string           { return fmt.Sprintf("tendril-node-%d", n.cfg.Index) }
func (n *Node) hostLink() string        { return fmt.Sprintf("tsnode%d", n.cfg.Index) }
func (n *Node) cgroupRoot() string      { return fmt.Sprintf("tendril-node-%d", n.cfg.Index) }
func (n *Node) path(p ...string) string { return filepath.Join(append([]string{n.dir}, p...)...) }

// socket is the node's containerd socket, outside its state directory: containerd refuses a
// socket path longer than 104 bytes (with its .ttrpc suffix), which a test's temporary
// directory reaches.
func (n *Node) socket() string {
	return filepath.Join(socketDir, fmt.Sprintf("node-%d.sock", n.cfg.Index))
}

// maxSocketPath is the longest Unix socket path: sun_path's 108 bytes less the terminating NUL.
const maxSocketPath = 107

// socketDir holds the extra nodes' containerd sockets (one real seed per machine: a fixed path).
const socketDir = "/run/tendril-realseed"

// StartNode starts the node and returns once it is Ready. Stop ends it with the cluster.
func (c *Cluster) StartNode(ctx context.Context, cfg NodeConfig) (*Node, error) {
	if cfg.Index < 1 || cfg.Index > 250 || cfg.Name == "" || cfg.PodCIDR == "" {
		return nil, fmt.Errorf("node %q: a name, an index 1–250 and a pod range are required", cfg.Name)
	}
	if cfg.NetworkPolicy && cfg.ServiceCIDR == "" {
		return nil, fmt.Errorf("node %s: NetworkPolicy needs the cluster's Service range", cfg.Name)
	}
	cfg.Kubeconfig = cmp.Or(cfg.Kubeconfig, c.Kubeconfig)
	cfg.ClusterDNS = cmp.Or(cfg.ClusterDNS, DNSServiceIP)
	pods, err := netip.ParsePrefix(cfg.PodCIDR)
	if err != nil {
		return nil, fmt.Errorf("node %s: pod range: %w", cfg.Name, err)
	}
	n := &Node{cfg: cfg, dir: c.path("nodes", cfg.Name),
		host: netip.AddrFrom4([4]byte{10, 198, byte(cfg.Index), 1}), IP: netip.AddrFrom4([4]byte{10, 198, byte(cfg.Index), 2})}
	// kubelet binds Unix sockets under its root directory (pod-resources/<10 digits> the longest),
	// and a socket path has at most 107 bytes: say so instead of a kubelet that exits.
	if p := n.path("var", "kubelet", "pod-resources", "0123456789"); len(p) > maxSocketPath {
		return nil, fmt.Errorf("node %s: the state directory %s is too long for kubelet's sockets (%s has %d bytes, at most %d)", cfg.Name, c.cfg.Dir, p, len(p), maxSocketPath)
	}
	c.nodes = append(c.nodes, n)
	for _, d := range []string{"etc/cni/net.d", "run/containerd", "var/containerd", "var/kubelet", "var/cni", "var/log/pods"} {
		if err := os.MkdirAll(n.path(d), 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(socketDir, 0o700); err != nil {
		return nil, err
	}
	if err := n.link(ctx, pods); err != nil {
		return nil, err
	}
	ctrdCfg := n.path("etc", "containerd.toml")
	if err := render(containerdTOML, map[string]any{"Dir": n.dir, "ContainerdSocket": n.socket(), "PauseImage": c.pauseImage,
		"CNIBinDir": cniBinDir, "Registry": c.Registry, "RegistryEndpoint": fmt.Sprintf("%s:%d", n.host, RegistryPort)}, ctrdCfg); err != nil {
		return nil, err
	}
	if err := render(cniConflist, map[string]any{"Dir": n.dir, "Bridge": "cbr0", "NodePodCIDR": cfg.PodCIDR}, n.path("etc", "cni", "net.d", "10-tendril.conflist")); err != nil {
		return nil, err
	}
	name := "containerd " + cfg.Name
	if err := c.startIn(name, n.netns(), "containerd", "--config", ctrdCfg); err != nil {
		return nil, err
	}
	if err := c.waitFor(ctx, name, "answer on its socket", 30*time.Second, func(ctx context.Context) error {
		return exec.CommandContext(ctx, "ctr", "--address", n.socket(), "version").Run()
	}); err != nil {
		return nil, err
	}
	if err := makeCgroup(n.cgroupRoot()); err != nil {
		return nil, fmt.Errorf("node %s: %w", cfg.Name, err)
	}
	kcfg := n.path("etc", "kubelet.yaml")
	if err := render(kubeletYAML, map[string]any{"Dir": n.dir, "ContainerdSocket": n.socket(), "NodeIP": n.IP,
		"KubeletPort": kubeletPort, "KubeletHealthzPort": kubeletHealthzPort, "DNSServiceIP": cfg.ClusterDNS,
		"CgroupRoot": "/" + n.cgroupRoot()}, kcfg); err != nil {
		return nil, err
	}
	name = "kubelet " + cfg.Name
	if err := c.startIn(name, n.netns(), c.seedbin("kubelet"), "--config", kcfg, "--kubeconfig", cfg.Kubeconfig,
		"--root-dir", n.path("var", "kubelet"), "--node-ip", n.IP.String(), "--hostname-override", cfg.Name, "--v=2"); err != nil {
		return nil, err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return nil, err
	}
	cl, err := client.New(rc, client.Options{})
	if err != nil {
		return nil, err
	}
	if err := c.waitFor(ctx, name, "Ready node "+cfg.Name, 3*time.Minute, func(ctx context.Context) error {
		return nodeReady(ctx, cl, cfg.Name)
	}); err != nil {
		return n, err
	}
	if cfg.KubeProxy {
		// Its health port on the node's address, which the machine reaches; the namespace's
		// loopback is the node's own.
		if err := c.runKubeProxy(ctx, "kube-proxy "+cfg.Name, n.netns(), n.path("etc", "kube-proxy.yaml"), cfg.Kubeconfig, cfg.Name,
			cfg.PodCIDR, netip.AddrPortFrom(n.IP, kubeProxyHealthzPort), n.IP); err != nil {
			return n, err
		}
	}
	if cfg.NetworkPolicy {
		name := "kube-router " + cfg.Name
		if err := c.runKubeRouter(ctx, name, n.netns(), cfg.Kubeconfig, cfg.Name, cfg.ServiceCIDR, n.IP); err != nil {
			return n, err
		}
	}
	return n, nil
}

// makeCgroup makes cgroup name in every hierarchy (kubelet wants its cgroupRoot to exist); a
// new cpuset gets its parent's CPUs and memory nodes, without which nothing can join it.
func makeCgroup(name string) error {
	hs, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, h := range hs {
		if fi, err := os.Stat(h); err != nil || !fi.IsDir() {
			continue
		}
		d := filepath.Join(h, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", filepath.Join(d, f), err)
				}
			}
		}
	}
	return nil
}

// link makes the node's namespace and its veth pair, forwarding inside it, and the machine's
// route to its pods.
func (n *Node) link(ctx context.Context, pods netip.Prefix) error {
	_ = n.remove() // what a killed run left
	peer := fmt.Sprintf("tsnode%dn", n.cfg.Index)
	for _, args := range [][]string{
		{"netns", "add", n.netns()},
		{"link", "add", n.hostLink(), "type", "veth", "peer", "name", peer},
		{"link", "set", peer, "netns", n.netns()},
		{"addr", "add", n.host.String() + "/30", "dev", n.hostLink()},
		{"link", "set", n.hostLink(), "up"},
		{"-n", n.netns(), "addr", "add", n.IP.String() + "/30", "dev", peer},
		{"-n", n.netns(), "link", "set", peer, "up"},
		{"-n", n.netns(), "link", "set", "lo", "up"},
		{"-n", n.netns(), "route", "add", "default", "via", n.host.String()},
		{"route", "add", pods.String(), "via", n.IP.String()},
	} {
		if err := netns.IP(ctx, args...); err != nil {
			return fmt.Errorf("node %s: %w", n.cfg.Name, err)
		}
	}
	// Inside the namespace the node forwards between its link and its pods' bridge.
	if out, err := exec.CommandContext(ctx, "ip", "netns", "exec", n.netns(), "sysctl", "-qw", "net.ipv4.ip_forward=1").CombinedOutput(); err != nil {
		return fmt.Errorf("node %s: forwarding: %v: %s", n.cfg.Name, err, out)
	}
	return nil
}

// remove deletes the node's namespace (its links and routes go with it) and its link.
func (n *Node) remove() error {
	_ = netns.IP(context.Background(), "netns", "del", n.netns())
	_ = netns.IP(context.Background(), "link", "del", n.hostLink())
	return nil
}

// startIn runs one of the cluster's processes in network namespace ns. Through nsenter, which
// enters the network namespace only: ip netns exec would also give it a mount namespace with a
// fresh /sys, without the cgroup hierarchies kubelet manages.
func (c *Cluster) startIn(name, ns, path string, args ...string) error {
	return c.startWith(name, procgroup.Options{Setsid: true}, "nsenter", append([]string{"--net=/run/netns/" + ns, "--", path}, args...)...)
}
