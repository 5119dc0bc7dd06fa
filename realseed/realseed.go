// Package realseed runs a real single-node Kubernetes cluster on this machine, the seed of
// `make seed` (tendril-local --real): etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler; a kubelet on containerd and runc with the bridge CNI plugin; kube-proxy;
// kube-router enforcing NetworkPolicies; CoreDNS as the cluster DNS (a pod, as on a Gardener
// seed); a local OCI registry on loopback that every image comes from; and a LoadBalancer shim
// that gives a LoadBalancer Service the node's address (what provider-local's service
// controller does in Gardener's own local setup). Each piece is the process an operator's node
// runs, started as root with the machine's own network, and Stop undoes what Start changed on
// the machine (mounts, network namespaces, the bridge, iptables tables, ipsets, cgroups,
// kernel parameters).
//
// It needs root, Debian's containerd, runc, CNI plugins, iptables, ipset, nftables and
// docker-registry, and the binaries that make testbin and make seedbin build. It takes
// shortcuts a one-machine cluster can afford (one system:masters token for every component, an
// anonymous kubelet, etcd without fsync) and is a developer tool, not part of a seed. It does
// not install tendril: Install does.
package realseed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/internal/host/procgroup"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
)

// The cluster's networks. Only these two leave the machine's guard closed (see guard).
const (
	PodCIDR      = "10.244.0.0/16"
	NodePodCIDR  = "10.244.0.0/24" // the node's share of PodCIDR (kube-controller-manager's --node-cidr-mask-size 24)
	ServiceCIDR  = "10.96.0.0/16"
	APIServiceIP = "10.96.0.1"  // the first address of ServiceCIDR: Service kubernetes
	DNSServiceIP = "10.96.0.10" // Service kube-dns, kubelet's clusterDNS
	// Bridge is the CNI bridge of the node's pods.
	Bridge = "tendril0"
	// NodeName is the node's name (kubelet, kube-proxy and kube-router agree on it).
	NodeName = "tendril-seed-node"
)

// The cluster's ports. There is one real seed per machine (Start takes a lock), so they are
// fixed; all lie below the ephemeral range (32768–60999), where no outgoing connection of
// another process takes them. kube-apiserver, the registry and the kubelet listen on the
// node's address or loopback, the rest on loopback.
const (
	APIServerPort        = 16443
	RegistryPort         = 15000
	etcdPort             = 23790
	etcdPeerPort         = 23800
	kubeletPort          = 10250
	kubeletHealthzPort   = 10248
	kcmPort              = 10257
	schedulerPort        = 10259
	kubeProxyMetricsPort = 10249
	kubeProxyHealthzPort = 10256
	kubeRouterHealthPort = 20244
)

// lockPath is the lock one real seed per machine holds.
const lockPath = "/run/tendril-realseed.lock"

// Config configures the cluster; the zero value works on a machine with the tools and binaries.
type Config struct {
	// Dir holds the cluster's state, configuration and logs; Start empties it first
	// (default: /var/tmp/tendril-realseed).
	Dir string
	// TestbinDir holds kube-apiserver, etcd and kubectl (make testbin's directory when empty).
	TestbinDir string
	// SeedbinDir holds kubelet, kube-proxy, kube-controller-manager, kube-scheduler,
	// kube-router and coredns (make seedbin's directory when empty).
	SeedbinDir string
	// BinDir holds tendril-pause, the sandbox image's process (the directory of the running
	// executable when empty: make build puts it beside tendril-local).
	BinDir string
	// Out receives progress lines (io.Discard when nil).
	Out io.Writer
	// WatchFor is how long the checks hold a watch through the ingress of a shoot with
	// per-request balancing, across a rotation of its serving certificate (a minute when
	// zero).
	WatchFor time.Duration
}

// Cluster is a running real seed.
type Cluster struct {
	cfg Config
	// NodeIP is the machine's address (the default route's source): the node's InternalIP,
	// kube-apiserver's address and every LoadBalancer Service's.
	NodeIP netip.Addr
	// Registry is the local registry's host:port (plain HTTP on loopback).
	Registry string
	// Kubeconfig is the admin kubeconfig's path, REST the same as a client configuration.
	Kubeconfig string
	REST       *rest.Config
	// Client is an admin client with tendril's scheme; kube the same as a clientset (exec,
	// logs, raw paths), made once.
	Client client.Client
	kube   kubernetes.Interface
	// Timings are how long each step of Start took, in order.
	Timings []Timing

	uplink     string
	procs      *procgroup.Group
	ended      map[string]<-chan struct{}
	host       *host
	lock       *os.File
	token      string
	pauseImage string
	// bg are the goroutines the cluster owns (the LoadBalancer shim, the seed's resource
	// manager); stopBG ends them.
	bg      sync.WaitGroup
	stopBG  context.CancelFunc
	grmCtx  context.Context
	started time.Time
	// dnsActuator writes the DNSRecords of the local provider for CoreDNS.
	dnsActuator *hostsActuator
	// nodes are the extra nodes StartNode made, shoots the shoots StartShoot made.
	nodes  []*Node
	shoots []*Shoot
	// probeImage is tendril-probe's image, pushed on the first ProbePod.
	probeOnce  sync.Once
	probeImage string
	probeErr   error
	// cpImages are the shoots' etcd and kube-apiserver images, pushed on the first StartShoot.
	cpOnce   sync.Once
	cpImages map[string]string
	cpErr    error
}

// Timing is one step of Start.
type Timing struct {
	Step string
	Took time.Duration
}

// DefaultDir is Config.Dir's default: not under /tmp, which some machines mount noexec.
const DefaultDir = "/var/tmp/tendril-realseed"

// Start brings the cluster up and returns once the node is Ready, kube-proxy, kube-router and
// CoreDNS serve and a cluster name resolves. On an error everything started is stopped and
// the machine restored.
func Start(ctx context.Context, cfg Config) (c *Cluster, err error) {
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Dir == "" {
		cfg.Dir = DefaultDir
	}
	if cfg.Dir, err = filepath.Abs(cfg.Dir); err != nil {
		return nil, err
	}
	if cfg.TestbinDir == "" {
		if cfg.TestbinDir, err = kubeenv.DefaultTestbinDir(); err != nil {
			return nil, err
		}
	}
	if cfg.SeedbinDir == "" {
		if cfg.SeedbinDir, err = DefaultSeedbinDir(); err != nil {
			return nil, err
		}
	}
	if cfg.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cfg.BinDir = filepath.Dir(exe)
	}
	if err := Preflight(cfg); err != nil {
		return nil, err
	}
	c = &Cluster{cfg: cfg, ended: map[string]<-chan struct{}{}, started: time.Now()}
	if c.NodeIP, c.uplink, err = uplink(); err != nil {
		return nil, err
	}
	c.Registry = net.JoinHostPort("127.0.0.1", strconv.Itoa(RegistryPort))
	if err := c.takeLock(); err != nil {
		return nil, err
	}
	c.procs = procgroup.New(context.WithoutCancel(ctx))
	c.grmCtx, c.stopBG = context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		if err != nil {
			if serr := c.Stop(context.WithoutCancel(ctx)); serr != nil {
				err = fmt.Errorf("%w (and stopping: %v)", err, serr)
			}
			c = nil
		}
	}()
	steps := []struct {
		name string
		run  func(context.Context) error
	}{
		{"machine prepared (forwarding, /run/netns, guard)", func(context.Context) error { return c.freshDirs() }},
		{"", func(context.Context) error { return c.prepare() }},
		{"registry serving", c.startRegistry},
		{"containerd serving", c.startContainerd},
		{"kube-apiserver ready", c.startAPIServer},
		{"controller manager and scheduler (default ServiceAccount)", c.startControllers},
		{"node Ready", c.startKubelet},
		{"kube-proxy healthy", c.startKubeProxy},
		{"kube-router healthy (NetworkPolicy enforcer)", c.startKubeRouter},
		{"CoreDNS resolving kubernetes.default.svc.cluster.local", c.startCoreDNS},
		{"Gardener's seed: namespace garden, CRDs, resource manager, PriorityClasses", c.gardenerSeed},
	}
	for _, s := range steps {
		t0 := time.Now()
		if err := s.run(ctx); err != nil {
			return c, err
		}
		if s.name != "" {
			c.Timings = append(c.Timings, Timing{s.name, time.Since(t0)})
			fmt.Fprintf(c.cfg.Out, "[%5.1fs] %s\n", time.Since(c.started).Seconds(), s.name)
		}
	}
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		c.loadBalancers(c.grmCtx)
	}()
	return c, nil
}

// Dir is the cluster's state directory.
func (c *Cluster) Dir() string { return c.cfg.Dir }

// Exited receives an error when one of the cluster's processes ends on its own.
func (c *Cluster) Exited() <-chan error { return c.procs.Exited() }

// takeLock holds lockPath for the cluster's life: a second real seed on the machine would
// fight the first for its ports, bridge and iptables rules.
func (c *Cluster) takeLock() error {
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("lock %s: %w", lockPath, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(lockPath)
		f.Close()
		return fmt.Errorf("another real seed runs on this machine (%s held by pid %s)", lockPath, strings.TrimSpace(string(holder)))
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	c.lock = f
	return nil
}

// freshDirs empties the state directory and makes its layout. A run that was killed before
// its Stop (SIGKILL, a test's timeout) left its processes, whose ids it wrote there, and their
// mounts: they are ended and unmounted first.
func (c *Cluster) freshDirs() error {
	if err := recoverKilledRun(c.cfg.Out); err != nil {
		return err
	}
	killStale(c.path("pids"))
	killShims(c.cfg.Dir) // the shims of every containerd under it: the nodes' too
	killCgroup("kubepods")
	killCgroup("tendril-node-*")
	for _, m := range mountsUnder(c.cfg.Dir) {
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
	removeStalePodNetns()
	if err := os.RemoveAll(c.cfg.Dir); err != nil {
		return fmt.Errorf("empty %s: %w", c.cfg.Dir, err)
	}
	for _, d := range []string{"etc/cni/net.d", "pki", "logs", "pids", "run/containerd", "var/etcd", "var/containerd", "var/kubelet", "var/cni", "var/log/pods", "var/registry"} {
		if err := os.MkdirAll(filepath.Join(c.cfg.Dir, d), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) path(p ...string) string {
	return filepath.Join(append([]string{c.cfg.Dir}, p...)...)
}

func (c *Cluster) logPath(name string) string {
	return c.path("logs", strings.ReplaceAll(name, " ", "-")+".log")
}

func (c *Cluster) containerdSocket() string { return c.path("run", "containerd", "containerd.sock") }

func (c *Cluster) seedbin(name string) string { return filepath.Join(c.cfg.SeedbinDir, name) }

func (c *Cluster) testbin(name string) string { return filepath.Join(c.cfg.TestbinDir, name) }

// start runs one of the cluster's processes in a session of its own.
func (c *Cluster) start(name, path string, args ...string) error {
	return c.startWith(name, procgroup.Options{Setsid: true}, path, args...)
}

// startWith runs one of the cluster's processes as o says and writes its id and binary into the
// state directory, where a later Start finds them if this run is killed.
func (c *Cluster) startWith(name string, o procgroup.Options, path string, args ...string) error {
	ended, err := c.procs.Start(name, c.logPath(name), o, path, args...)
	if err != nil {
		return err
	}
	c.ended[name] = ended
	if pid, ok := c.procs.Pid(name); ok {
		bin := path
		if filepath.Base(path) == "nsenter" && len(args) > 2 { // nsenter --net=… -- binary: it execs binary
			bin = args[2]
		}
		_ = os.WriteFile(c.path("pids", strings.ReplaceAll(name, " ", "-")), []byte(strconv.Itoa(pid)+" "+filepath.Base(bin)+"\n"), 0o644)
	}
	return nil
}

// removeStalePodNetns deletes the pods' network namespaces a killed run left: their veths stay
// on the bridge with the addresses the next run hands out again, and answer for the new pods
// (a probe of a new pod then meets the old pod's empty namespace: connection refused). They
// are containerd's (cni-…) with an address in the cluster's pod ranges.
func removeStalePodNetns() {
	ranges := []netip.Prefix{netip.MustParsePrefix(PodCIDR), netip.MustParsePrefix(ShootNetworks)}
	nss, _ := filepath.Glob("/run/netns/cni-*")
	for _, ns := range nss {
		out, err := exec.Command("ip", "-n", filepath.Base(ns), "-4", "-o", "addr", "show").Output()
		if err != nil {
			continue
		}
		ours := false
		for _, f := range strings.Fields(string(out)) {
			if p, err := netip.ParsePrefix(f); err == nil {
				for _, r := range ranges {
					ours = ours || r.Contains(p.Addr())
				}
			}
		}
		if ours {
			_ = exec.Command("ip", "netns", "del", filepath.Base(ns)).Run()
		}
	}
}

// killStale kills the processes whose ids a run that did not stop wrote into dir, if they still
// run the binary it wrote beside the id.
func killStale(dir string) {
	files, _ := os.ReadDir(dir)
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f.Name()))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(b))
		if len(fields) != 2 {
			continue
		}
		pid, err := strconv.Atoi(fields[0])
		if err != nil {
			continue
		}
		if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && strings.Contains(string(cmd), fields[1]) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// waitFor polls check until it passes, the process name ends or timeout passes; the error
// names the piece, says what the last check saw and ends with the process's log.
func (c *Cluster) waitFor(ctx context.Context, name, what string, timeout time.Duration, check func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		last = check(cctx)
		ccancel()
		if last == nil {
			return nil
		}
		var fatal *fatalError
		if errors.As(last, &fatal) {
			return fmt.Errorf("%s: no %s: %w", name, what, fatal.err)
		}
		select {
		case <-c.ended[name]:
			return fmt.Errorf("%s ended before %s (%v); its log %s ends:\n%s", name, what, last, c.logPath(name), procgroup.LogTail(c.logPath(name)))
		case <-ctx.Done():
			return fmt.Errorf("%s: no %s after %s (%v); its log %s ends:\n%s", name, what, timeout, last, c.logPath(name), procgroup.LogTail(c.logPath(name)))
		case <-tick.C:
		}
	}
}

// fatalError ends a waitFor at once: what it waits for cannot come (an image that cannot be
// pulled), and waiting out the deadline would only hide why.
type fatalError struct{ err error }

func (e *fatalError) Error() string { return e.err.Error() }
func (e *fatalError) Unwrap() error { return e.err }

// httpOK checks that url answers 200.
func httpOK(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", url, r.Status)
		}
		return nil
	}
}

func (c *Cluster) startRegistry(ctx context.Context) error {
	cfgPath := c.path("etc", "registry.yaml")
	// On every address (nodes in network namespaces of their own pull through their links to
	// the machine); the guard drops what comes for it through the uplink.
	listen := net.JoinHostPort("0.0.0.0", strconv.Itoa(RegistryPort))
	if err := render(registryYAML, map[string]string{"Dir": c.cfg.Dir, "Listen": listen}, cfgPath); err != nil {
		return err
	}
	if err := c.start("registry", "docker-registry", "serve", cfgPath); err != nil {
		return err
	}
	if err := c.waitFor(ctx, "registry", "answer on /v2/", 30*time.Second, httpOK("http://"+c.Registry+"/v2/")); err != nil {
		return err
	}
	var err error
	c.pauseImage, err = c.pushBinary(filepath.Join(c.cfg.BinDir, "tendril-pause"), "tendril/pause", "1")
	return err
}

func (c *Cluster) startContainerd(ctx context.Context) error {
	cfgPath := c.path("etc", "containerd.toml")
	data := map[string]any{"Dir": c.cfg.Dir, "ContainerdSocket": c.containerdSocket(), "PauseImage": c.pauseImage,
		"CNIBinDir": cniBinDir, "Registry": c.Registry, "RegistryEndpoint": c.Registry}
	if err := render(containerdTOML, data, cfgPath); err != nil {
		return err
	}
	if err := render(cniConflist, map[string]any{"Dir": c.cfg.Dir, "Bridge": Bridge, "NodePodCIDR": NodePodCIDR}, c.path("etc", "cni", "net.d", "10-tendril.conflist")); err != nil {
		return err
	}
	if err := c.start("containerd", "containerd", "--config", cfgPath); err != nil {
		return err
	}
	return c.waitFor(ctx, "containerd", "answer on its socket", 30*time.Second, func(ctx context.Context) error {
		return exec.CommandContext(ctx, "ctr", "--address", c.containerdSocket(), "version").Run()
	})
}

// pki writes the cluster's CA, kube-apiserver's serving certificate (for the node's address,
// Service kubernetes and its names, so that pods verify it against kube-root-ca.crt), the
// service-account signing key and the admin token, and the admin kubeconfig.
func (c *Cluster) pki() (err error) {
	if c.token, err = controlPlanePKI(c.path("pki"), "tendril real seed CA", c.NodeIP.String(), APIServiceIP, "127.0.0.1",
		"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"); err != nil {
		return err
	}
	c.Kubeconfig = c.path("etc", "kubeconfig")
	c.REST, c.kube, c.Client, err = adminKubeconfig(c.Kubeconfig, "tendril-seed", net.JoinHostPort(c.NodeIP.String(), strconv.Itoa(APIServerPort)),
		"", c.path("pki", "ca.crt"), c.token, 100)
	return err
}

func (c *Cluster) startAPIServer(ctx context.Context) error {
	if err := c.pki(); err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeerPort)
	if err := c.start("etcd", c.testbin("etcd"), "--data-dir", c.path("var", "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "default="+peerURL, "--unsafe-no-fsync"); err != nil {
		return err
	}
	if err := c.start("kube-apiserver", c.testbin("kube-apiserver"), "--etcd-servers", etcdURL,
		"--secure-port", strconv.Itoa(APIServerPort), "--bind-address", c.NodeIP.String(), "--advertise-address", c.NodeIP.String(),
		"--tls-cert-file", c.path("pki", "tls.crt"), "--tls-private-key-file", c.path("pki", "tls.key"),
		"--client-ca-file", c.path("pki", "ca.crt"),
		"--token-auth-file", c.path("pki", "tokens.csv"), "--authorization-mode", "Node,RBAC", "--allow-privileged=true",
		"--service-account-issuer", "https://kubernetes.default.svc", "--service-account-key-file", c.path("pki", "sa.pub"),
		"--service-account-signing-key-file", c.path("pki", "sa.key"), "--service-cluster-ip-range", ServiceCIDR,
		"--kubelet-preferred-address-types", "InternalIP"); err != nil {
		return err
	}
	return c.waitFor(ctx, "kube-apiserver", "/readyz", 2*time.Minute, func(ctx context.Context) error {
		return c.raw(ctx, "/readyz")
	})
}

// raw GETs path from kube-apiserver as admin.
func (c *Cluster) raw(ctx context.Context, path string) error {
	return c.kube.Discovery().RESTClient().Get().AbsPath(path).Do(ctx).Error()
}

func (c *Cluster) startControllers(ctx context.Context) error {
	kc := c.Kubeconfig
	if err := c.start("kube-controller-manager", c.seedbin("kube-controller-manager"), "--kubeconfig", kc,
		"--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--service-account-private-key-file", c.path("pki", "sa.key"), "--root-ca-file", c.path("pki", "ca.crt"),
		"--allocate-node-cidrs", "--cluster-cidr", PodCIDR, "--node-cidr-mask-size", "24", "--service-cluster-ip-range", ServiceCIDR,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(kcmPort),
		"--use-service-account-credentials=false"); err != nil {
		return err
	}
	if err := c.start("kube-scheduler", c.seedbin("kube-scheduler"), "--kubeconfig", kc,
		"--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(schedulerPort)); err != nil {
		return err
	}
	return c.waitFor(ctx, "kube-controller-manager", "default ServiceAccount", time.Minute, func(ctx context.Context) error {
		return c.raw(ctx, "/api/v1/namespaces/default/serviceaccounts/default")
	})
}

func (c *Cluster) startKubelet(ctx context.Context) error {
	cfgPath := c.path("etc", "kubelet.yaml")
	data := map[string]any{"Dir": c.cfg.Dir, "ContainerdSocket": c.containerdSocket(), "NodeIP": c.NodeIP,
		"KubeletPort": kubeletPort, "KubeletHealthzPort": kubeletHealthzPort, "DNSServiceIP": DNSServiceIP}
	if err := render(kubeletYAML, data, cfgPath); err != nil {
		return err
	}
	if err := c.start("kubelet", c.seedbin("kubelet"), "--config", cfgPath, "--kubeconfig", c.Kubeconfig,
		"--root-dir", c.path("var", "kubelet"), "--node-ip", c.NodeIP.String(), "--hostname-override", NodeName, "--v=2"); err != nil {
		return err
	}
	return c.waitFor(ctx, "kubelet", "Ready node "+NodeName, 3*time.Minute, func(ctx context.Context) error {
		return nodeReady(ctx, c.Client, NodeName)
	})
}

func (c *Cluster) startKubeProxy(ctx context.Context) error {
	return c.runKubeProxy(ctx, "kube-proxy", "", c.path("etc", "kube-proxy.yaml"), c.Kubeconfig, NodeName, PodCIDR,
		netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), kubeProxyHealthzPort), c.NodeIP)
}

// runKubeProxy starts a kube-proxy for node nodeName (in network namespace ns; the machine's
// when empty) with its configuration at cfgPath, and waits for its /healthz on healthz.
func (c *Cluster) runKubeProxy(ctx context.Context, name, ns, cfgPath, kubeconfig, nodeName, podCIDR string, healthz netip.AddrPort, nodeIP netip.Addr) error {
	data := map[string]any{"Kubeconfig": kubeconfig, "PodCIDR": podCIDR, "NodeName": nodeName, "NodeIP": nodeIP,
		"KubeProxyMetricsPort": kubeProxyMetricsPort, "HealthzAddress": healthz}
	if err := render(kubeProxyYAML, data, cfgPath); err != nil {
		return err
	}
	return c.startHealthy(ctx, name, ns, "http://"+healthz.String()+"/healthz", c.seedbin("kube-proxy"), "--config", cfgPath, "--v=2")
}

// startHealthy starts one of the cluster's daemons (in network namespace ns; the machine's when
// empty) and waits until health answers 200.
func (c *Cluster) startHealthy(ctx context.Context, name, ns, health, path string, args ...string) error {
	var err error
	if ns == "" {
		err = c.start(name, path, args...)
	} else {
		err = c.startIn(name, ns, path, args...)
	}
	if err != nil {
		return err
	}
	return c.waitFor(ctx, name, "/healthz", time.Minute, httpOK(health))
}

func (c *Cluster) startKubeRouter(ctx context.Context) error {
	return c.runKubeRouter(ctx, "kube-router", "", c.Kubeconfig, NodeName, ServiceCIDR, netip.MustParseAddr("127.0.0.1"))
}

// runKubeRouter starts kube-router as the NetworkPolicy enforcer (firewall only) of node
// nodeName (in network namespace ns; the machine's when empty) and waits for its /healthz on
// health (it listens on every address of its namespace).
func (c *Cluster) runKubeRouter(ctx context.Context, name, ns, kubeconfig, nodeName, serviceCIDR string, health netip.Addr) error {
	return c.startHealthy(ctx, name, ns, "http://"+netip.AddrPortFrom(health, kubeRouterHealthPort).String()+"/healthz", c.seedbin("kube-router"),
		"--kubeconfig", kubeconfig, "--hostname-override", nodeName,
		"--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-ipv4=true", "--enable-ipv6=false",
		"--service-cluster-ip-range", serviceCIDR, "--metrics-port", "0", "--health-port", strconv.Itoa(kubeRouterHealthPort), "--v=2")
}

// drainTimeout bounds how long Stop waits for kubelet to end the pods (and CNI to remove their
// interfaces and addresses) before it ends the daemons regardless.
const drainTimeout = time.Minute

// Stop ends the pods (through kubelet, so CNI tears their networking down), then every process,
// and restores the machine. It returns what it could not undo.
func (c *Cluster) Stop(ctx context.Context) error {
	// The seed's resource manager first: it would apply the drained Deployments again.
	if c.stopBG != nil {
		c.stopBG()
		c.bg.Wait()
	}
	var errs []error
	// The shoots' pods first, through their API servers, which are the seed's pods.
	for _, s := range c.shoots {
		if s.Node == nil || !c.running("kubelet") || !c.running("kubelet "+s.Node.cfg.Name) {
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, drainTimeout)
		if err := drain(dctx, s.Client); err != nil {
			errs = append(errs, fmt.Errorf("drain shoot %s: %w", s.cfg.Name, err))
		}
		cancel()
	}
	if c.Client != nil && c.running("kubelet") && c.running("kube-apiserver") {
		dctx, cancel := context.WithTimeout(ctx, drainTimeout)
		if err := drain(dctx, c.Client); err != nil {
			errs = append(errs, fmt.Errorf("drain: %w", err))
		}
		cancel()
	}
	if c.procs != nil {
		c.procs.Stop()
	}
	// The containerd shims outlive containerd by design; the containers under them end with
	// their cgroups.
	killShims(c.containerdSocket())
	killCgroup("kubepods")
	for _, n := range c.nodes {
		killShims(n.socket())
		killCgroup(n.cgroupRoot())
	}
	if err := c.restore(); err != nil {
		errs = append(errs, err)
	} else if c.host != nil {
		_ = os.Remove(baselinePath)
	}
	if c.lock != nil {
		c.lock.Close()
	}
	return errors.Join(errs...)
}

func (c *Cluster) running(name string) bool {
	ended, ok := c.ended[name]
	if !ok {
		return false
	}
	select {
	case <-ended:
		return false
	default:
		return true
	}
}

// killShims kills the containerd-shim-runc-v2 processes whose command line names socket.
func killShims(socket string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != "containerd-shim-runc-v2" || !strings.Contains(string(b), socket) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// killCgroup kills every process left in the cgroup name of any hierarchy (a container whose
// shim was killed), so that the cgroups can be removed.
func killCgroup(name string) {
	for attempt := 0; attempt < 10; attempt++ {
		pids := cgroupPids("/sys/fs/cgroup/*/" + name)
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// cgroupPids are the processes in the cgroups matching pattern and below them.
func cgroupPids(pattern string) []int {
	var pids []int
	roots, _ := filepath.Glob(pattern)
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}
