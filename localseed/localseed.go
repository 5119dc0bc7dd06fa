// Package localseed runs a whole local seed for `make run`: a seed API server (envtest's
// etcd + kube-apiserver with the Gardener and tendril CRDs), tendril's control plane
// in-process, tendril-ingress on loopback, and shoots that each have their own real
// kube-apiserver. It creates the seed objects Gardener would (namespace, Cluster, the
// kube-apiserver Service with its EndpointSlice, the Extension) and then plays kubelet,
// kube-proxy and the endpoint-slice controller for what the extension declared: it starts
// tendril-server from the extension's Deployment (args and mounted secrets taken from it) and
// publishes its EndpointSlice; Gardener's own resource manager controllers (one per shoot, as
// on a seed) apply the ManagedResource's objects to the shoot's API server, and the runner
// starts tendril-agent from the Deployment it reads back there.
// It checks every path and reports per shoot, and judges the network paths as
// extension/networkpaths does (Gardener's NetworkPolicy controllers over its own objects, the
// chart's standing in ExtensionNamespace); it is a developer tool, not part of a seed.
package localseed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/procgroup"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/proc/logging"
)

// Domain is the parent DNS domain of the local shoots: shoot alpha is api.alpha.<Domain>.
const Domain = "local.tendril.dev"

// Config configures the local seed. Empty addresses pick free loopback ports.
type Config struct {
	// BinDir holds tendril-ingress, tendril-server and tendril-agent (the directory of the
	// running executable when empty: make build puts them beside tendril-local).
	BinDir string
	// TestbinDir holds kube-apiserver, etcd and kubectl (hack/testbin.sh's default directory,
	// which make testbin fills, when empty).
	TestbinDir string
	// Dir receives certificates, kubeconfigs, secrets and logs (a new temporary directory,
	// removed at the end, when empty).
	Dir string
	// Ingress listeners and the xDS server, on loopback.
	SNIAddress, ProxyAddress, TunnelAddress, XDSAddress, IngressMetrics string
	// Shoots are the shoot names (project "local").
	Shoots []string
	// HAShoots are those of Shoots whose providerConfig asks for two tunnel agents
	// (highAvailability.agents: 2, as for a highly available control plane); both run, each
	// as its Deployment says.
	HAShoots []string
	// Once runs the checks once and returns; otherwise Run keeps running with a status line
	// per shoot every StatusInterval until ctx ends.
	Once           bool
	StatusInterval time.Duration
	// Out receives the progress and the report (os.Stdout when nil).
	Out io.Writer
}

// Report is the outcome of one round of checks.
type Report struct {
	Shoots []ShootReport
	// Paths is every network path's verdict under Gardener's NetworkPolicy controllers (judged
	// once at start-up; nil with fewer than two shoots), PathsErr why they could not be judged.
	Paths    *networkpaths.Result
	PathsErr error
}

// OK tells whether every check of every shoot passed and every network path came out as
// wanted: no intended path denied, no cross-shoot path allowed.
func (r Report) OK() bool {
	if r.PathsErr != nil || (r.Paths != nil && !r.Paths.OK()) {
		return false
	}
	for _, s := range r.Shoots {
		for _, c := range s.Checks {
			if c.Err != nil {
				return false
			}
		}
	}
	return len(r.Shoots) > 0
}

// ShootReport holds one shoot's checks in order.
type ShootReport struct {
	Namespace string
	Checks    []Check
}

// Check is one named check: Err nil means it passed; Detail says what was seen.
type Check struct {
	Name   string
	Detail string
	Err    error
}

type seed struct {
	cfg    Config
	out    io.Writer
	dir    string
	hostIP netip.Addr
	assets string
	crds   []*apiextensionsv1.CustomResourceDefinition
	rest   *rest.Config
	client client.Client
	procs  *procgroup.Group
	// netns: the runner is root and gives every shoot a node network namespace.
	netns    bool
	cleanMu  sync.Mutex
	cleanups []func()
	shoots   []*shoot
	// paths and pathsErr are the network paths' judgement (Report.Paths).
	paths    *networkpaths.Result
	pathsErr error
	log      logr.Logger
	logFile  *os.File
}

// Run starts the local seed, checks it, and with cfg.Once returns the report; otherwise it
// keeps running until ctx ends. Everything it started is stopped before it returns.
func Run(ctx context.Context, cfg Config) (rep Report, err error) {
	s := &seed{cfg: cfg, out: cfg.Out}
	if err := s.setUp(); err != nil {
		return rep, err
	}
	if s.dir == "" {
		d, err := os.MkdirTemp("", "tendril-local-")
		if err != nil {
			return rep, err
		}
		defer os.RemoveAll(d)
		s.dir = d
	}
	if s.hostIP, err = hostIPv4(); err != nil {
		return rep, err
	}
	ingressSocks, xdsListener, err := s.bind()
	if err != nil {
		return rep, err
	}
	defer func() { inherit.Close(ingressSocks...) }() // until procs.Start has them
	defer xdsListener.Close()                         // the control plane closes it too
	lf, err := os.Create(filepath.Join(s.dir, "tendril-seed.log"))
	if err != nil {
		return rep, err
	}
	defer lf.Close()
	s.logFile = lf
	s.log = logging.New(lf, 0)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer func() {
		for i := len(s.cleanups) - 1; i >= 0; i-- {
			s.cleanups[i]()
		}
	}()
	s.procs = procgroup.New(ctx)
	defer s.procs.Stop()

	start := time.Now()
	s.printf("local seed in %s (host address %s for EndpointSlices)\n", s.dir, s.hostIP)
	if s.assets, err = testbinDir(s.cfg.TestbinDir); err != nil {
		return rep, fmt.Errorf("kube-apiserver and etcd: %w", err)
	}
	if s.crds, err = kubeenv.CRDs(); err != nil {
		return rep, err
	}
	stopAPIServers, err := s.startAPIServers(ctx)
	defer stopAPIServers()
	if err != nil {
		return rep, err
	}
	s.printf("API servers up after %v: seed %s; %s\n", since(start), s.rest.Host, s.shootHosts())

	// tendril-seed's namespace: the xDS certificates' Secrets live there, as on a seed.
	if err := s.client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ExtensionNamespace}}); client.IgnoreAlreadyExists(err) != nil {
		return rep, fmt.Errorf("namespace %s: %w", ExtensionNamespace, err)
	}
	cpDone := s.startControlPlane(ctx, xdsListener)
	defer func() {
		cancel()
		<-cpDone
	}()
	socks := ingressSocks
	ingressSocks = nil // procs.Start closes this process's copies
	if err := s.startIngress(ctx, socks); err != nil {
		return rep, err
	}
	if err := s.startShoots(ctx); err != nil {
		return rep, err
	}
	select {
	case err := <-s.procs.Exited():
		return rep, err
	case err := <-cpDone:
		return rep, fmt.Errorf("control plane ended: %v", err)
	default:
	}
	if rep, err = s.firstReport(ctx, start); err != nil || s.cfg.Once {
		return rep, err
	}
	s.printUsage()
	return s.watchStatus(ctx, rep, cpDone)
}

// setUp fills in the defaults of s.cfg and checks that the binaries it starts are there.
func (s *seed) setUp() error {
	if s.out == nil {
		s.out = os.Stdout
	}
	if s.cfg.StatusInterval == 0 {
		s.cfg.StatusInterval = 10 * time.Second
	}
	if len(s.cfg.Shoots) == 0 {
		return errors.New("no shoots")
	}
	if s.cfg.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("directory of tendril's binaries: %w", err)
		}
		s.cfg.BinDir = filepath.Dir(exe)
	}
	for _, b := range []string{"tendril-ingress", "tendril-server", "tendril-agent"} {
		if _, err := os.Stat(filepath.Join(s.cfg.BinDir, b)); err != nil {
			return fmt.Errorf("%s: %w (make build puts it beside tendril-local; --bin-dir names another directory)", b, err)
		}
	}
	s.dir = s.cfg.Dir
	return nil
}

// bind binds the ingress's listeners, which tendril-ingress inherits, and the xDS server's, which
// the in-process control plane serves: no port is picked free and bound again later. On an
// error it closes what it bound.
func (s *seed) bind() (ingressSocks []*inherit.Socket, xdsListener net.Listener, err error) {
	for _, a := range []*string{&s.cfg.SNIAddress, &s.cfg.ProxyAddress, &s.cfg.TunnelAddress, &s.cfg.XDSAddress, &s.cfg.IngressMetrics} {
		if *a == "" {
			*a = "127.0.0.1:0" // bound below: the kernel picks the port
		}
	}
	if s.netns = canNetns(); s.netns {
		// The node namespaces reach the host's own address, not its loopback.
		if h, p, err := net.SplitHostPort(s.cfg.ProxyAddress); err == nil {
			if a, err := netip.ParseAddr(h); err == nil && a.IsLoopback() {
				s.cfg.ProxyAddress = net.JoinHostPort(s.hostIP.String(), p)
			}
		}
	}
	for _, a := range []*string{&s.cfg.SNIAddress, &s.cfg.ProxyAddress, &s.cfg.TunnelAddress, &s.cfg.IngressMetrics} {
		sock, err := inherit.Bind(*a)
		if err != nil {
			inherit.Close(ingressSocks...)
			return nil, nil, fmt.Errorf("tendril-ingress listener: %w", err)
		}
		ingressSocks = append(ingressSocks, sock)
		*a = sock.Addr
	}
	xdsListener, err = net.Listen("tcp", s.cfg.XDSAddress)
	if err != nil {
		inherit.Close(ingressSocks...)
		return nil, nil, fmt.Errorf("xDS listener: %w", err)
	}
	s.cfg.XDSAddress = xdsListener.Addr().String()
	return ingressSocks, xdsListener, nil
}

// startAPIServers starts the seed API server and every shoot's at once: each is its own etcd +
// kube-apiserver. stop stops those that started, also after an error.
func (s *seed) startAPIServers(ctx context.Context) (stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	started := func(stop func()) {
		if stop != nil {
			mu.Lock()
			stops = append(stops, stop)
			mu.Unlock()
		}
	}
	errs := make([]error, len(s.cfg.Shoots)+1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		var stop func()
		stop, errs[0] = s.startSeedAPIServer(ctx)
		started(stop)
	}()
	for i, name := range s.cfg.Shoots {
		sh := &shoot{name: name, namespace: "shoot--local--" + name, host: "api." + name + "." + Domain, index: i, ha: slices.Contains(s.cfg.HAShoots, name)}
		s.shoots = append(s.shoots, sh)
		wg.Add(1)
		go func() {
			defer wg.Done()
			var stop func()
			stop, errs[i+1] = s.startShootAPIServer(sh)
			started(stop)
		}()
	}
	wg.Wait()
	return stop, errors.Join(errs...)
}

// startControlPlane runs tendril-seed's control plane in this process, serving xDS on l, until
// ctx ends; done has its end.
func (s *seed) startControlPlane(ctx context.Context, l net.Listener) (done <-chan error) {
	cpDone := make(chan error, 1)
	go func() {
		cpDone <- controlplane.Run(ctx, controlplane.Config{
			REST:           s.rest,
			XDSListener:    l,
			XDSSecrets:     controlplane.XDSSecrets{Namespace: ExtensionNamespace},
			MetricsAddress: "0",
			HealthAddress:  "0",
			WebhookPort:    -1,
			Extension:      extension.AddOptions{Config: extension.Config{Image: "tendril-local", Ingress: "127.0.0.1", IngressNamespace: ExtensionNamespace}},
			RouteServices:  []string{manifest.KubeAPIServerName, manifest.ServerName}, // tendril-seed's default
			Log:            s.log.WithName("controlplane"),
		})
	}()
	return cpDone
}

// startIngress starts tendril-ingress on the listeners bound for it (socks, which it closes).
func (s *seed) startIngress(ctx context.Context, socks []*inherit.Socket) error {
	xdsFlags, err := s.xdsClientFiles(ctx)
	if err != nil {
		inherit.Close(socks...)
		return err
	}
	if _, err := s.procs.Start("tendril-ingress", filepath.Join(s.dir, "tendril-ingress.log"), procgroup.Options{Socks: socks}, filepath.Join(s.cfg.BinDir, "tendril-ingress"),
		append(xdsFlags, "--xds", s.cfg.XDSAddress, "--node-id", "tendril-ingress-local",
			"--sni-address", s.cfg.SNIAddress, "--proxy-address", s.cfg.ProxyAddress, "--tunnel-address", s.cfg.TunnelAddress,
			"--metrics-address", s.cfg.IngressMetrics)...); err != nil {
		return err
	}
	s.printf("control plane in-process (xDS over mutual TLS %s), tendril-ingress: SNI %s, PROXY %s, tunnel %s\n",
		s.cfg.XDSAddress, s.cfg.SNIAddress, s.cfg.ProxyAddress, s.cfg.TunnelAddress)
	return nil
}

// startShoots creates every shoot's Cluster and Extension with its resource manager, then plays
// kubelet for every shoot at once: each waits for its own extension's objects.
func (s *seed) startShoots(ctx context.Context) error {
	for _, sh := range s.shoots {
		if err := s.createShoot(ctx, sh); err != nil {
			return fmt.Errorf("%s: %w", sh.namespace, err)
		}
		if err := s.startGRM(ctx, sh); err != nil {
			return fmt.Errorf("%s: resource manager: %w", sh.namespace, err)
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, len(s.shoots))
	for i, sh := range s.shoots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.runShoot(ctx, sh); err != nil {
				errs[i] = fmt.Errorf("%s: %w", sh.namespace, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// firstReport runs the first round of checks and prints it with the network paths: Gardener's
// NetworkPolicy controllers work while the checks run; the table comes after.
func (s *seed) firstReport(ctx context.Context, start time.Time) (Report, error) {
	var settle func() (networkpaths.Result, error)
	if len(s.shoots) >= 2 {
		var err error
		if settle, err = s.startPaths(ctx); err != nil {
			return Report{}, fmt.Errorf("network paths: %w", err)
		}
	}
	rep := s.check(ctx, true)
	if settle != nil {
		r, err := settle()
		s.paths, s.pathsErr = &r, err
		s.printPaths(r, err)
		rep.Paths, rep.PathsErr = s.paths, s.pathsErr
	} else {
		s.printf("\nnetwork paths: judged for two shoots or more, not %d\n", len(s.shoots))
	}
	s.printf("\nready after %v:\n", since(start))
	s.printReport(rep)
	return rep, nil
}

// watchStatus checks the seed every StatusInterval and prints its status until ctx ends, a
// process exits or the control plane ends.
func (s *seed) watchStatus(ctx context.Context, rep Report, cpDone <-chan error) (Report, error) {
	t := time.NewTicker(s.cfg.StatusInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			s.printf("\nstopping\n")
			return rep, nil
		case err := <-s.procs.Exited():
			return rep, err
		case err := <-cpDone:
			return rep, fmt.Errorf("control plane ended: %v", err)
		case <-t.C:
			r := s.check(ctx, false)
			if ctx.Err() != nil {
				continue // interrupted mid-round: the next select stops
			}
			r.Paths, r.PathsErr = s.paths, s.pathsErr
			rep = r
			s.printStatus(rep)
		}
	}
}

// addCleanup registers f to run after every process has stopped.
func (s *seed) addCleanup(f func()) {
	s.cleanMu.Lock()
	defer s.cleanMu.Unlock()
	s.cleanups = append(s.cleanups, f)
}

func (s *seed) printf(format string, args ...any) { fmt.Fprintf(s.out, format, args...) }

func (s *seed) shootHosts() string {
	var hs []string
	for _, sh := range s.shoots {
		hs = append(hs, sh.name+" "+sh.rest.Host)
	}
	return strings.Join(hs, ", ")
}

func since(t time.Time) time.Duration { return time.Since(t).Round(100 * time.Millisecond) }

// startSeedAPIServer starts the seed's API server with the CRDs.
func (s *seed) startSeedAPIServer(ctx context.Context) (func(), error) {
	scheme := kubescheme.New()
	te, cfg, err := kubeenv.Start(func() (*envtest.Environment, error) {
		te := kubeenv.Environment(s.assets)
		te.CRDs, te.Scheme = s.crds, scheme
		return te, nil
	})
	if err != nil {
		return nil, fmt.Errorf("seed API server: %w", err)
	}
	stop := func() { _ = te.Stop() }
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return stop, err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := kubeenv.InstallGardenerCRDs(ctx, c); err != nil {
		return stop, fmt.Errorf("install Gardener CRDs: %w", err)
	}
	s.rest, s.client = cfg, c
	return stop, nil
}

// testbinDir is dir, or hack/testbin.sh's default, once it holds every envtest binary.
func testbinDir(dir string) (string, error) {
	if dir == "" {
		var err error
		if dir, err = kubeenv.DefaultTestbinDir(); err != nil {
			return "", err
		}
	}
	return dir, kubeenv.CheckTestbin(dir)
}

// hostIPv4 is this machine's first global IPv4 address: EndpointSlices refuse loopback.
func hostIPv4() (netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return netip.Addr{}, err
	}
	for _, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil {
			continue
		}
		if ip := p.Addr(); ip.Is4() && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
			return ip, nil
		}
	}
	return netip.Addr{}, errors.New("no non-loopback IPv4 address on this machine: EndpointSlices refuse loopback addresses")
}

// freeAddr returns host:port with a port free at the moment: only for a process in a network
// namespace of its own (materialize's inNetns), where no other process binds; elsewhere ports are
// bound for the process to inherit or reserved (docs/design-notes/ports.md).
func freeAddr(host string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// xdsClientFiles waits for the xDS client Secret the control plane publishes, writes it as the
// kubelet would mount it into the ingress Pod, and returns tendril-ingress's flags for it.
func (s *seed) xdsClientFiles(ctx context.Context) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	sec := &corev1.Secret{}
	key := client.ObjectKey{Namespace: ExtensionNamespace, Name: controlplane.XDSSecretClient}
	for {
		err := s.client.Get(ctx, key, sec)
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("xDS client Secret %s: %w", key, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	var flags []string
	for _, f := range []struct{ flag, key string }{
		{"--xds-cert-file", controlplane.DataKeyCert}, {"--xds-key-file", controlplane.DataKeyKey}, {"--xds-ca-file", controlplane.DataKeyCA},
	} {
		path := filepath.Join(s.dir, "xds-"+f.key)
		if err := os.WriteFile(path, sec.Data[f.key], 0o600); err != nil {
			return nil, err
		}
		flags = append(flags, f.flag, path)
	}
	return append(flags, "--xds-server-name", "tendril-xds."+ExtensionNamespace+".svc"), nil
}
