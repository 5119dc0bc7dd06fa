package networkpaths

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gardener/gardener/pkg/api/indexer"
	resourcemanagerconfigv1alpha1 "github.com/gardener/gardener/pkg/apis/config/resourcemanager/v1alpha1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	gardenletnetworkpolicy "github.com/gardener/gardener/pkg/controller/networkpolicy"
	"github.com/gardener/gardener/pkg/controller/networkpolicy/hostnameresolver"
	grmnetworkpolicy "github.com/gardener/gardener/pkg/resourcemanager/controller/networkpolicy"
	"github.com/go-logr/logr"
	istionetworkingv1beta1 "istio.io/client-go/pkg/apis/networking/v1beta1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/kube/netpoleval"
)

// NewControllers returns a manager running gardenlet's seed NetworkPolicy controller and GRM's
// NetworkPolicy controller against the API server cfg names, for a seed whose networks are
// RuntimeNetworks; the caller starts it (it runs until its context ends) and owns the goroutine
// that does. Start it after the World is built, so the controllers' first pass sees it all.
func NewControllers(ctx context.Context, cfg *rest.Config, log logr.Logger) (manager.Manager, error) {
	return NewSeedControllers(ctx, cfg, RuntimeNetworks, log)
}

// NewSeedControllers is NewControllers for a seed with the given networks (the real seed's).
func NewSeedControllers(ctx context.Context, cfg *rest.Config, networks gardenletnetworkpolicy.RuntimeNetworkConfig, log logr.Logger) (manager.Manager, error) {
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	scheme := kubescheme.New()
	// GRM's controller asks the scheme for Istio's VirtualService (its watch stays off: the
	// CRD is not installed, as on a seed without Istio).
	if err := istionetworkingv1beta1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	mgr, err := manager.New(cfg, manager.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 log,
		// Both Gardener controllers are called "networkpolicy"; in gardenlet and GRM they run
		// in different processes.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		return nil, err
	}
	if err := indexer.AddServiceNamespaceSelectors(ctx, mgr.GetFieldIndexer()); err != nil {
		return nil, err
	}
	// gardenlet's seed NetworkPolicy controller (pkg/controller/networkpolicy), as gardenlet
	// adds it for the seed (no extra namespace selectors).
	if err := (&gardenletnetworkpolicy.Reconciler{
		Resolver:        hostnameresolver.NewNoOpProvider(),
		RuntimeNetworks: networks,
	}).AddToManager(mgr, mgr); err != nil {
		return nil, fmt.Errorf("gardenlet networkpolicy controller: %w", err)
	}
	// GRM's NetworkPolicy controller with the seed GRM's namespace selectors
	// (pkg/component/gardener/resourcemanager, ForRuntime).
	if err := (&grmnetworkpolicy.Reconciler{Config: resourcemanagerconfigv1alpha1.NetworkPolicyControllerConfig{
		Enabled: true,
		NamespaceSelectors: []metav1.LabelSelector{
			{MatchLabels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleShoot}},
			{MatchLabels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleExtension}},
			{MatchLabels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleIstioSystem}},
			{MatchLabels: map[string]string{v1beta1constants.GardenRole: v1beta1constants.GardenRoleIstioIngress}},
			{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: v1beta1constants.LabelExposureClassHandlerName, Operator: metav1.LabelSelectorOpExists}}},
			{MatchLabels: map[string]string{corev1.LabelMetadataName: v1beta1constants.GardenNamespace}},
		},
	}}).AddToManager(ctx, mgr, mgr); err != nil {
		return nil, fmt.Errorf("GRM networkpolicy controller: %w", err)
	}
	return mgr, nil
}

// Path is one connection and whether tendril wants it.
type Path struct {
	From, To string
	Port     int32
	Want     bool
	Why      string
}

// The seed's actors; a shoot's are Shoot's.
const (
	// Internet is the actor outside the cluster: the load balancer and the internet behind it.
	Internet  = "load balancer (internet)"
	world     = Internet
	seedAPI   = "seed kube-apiserver (node network)"
	ingress   = "tendril-ingress"
	seed      = "tendril-seed"
	promSeed  = "seed prometheus (garden)"
	agent     = "tendril-agent"
	vpnShoot  = "vpn-shoot"
	metricsSv = "metrics-server (from-seed)"
	coreDNS   = "coredns"
	plainPod  = "kube-system pod without policy labels"
	// istioGateway is Gardener's istio ingress gateway (IstioIngressGateway).
	istioGateway = "istio-ingressgateway (Gardener)"
)

// Shoot is one shoot's control plane in the seed.
type Shoot struct {
	// Name is the shoot's name in the table ("A").
	Name string
	// Namespace is its control-plane namespace.
	Namespace string
	// Egress is its kube-apiserver's egress mode.
	Egress tendrilv1alpha1.EgressMode
	// VPNHighAvailability is whether Gardener runs its own VPN for the shoot as the HA pair
	// (vpn-seed-server-0/1) rather than the single vpn-seed-server.
	VPNHighAvailability bool
}

// KubeAPIServer, Server and Prometheus are the shoot's actors.
func (s Shoot) KubeAPIServer() string {
	return s.Name + " kube-apiserver (" + string(s.Egress) + ")"
}
func (s Shoot) Server() string     { return s.Name + " tendril-server" }
func (s Shoot) Prometheus() string { return s.Name + " prometheus" }

// VPNSeedServer is the shoot's Gardener vpn-seed-server (VPNServiceName).
func (s Shoot) VPNSeedServer() string { return s.Name + " " + s.VPNServiceName() + " (Gardener)" }

// egress is the tendril-server port the shoot's kube-apiserver uses, and the other one.
func (s Shoot) egress() (port, other int32, why string) {
	switch {
	case s.Egress == tendrilv1alpha1.EgressGRPC:
		return manifest.PortGRPC, manifest.PortConnect, "egress, gRPC (relay sidecar)"
	case s.Egress.Relayed():
		return manifest.PortGRPC, manifest.PortConnect, "egress, HTTP CONNECT (relay sidecar)"
	}
	return manifest.PortConnect, manifest.PortGRPC, "egress, HTTP CONNECT"
}

// SeedPaths are the seed's paths for two shoots: what tendril needs, and what must stay
// denied, cross-shoot paths first.
func SeedPaths(a, b Shoot) []Path {
	p := func(from, to string, port int32, want bool, why string) Path { return Path{from, to, port, want, why} }
	aPort, aOther, aWhy := a.egress()
	bPort, bOther, bWhy := b.egress()
	return []Path{
		p(world, ingress, 443, true, "SNI listener"),
		p(world, ingress, 8443, true, "unified port (agents, CONNECT, PROXY)"),
		p(world, ingress, 8132, true, "legacy tunnel listener"),
		p(seedAPI, seed, 10250, true, "control-plane egress webhook"),
		p(ingress, seed, 18000, true, "xDS"),
		p(ingress, a.KubeAPIServer(), manifest.PortKubeAPIServer, true, "SNI/PROXY → shoot "+a.Name+"'s API server"),
		p(ingress, b.KubeAPIServer(), manifest.PortKubeAPIServer, true, "SNI/PROXY → shoot "+b.Name+"'s API server"),
		p(ingress, a.Server(), manifest.PortTunnel, true, "agent "+a.Name+"'s tunnel"),
		p(ingress, b.Server(), manifest.PortTunnel, true, "agent "+b.Name+"'s tunnel"),
		p(a.KubeAPIServer(), a.Server(), aPort, true, aWhy),
		p(b.KubeAPIServer(), b.Server(), bPort, true, bWhy),
		p(a.Prometheus(), a.Server(), manifest.PortMetrics, true, "metrics"),
		p(b.Prometheus(), b.Server(), manifest.PortMetrics, true, "metrics"),
		p(promSeed, seed, 8080, true, "metrics"),
		p(promSeed, ingress, 18081, true, "metrics"),
		p(ingress, istioGateway, vpnGatewayPort, true, "Gardener's CONNECTs relayed to its gateway"),
		p(istioGateway, a.VPNSeedServer(), vpnPort, true, "Gardener's own VPN, as Gardener runs it"),
		p(istioGateway, b.VPNSeedServer(), vpnPort, true, "Gardener's own VPN, as Gardener runs it"),

		p(a.KubeAPIServer(), b.Server(), aPort, false, "cross-shoot"),
		p(a.KubeAPIServer(), b.Server(), aOther, false, "cross-shoot"),
		p(a.KubeAPIServer(), b.Server(), manifest.PortTunnel, false, "cross-shoot"),
		p(b.KubeAPIServer(), a.Server(), bPort, false, "cross-shoot"),
		p(b.KubeAPIServer(), a.Server(), bOther, false, "cross-shoot"),
		p(a.KubeAPIServer(), a.Server(), aOther, false, "not "+a.Name+"'s egress mode"),
		p(b.KubeAPIServer(), b.Server(), bOther, false, "not "+b.Name+"'s egress mode"),
		p(a.Prometheus(), b.Server(), manifest.PortMetrics, false, "cross-shoot"),
		p(ingress, a.Server(), manifest.PortConnect, false, "egress front-end is kube-apiserver's only"),
		p(ingress, a.Server(), manifest.PortGRPC, false, "egress front-end is kube-apiserver's only"),
		p(ingress, a.Server(), manifest.PortMetrics, false, "metrics are Prometheus's"),
		p(ingress, seed, 10250, false, "webhook is the seed API server's"),
		p(seed, a.Server(), manifest.PortTunnel, false, "only the ingress reaches the tunnel"),
		p(world, a.Server(), manifest.PortTunnel, false, "only through the ingress"),
		p(world, seed, 18000, false, "xDS is the ingress's only"),
		p(promSeed, seed, 18000, false, "xDS is the ingress's only"),
		p(promSeed, a.Server(), manifest.PortMetrics, false, "the shoot's Prometheus scrapes it"),
		p(ingress, a.VPNSeedServer(), vpnPort, false, "Gardener's VPN is its gateway's only"),
		p(ingress, b.VPNSeedServer(), vpnPort, false, "Gardener's VPN is its gateway's only"),
		p(istioGateway, a.Server(), manifest.PortTunnel, false, "tendril's tunnel is tendril-ingress's only"),
	}
}

// Result is every path's verdict.
type Result struct {
	// Rows are the markdown table's rows, one per path; Problems name every path whose verdict
	// is not the one wanted, and every side Gardener's deny-all does not isolate.
	Rows     []string
	Problems []string
}

// OK tells whether every path came out as wanted.
func (r Result) OK() bool { return len(r.Problems) == 0 && len(r.Rows) > 0 }

// TableHeader heads the markdown table of Result.Rows.
const TableHeader = "| from | to | port | why | verdict | egress side | ingress side |\n|---|---|---|---|---|---|---|\n"

// Table is the markdown table of the rows.
func (r Result) Table() string { return TableHeader + strings.Join(r.Rows, "\n") + "\n" }

// Evaluate judges every path under policies. isolated demands that Gardener's deny-all isolate
// both sides of every path (the seed's namespaces): an allowed path must be allowed by a policy,
// not by the absence of one.
func Evaluate(policies []networkingv1.NetworkPolicy, actors map[string]netpoleval.Endpoint, paths []Path, isolated bool) (Result, error) {
	var r Result
	got := map[bool]string{true: "allowed", false: "denied"}
	for _, p := range paths {
		src, found := actors[p.From]
		dst, found2 := actors[p.To]
		if !found || !found2 {
			return r, fmt.Errorf("path %s → %s: unknown actor", p.From, p.To)
		}
		v, err := netpoleval.Evaluate(policies, src, dst, corev1.ProtocolTCP, p.Port)
		if err != nil {
			return r, err
		}
		mark := ""
		if v.Allowed != p.Want {
			mark = " ✗"
			r.Problems = append(r.Problems, fmt.Sprintf("%s → %s :%d: %s, want %s (%s)", p.From, p.To, p.Port, got[v.Allowed], got[p.Want], v))
		}
		for _, s := range []string{v.Egress, v.Ingress} {
			if isolated && s == "not isolated" {
				r.Problems = append(r.Problems, fmt.Sprintf("%s → %s :%d: a side is not isolated (%s)", p.From, p.To, p.Port, v))
			}
		}
		r.Rows = append(r.Rows, fmt.Sprintf("| %s | %s | %d | %s | %s%s | %s | %s |", p.From, p.To, p.Port, p.Why, got[v.Allowed], mark, v.Egress, v.Ingress))
	}
	return r, nil
}

// Settle waits until the paths come out as wanted and the NetworkPolicies in the API server c
// talks to have stopped changing for three polls a second apart (the controllers are done), or
// until timeout; it then returns the last judgement (Problems set when it never got there: a
// renamed label or port never does). An error is one of reading or judging, not a verdict.
func Settle(ctx context.Context, c client.Client, actors map[string]netpoleval.Endpoint, paths []Path, timeout time.Duration) (Result, error) {
	const stablePolls = 3
	var (
		lastSeen string
		stable   int
	)
	deadline := time.Now().Add(timeout)
	for {
		policies := &networkingv1.NetworkPolicyList{}
		if err := c.List(ctx, policies); err != nil {
			return Result{}, err
		}
		seen := make([]string, 0, len(policies.Items))
		for _, p := range policies.Items {
			seen = append(seen, p.Namespace+"/"+p.Name+"@"+p.ResourceVersion)
		}
		slices.Sort(seen)
		fingerprint := strings.Join(seen, ",")
		r, err := Evaluate(policies.Items, actors, paths, true)
		if err != nil {
			return r, err
		}
		if fingerprint == lastSeen {
			stable++
		} else {
			stable, lastSeen = 0, fingerprint
		}
		if r.OK() && stable >= stablePolls {
			return r, nil
		}
		if time.Now().After(deadline) {
			r.Problems = append(r.Problems, fmt.Sprintf("not settled as wanted after %v", timeout))
			return r, nil
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
