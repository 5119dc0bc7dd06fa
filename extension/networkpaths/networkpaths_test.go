package networkpaths

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/Masterminds/semver/v3"
	"github.com/gardener/gardener/pkg/api/indexer"
	resourcemanagerconfigv1alpha1 "github.com/gardener/gardener/pkg/apis/config/resourcemanager/v1alpha1"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"github.com/gardener/gardener/pkg/chartrenderer"
	kubeapiserver "github.com/gardener/gardener/pkg/component/kubernetes/apiserver"
	"github.com/gardener/gardener/pkg/component/kubernetes/apiserverexposure"
	gardenletnetworkpolicy "github.com/gardener/gardener/pkg/controller/networkpolicy"
	"github.com/gardener/gardener/pkg/controller/networkpolicy/hostnameresolver"
	grmnetworkpolicy "github.com/gardener/gardener/pkg/resourcemanager/controller/networkpolicy"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	"github.com/go-logr/logr"
	istionetworkingv1beta1 "istio.io/client-go/pkg/apis/networking/v1beta1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/version"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/charts"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kubetest"
	"github.com/tendril-net/tendril/internal/netpoleval"
)

var update = flag.Bool("update", false, "rewrite docs/network-paths.md")

// The namespaces as gardenlet labels them: the extension's (ControllerInstallation reconciler),
// two shoots' control planes (botanist DeployControlPlaneNamespace), and garden.
const (
	extNS  = "extension-tendril-abcde"
	shootA = "shoot--a--x"
	shootB = "shoot--b--y"
)

// The seed's networks (gardenlet excludes them from allow-to-private-networks), and the
// addresses the pods get.
var runtimeNetworks = gardenletnetworkpolicy.RuntimeNetworkConfig{
	IPFamilies: []gardencorev1beta1.IPFamily{gardencorev1beta1.IPFamilyIPv4},
	Nodes:      []string{"10.250.0.0/16"},
	Pods:       []string{"10.244.0.0/16"},
	Services:   []string{"10.96.0.0/12"},
}

func namespaces() []*corev1.Namespace {
	ns := func(name string, l map[string]string) *corev1.Namespace {
		return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}}
	}
	shoot := func(name string) *corev1.Namespace {
		return ns(name, map[string]string{
			v1beta1constants.GardenRole:                       v1beta1constants.GardenRoleShoot,
			v1beta1constants.LabelSeedProvider:                "local",
			v1beta1constants.LabelShootProvider:               "local",
			v1beta1constants.LabelNetworkingProvider:          "calico",
			v1beta1constants.LabelBackupProvider:              "local",
			v1beta1constants.LabelExtensionPrefix + "tendril": "true",
			"pod-security.kubernetes.io/enforce":              "privileged",
			resourcesv1alpha1.HighAvailabilityConfigConsider:  "true",
		})
	}
	return []*corev1.Namespace{
		ns(v1beta1constants.GardenNamespace, nil),
		ns(extNS, map[string]string{
			v1beta1constants.GardenRole:                      v1beta1constants.GardenRoleExtension,
			v1beta1constants.LabelControllerRegistrationName: "tendril",
			resourcesv1alpha1.HighAvailabilityConfigConsider: "true",
		}),
		shoot(shootA),
		shoot(shootB),
	}
}

// renderChart renders the tendril-seed chart with Gardener's chart renderer, as gardenlet does.
func renderChart(t *testing.T, s serializer.CodecFactory) []client.Object {
	t.Helper()
	values := map[string]any{"gardener": map[string]any{
		"version": "v1.150.0",
		"garden":  map[string]any{"clusterIdentity": "garden"},
		"seed": map[string]any{
			"name": "local", "clusterIdentity": "seed-local", "provider": "local", "region": "local",
			"ingressDomain": "ingress.local.seed.example.org",
		},
	}}
	rc, err := chartrenderer.NewWithServerVersion(&version.Info{GitVersion: "v1.37.1", Major: "1", Minor: "37"}).
		RenderEmbeddedFS(charts.FS, charts.SeedChart, "tendril", extNS, values)
	if err != nil {
		t.Fatalf("render tendril-seed: %v", err)
	}
	var objs []client.Object
	for _, m := range rc.Manifests {
		for doc := range strings.SplitSeq(m.Content, "\n---\n") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			obj, _, err := s.UniversalDeserializer().Decode([]byte(doc), nil, nil)
			if err != nil {
				t.Fatalf("%s: %v", m.Name, err)
			}
			objs = append(objs, obj.(client.Object))
		}
	}
	return objs
}

// kubeAPIServerDeployment is the shoot's kube-apiserver as the egress webhook receives it: the
// pod labels of Gardener's kube-apiserver Deployment (pkg/component/kubernetes/apiserver
// deployment.go), then MutateDeployment for the shoot's egress mode.
func kubeAPIServerDeployment(t *testing.T, ns string, mode tendrilv1alpha1.EgressMode) *appsv1.Deployment {
	t.Helper()
	allowed := v1beta1constants.LabelNetworkPolicyAllowed
	podLabels := kubeapiserver.GetLabels()
	for _, k := range []string{
		v1beta1constants.LabelNetworkPolicyToDNS,
		v1beta1constants.LabelNetworkPolicyToPublicNetworks,
		v1beta1constants.LabelNetworkPolicyToPrivateNetworks,
		resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyWebhookTargets,
		resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyExtensionsNamespaceAlias + "-" + v1beta1constants.LabelNetworkPolicyWebhookTargets,
	} {
		podLabels[k] = allowed
	}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: manifest.KubeAPIServerName, Namespace: ns, Labels: kubeapiserver.GetLabels()},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: kubeapiserver.GetLabels()},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:v1.37.1",
					Args:  []string{"--secure-port=443"},
					Ports: []corev1.ContainerPort{{Name: "https", ContainerPort: manifest.PortKubeAPIServer, Protocol: corev1.ProtocolTCP}},
				}}},
			},
		},
	}
	cfg, err := egresswebhook.EgressSelectorConfig(ns, mode)
	if err != nil {
		t.Fatal(err)
	}
	if err := egresswebhook.MutateDeployment(dep, egresswebhook.Mutation{
		Egress: mode, Config: string(cfg), RelayImage: "tendril:test",
		Secrets: egresswebhook.Secrets{Client: "tendril-kube-apiserver-client-0", CABundle: "ca-tendril-bundle-0"},
	}); err != nil {
		t.Fatalf("egress webhook on %s: %v", ns, err)
	}
	return dep
}

// prometheusPod is the shoot's Prometheus as far as GRM cares: Gardener's scrape-target label.
func prometheusPod(ns string) corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{
			"app": "prometheus", "role": "monitoring", "name": "shoot",
			resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyScrapeTargets: v1beta1constants.LabelNetworkPolicyAllowed,
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "prometheus", Image: "prometheus:test"}}},
	}
}

// seedPrometheusPod is the seed's Prometheus in garden with the pod labels gardenlet gives it
// (pkg/gardenlet/controller/seed/seed components.go, newSeedPrometheus AdditionalPodLabels).
func seedPrometheusPod() corev1.PodTemplateSpec {
	prefix := resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-"
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{
			"app": "prometheus", "role": "monitoring", "name": "seed",
			prefix + v1beta1constants.LabelNetworkPolicySeedScrapeTargets:                                                                     v1beta1constants.LabelNetworkPolicyAllowed,
			prefix + v1beta1constants.LabelNetworkPolicyExtensionsNamespaceAlias + "-" + v1beta1constants.LabelNetworkPolicySeedScrapeTargets: v1beta1constants.LabelNetworkPolicyAllowed,
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "prometheus", Image: "prometheus:test"}}},
	}
}

func shootValues(ns string, mode tendrilv1alpha1.EgressMode) manifest.Values {
	return manifest.Values{
		Namespace: ns, Image: "tendril:test", Egress: mode, IngressNamespace: extNS,
		Secrets: manifest.SecretNames{ServerTLS: "tls", ClientCA: "ca", ServerWireGuard: "wg"},
		Tunnel:  manifest.Tunnel{Agents: []manifest.Agent{{}}}, // one agent (its keys do not matter here)
	}
}

type cluster struct {
	t      *testing.T
	ctx    context.Context
	c      client.Client
	nextIP int
	pods   map[string]netpoleval.Endpoint // by actor name
	nsObjs map[string]*corev1.Namespace
}

// apply creates obj (a Service, ServiceAccount, …) as it is.
func (k *cluster) apply(obj client.Object) {
	k.t.Helper()
	obj.SetResourceVersion("")
	if err := k.c.Create(k.ctx, obj); err != nil {
		k.t.Fatalf("create %T %s/%s: %v", obj, obj.GetNamespace(), obj.GetName(), err)
	}
}

// pod creates the pod a Deployment's template would (envtest runs no controller-manager) with
// the next pod IP, and records it as actor.
func (k *cluster) pod(actor, ns, name string, tmpl corev1.PodTemplateSpec) {
	k.t.Helper()
	k.nextIP++
	ip := netip.AddrFrom4([4]byte{10, 244, byte(k.nextIP / 250), byte(k.nextIP%250 + 1)})
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: tmpl.Labels, Annotations: tmpl.Annotations}, Spec: tmpl.Spec}
	// Admission of what envtest lacks (Gardener's PriorityClasses, ServiceAccounts) is no
	// concern of NetworkPolicies.
	p.Spec.ServiceAccountName, p.Spec.PriorityClassName = "", ""
	k.apply(p)
	p.Status.PodIP, p.Status.PodIPs = ip.String(), []corev1.PodIP{{IP: ip.String()}}
	if err := k.c.Status().Update(k.ctx, p); err != nil {
		k.t.Fatalf("pod %s/%s status: %v", ns, name, err)
	}
	stored := &corev1.Pod{}
	if err := k.c.Get(k.ctx, client.ObjectKeyFromObject(p), stored); err != nil {
		k.t.Fatal(err)
	}
	k.pods[actor] = netpoleval.Pod(stored, k.nsObjs[ns])
}

func startControllers(t *testing.T, ctx context.Context, env *kubetest.Env) {
	t.Helper()
	scheme := kubetest.NewScheme()
	// GRM's controller asks the scheme for Istio's VirtualService (its watch stays off: the
	// CRD is not installed, as on a seed without Istio).
	if err := istionetworkingv1beta1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	mgr, err := manager.New(env.Config, manager.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 logr.Discard(),
		// Both Gardener controllers are called "networkpolicy"; in gardenlet and GRM they run
		// in different processes.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := indexer.AddServiceNamespaceSelectors(ctx, mgr.GetFieldIndexer()); err != nil {
		t.Fatal(err)
	}
	// gardenlet's seed NetworkPolicy controller (pkg/controller/networkpolicy), as gardenlet
	// adds it for the seed (no extra namespace selectors).
	if err := (&gardenletnetworkpolicy.Reconciler{
		Resolver:        hostnameresolver.NewNoOpProvider(),
		RuntimeNetworks: runtimeNetworks,
	}).AddToManager(mgr, mgr); err != nil {
		t.Fatalf("gardenlet networkpolicy controller: %v", err)
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
		t.Fatalf("GRM networkpolicy controller: %v", err)
	}
	done := make(chan error, 1)
	mctx, cancel := context.WithCancel(ctx)
	go func() { done <- mgr.Start(mctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
}

// path is one connection and whether tendril wants it.
type path struct {
	from, to string
	port     int32
	want     bool
	why      string
}

const (
	world     = "load balancer (internet)"
	seedAPI   = "seed kube-apiserver (node network)"
	ingress   = "tendril-ingress"
	seed      = "tendril-seed"
	kasA      = "A kube-apiserver (httpConnect)"
	kasB      = "B kube-apiserver (grpc)"
	serverA   = "A tendril-server"
	serverB   = "B tendril-server"
	promA     = "A prometheus"
	promB     = "B prometheus"
	promSeed  = "seed prometheus (garden)"
	agent     = "tendril-agent"
	vpnShoot  = "vpn-shoot"
	metricsSv = "metrics-server (from-seed)"
	coreDNS   = "coredns"
)

func seedPaths() []path {
	p := func(from, to string, port int32, want bool, why string) path { return path{from, to, port, want, why} }
	return []path{
		p(world, ingress, 443, true, "SNI listener"),
		p(world, ingress, 8443, true, "PROXY listener"),
		p(world, ingress, 8132, true, "agents' tunnel listener"),
		p(seedAPI, seed, 10250, true, "control-plane egress webhook"),
		p(ingress, seed, 18000, true, "xDS"),
		p(ingress, kasA, 443, true, "SNI/PROXY → shoot A's API server"),
		p(ingress, kasB, 443, true, "SNI/PROXY → shoot B's API server"),
		p(ingress, serverA, 1194, true, "agent A's tunnel"),
		p(ingress, serverB, 1194, true, "agent B's tunnel"),
		p(kasA, serverA, 9443, true, "egress, HTTP CONNECT"),
		p(kasB, serverB, 8090, true, "egress, gRPC (relay sidecar)"),
		p(promA, serverA, 9090, true, "metrics"),
		p(promB, serverB, 9090, true, "metrics"),
		p(promSeed, seed, 8080, true, "metrics"),
		p(promSeed, ingress, 18081, true, "metrics"),

		p(kasA, serverB, 9443, false, "cross-shoot"),
		p(kasA, serverB, 8090, false, "cross-shoot"),
		p(kasA, serverB, 1194, false, "cross-shoot"),
		p(kasB, serverA, 8090, false, "cross-shoot"),
		p(kasB, serverA, 9443, false, "cross-shoot"),
		p(kasA, serverA, 8090, false, "not A's egress mode"),
		p(kasB, serverB, 9443, false, "not B's egress mode"),
		p(promA, serverB, 9090, false, "cross-shoot"),
		p(ingress, serverA, 9443, false, "egress front-end is kube-apiserver's only"),
		p(ingress, serverA, 8090, false, "egress front-end is kube-apiserver's only"),
		p(ingress, serverA, 9090, false, "metrics are Prometheus's"),
		p(ingress, seed, 10250, false, "webhook is the seed API server's"),
		p(seed, serverA, 1194, false, "only the ingress reaches the tunnel"),
		p(world, serverA, 1194, false, "only through the ingress"),
		p(world, seed, 18000, false, "xDS is the ingress's only"),
		p(promSeed, seed, 18000, false, "xDS is the ingress's only"),
		p(promSeed, serverA, 9090, false, "the shoot's Prometheus scrapes it"),
	}
}

// evaluate judges every path under policies; rows are the markdown table's.
func evaluate(t *testing.T, policies []networkingv1.NetworkPolicy, actors map[string]netpoleval.Endpoint, paths []path) (rows []string, ok bool, problems []string) {
	t.Helper()
	ok = true
	for _, p := range paths {
		src, found := actors[p.from]
		dst, found2 := actors[p.to]
		if !found || !found2 {
			t.Fatalf("path %s → %s: unknown actor", p.from, p.to)
		}
		v, err := netpoleval.Evaluate(policies, src, dst, corev1.ProtocolTCP, p.port)
		if err != nil {
			t.Fatal(err)
		}
		got := map[bool]string{true: "allowed", false: "denied"}
		mark := ""
		if v.Allowed != p.want {
			ok, mark = false, " ✗"
			problems = append(problems, fmt.Sprintf("%s → %s :%d: %s, want %s (%s)", p.from, p.to, p.port, got[v.Allowed], got[p.want], v))
		}
		// Every pod must be isolated by Gardener's deny-all: an allowed path must be allowed by a
		// policy, not by the absence of one.
		for _, s := range []string{v.Egress, v.Ingress} {
			if s == "not isolated" {
				ok = false
				problems = append(problems, fmt.Sprintf("%s → %s :%d: a side is not isolated (%s)", p.from, p.to, p.port, v))
			}
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %d | %s | %s%s | %s | %s |", p.from, p.to, p.port, p.why, got[v.Allowed], mark, v.Egress, v.Ingress))
	}
	return rows, ok, problems
}

// TestNetworkPaths runs Gardener's seed NetworkPolicy controllers over the rendered chart and two
// shoots' objects and judges every path tendril needs or must not have.
func TestNetworkPaths(t *testing.T) {
	logf.SetLogger(logr.Discard())
	env := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	k := &cluster{t: t, ctx: ctx, c: env.Client, pods: map[string]netpoleval.Endpoint{}, nsObjs: map[string]*corev1.Namespace{}}

	for _, ns := range namespaces() {
		if err := k.c.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		stored := &corev1.Namespace{}
		if err := k.c.Get(ctx, client.ObjectKeyFromObject(ns), stored); err != nil {
			t.Fatal(err)
		}
		if ns.Labels != nil {
			stored.Labels = mergeLabels(stored.Labels, ns.Labels)
			if err := k.c.Update(ctx, stored); err != nil {
				t.Fatal(err)
			}
		}
		k.nsObjs[ns.Name] = stored
	}
	// gardenlet's allow-to-runtime-apiserver reads the seed API server's endpoints.
	if err := k.c.Get(ctx, client.ObjectKey{Namespace: corev1.NamespaceDefault, Name: "kubernetes"}, &corev1.Endpoints{}); apierrors.IsNotFound(err) {
		k.apply(&corev1.Endpoints{ //nolint:staticcheck // gardenlet reads Endpoints
			ObjectMeta: metav1.ObjectMeta{Namespace: corev1.NamespaceDefault, Name: "kubernetes"},
			Subsets:    []corev1.EndpointSubset{{Addresses: []corev1.EndpointAddress{{IP: "10.250.0.10"}}, Ports: []corev1.EndpointPort{{Name: "https", Port: 443, Protocol: corev1.ProtocolTCP}}}},
		})
	} else if err != nil {
		t.Fatal(err)
	}

	// The seed chart: its Services as rendered, a pod per Deployment.
	for _, obj := range renderChart(t, serializer.NewCodecFactory(env.Scheme)) {
		switch o := obj.(type) {
		case *corev1.Service:
			k.apply(o)
		case *appsv1.Deployment:
			actor := map[string]string{"tendril-ingress": ingress, "gardener-extension-tendril": seed}[o.Name]
			if actor == "" {
				t.Fatalf("chart Deployment %s: which actor?", o.Name)
			}
			k.pod(actor, extNS, o.Name+"-0", o.Spec.Template)
		}
	}
	// Two shoots: tendril-server (extension/manifest), Gardener's kube-apiserver Service
	// (apiserverexposure, Gardener's own code) and pods, a Prometheus.
	for _, s := range []struct {
		ns                string
		mode              tendrilv1alpha1.EgressMode
		kas, server, prom string
	}{
		{shootA, tendrilv1alpha1.EgressHTTPConnect, kasA, serverA, promA},
		{shootB, tendrilv1alpha1.EgressGRPC, kasB, serverB, promB},
	} {
		v := shootValues(s.ns, s.mode)
		for _, obj := range manifest.SeedObjects(v) {
			if d, ok := obj.(*appsv1.Deployment); ok {
				k.pod(s.server, s.ns, d.Name+"-0", d.Spec.Template)
				continue
			}
			k.apply(obj)
		}
		if err := apiserverexposure.NewService(logr.Discard(), k.c, s.ns,
			&apiserverexposure.ServiceValues{RuntimeKubernetesVersion: semver.MustParse("1.37.1")},
			nil, nil, nil, nil, func() []string { return []string{"istio-ingress"} },
		).Deploy(ctx); err != nil {
			t.Fatalf("Gardener's kube-apiserver Service in %s: %v", s.ns, err)
		}
		kas := kubeAPIServerDeployment(t, s.ns, s.mode)
		k.pod(s.kas, s.ns, "kube-apiserver-0", kas.Spec.Template)
		k.pod(s.prom, s.ns, "prometheus-shoot-0", prometheusPod(s.ns))
	}
	k.pod(promSeed, v1beta1constants.GardenNamespace, "prometheus-seed-0", seedPrometheusPod())
	k.pods[world] = netpoleval.External(world, netip.MustParseAddr("203.0.113.10"))
	k.pods[seedAPI] = netpoleval.External(seedAPI, netip.MustParseAddr("10.250.0.10"))

	// Everything is in place before the controllers start, so their first pass sees it all.
	startControllers(t, ctx, env)

	// Wait until the paths come out as wanted and the policies have stopped changing (the
	// controllers are done); a renamed label or port never gets there.
	var (
		rows     []string
		problems []string
		lastSeen string
		stable   int
	)
	deadline := time.Now().Add(90 * time.Second)
	for {
		policies := &networkingv1.NetworkPolicyList{}
		if err := k.c.List(ctx, policies); err != nil {
			t.Fatal(err)
		}
		var seen []string
		for _, p := range policies.Items {
			seen = append(seen, p.Namespace+"/"+p.Name+"@"+p.ResourceVersion)
		}
		slices.Sort(seen)
		fingerprint := strings.Join(seen, ",")
		var ok bool
		rows, ok, problems = evaluate(t, policies.Items, k.pods, seedPaths())
		if fingerprint == lastSeen {
			stable++
		} else {
			stable, lastSeen = 0, fingerprint
		}
		if ok && stable >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("paths after %s:\n%s", 90*time.Second, strings.Join(problems, "\n"))
			break
		}
		time.Sleep(time.Second)
	}

	shootRows := shootPaths(t)
	doc := document(rows, shootRows)
	t.Log("\n" + doc)
	docPath := filepath.Join(kubetest.RepoRoot(), "docs", "network-paths.md")
	if *update {
		if err := os.WriteFile(docPath, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if old, err := os.ReadFile(docPath); err != nil || !bytes.Equal(old, []byte(doc)) {
		t.Errorf("docs/network-paths.md is stale (go test ./extension/networkpaths -update): %v", err)
	}
}

func mergeLabels(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

// gardenerShootPolicies are vpn-shoot's NetworkPolicies in the shoot's kube-system, transcribed
// from gardener pkg/component/networking/vpn/shoot (shoot.go: gardener.cloud--allow-vpn and
// gardener.cloud--allow-from-seed, whose peer is vpn-shoot's full pod template label set). The
// component itself needs a secrets manager and a shoot client to run; the shapes are copied
// with Gardener's constants.
func gardenerShootPolicies() ([]networkingv1.NetworkPolicy, map[string]string) {
	vpnShootLabels := map[string]string{
		v1beta1constants.GardenRole:     v1beta1constants.GardenRoleSystemComponent,
		v1beta1constants.LabelApp:       "vpn-shoot",
		managedresources.LabelKeyOrigin: managedresources.LabelValueGardener,
		"type":                          "tunnel",
	}
	return []networkingv1.NetworkPolicy{
		{
			ObjectMeta: metav1.ObjectMeta{Name: "gardener.cloud--allow-vpn", Namespace: metav1.NamespaceSystem},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{v1beta1constants.LabelApp: "vpn-shoot"}},
				Egress:      []networkingv1.NetworkPolicyEgressRule{{}},
				Ingress:     []networkingv1.NetworkPolicyIngressRule{{}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress, networkingv1.PolicyTypeIngress},
			},
		},
		{
			ObjectMeta: metav1.ObjectMeta{Name: "gardener.cloud--allow-from-seed", Namespace: metav1.NamespaceSystem},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{v1beta1constants.LabelNetworkPolicyShootFromSeed: v1beta1constants.LabelNetworkPolicyAllowed}},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{
					PodSelector: &metav1.LabelSelector{MatchLabels: vpnShootLabels},
				}}}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			},
		},
	}, vpnShootLabels
}

// shootPaths judges the shoot side: the agent, as the seed's end inside the shoot, must reach
// the pods Gardener opens to the seed (vpn-shoot's from-seed pods), through the ManagedResource's
// policies (extension/manifest ShootObjects).
func shootPaths(t *testing.T) []string {
	t.Helper()
	policies, vpnShootLabels := gardenerShootPolicies()
	v := shootValues(shootA, tendrilv1alpha1.EgressHTTPConnect)
	v.Ingress = "tendril.ingress.local.seed.example.org"
	var agentTemplate corev1.PodTemplateSpec
	for _, obj := range manifest.ShootObjects(v) {
		switch o := obj.(type) {
		case *networkingv1.NetworkPolicy:
			policies = append(policies, *o)
		case *appsv1.Deployment:
			if o.Name == manifest.AgentName {
				agentTemplate = o.Spec.Template
			}
		}
	}
	kubeSystem := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: metav1.NamespaceSystem, Labels: map[string]string{corev1.LabelMetadataName: metav1.NamespaceSystem}}}
	pod := func(name, ip string, l map[string]string, ports ...corev1.ContainerPort) netpoleval.Endpoint {
		return netpoleval.Pod(&corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceSystem, Labels: l},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: name, Ports: ports}}},
			Status:     corev1.PodStatus{PodIP: ip},
		}, kubeSystem)
	}
	actors := map[string]netpoleval.Endpoint{
		agent:    pod("tendril-agent", "100.64.0.10", agentTemplate.Labels),
		vpnShoot: pod("vpn-shoot", "100.64.0.11", vpnShootLabels),
		metricsSv: pod("metrics-server", "100.64.0.12", map[string]string{
			"k8s-app": "metrics-server", v1beta1constants.LabelNetworkPolicyShootFromSeed: v1beta1constants.LabelNetworkPolicyAllowed,
		}, corev1.ContainerPort{Name: "https", ContainerPort: 10250}),
		coreDNS: pod("coredns", "100.64.0.13", map[string]string{"k8s-app": "kube-dns"}),
		world:   netpoleval.External(world, netip.MustParseAddr("203.0.113.10")),
	}
	p := func(from, to string, port int32, want bool, why string) path { return path{from, to, port, want, why} }
	paths := []path{
		p(agent, metricsSv, 10250, true, "kubectl top, HPA: the seed through the tunnel"),
		p(vpnShoot, metricsSv, 10250, true, "Gardener's own VPN, for comparison"),
		p(agent, world, 8132, true, "the agent dials the seed ingress"),
		p(coreDNS, metricsSv, 10250, false, "from-seed is the seed's only"),
	}
	rows := make([]string, 0, len(paths))
	for _, p := range paths {
		v, err := netpoleval.Evaluate(policies, actors[p.from], actors[p.to], corev1.ProtocolTCP, p.port)
		if err != nil {
			t.Fatal(err)
		}
		got := map[bool]string{true: "allowed", false: "denied"}
		mark := ""
		if v.Allowed != p.want {
			mark = " ✗"
			t.Errorf("shoot: %s → %s :%d: %v, want allowed=%v", p.from, p.to, p.port, v, p.want)
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %d | %s | %s%s | %s | %s |", p.from, p.to, p.port, p.why, got[v.Allowed], mark, v.Egress, v.Ingress))
	}
	return rows
}

const tableHeader = "| from | to | port | why | verdict | egress side | ingress side |\n|---|---|---|---|---|---|---|\n"

// document is docs/network-paths.md.
func document(seedRows, shootRows []string) string {
	var b strings.Builder
	b.WriteString(`# Network paths on a Gardener seed

Generated by ` + "`go test ./extension/networkpaths -update`" + ` (envtest: set KUBEBUILDER_ASSETS or let
hack/testbin.sh build the binaries); the test fails when this file is stale or a verdict differs
from the one wanted (marked ✗).

**Seed.** A real kube-apiserver (envtest) holds the namespaces as gardenlet labels them (` + "`garden`" + `,
` + "`" + extNS + "`" + ` with ` + "`gardener.cloud/role=extension`" + `, ` + "`" + shootA + "`" + ` and ` + "`" + shootB + "`" + ` with
` + "`gardener.cloud/role=shoot`" + `), the tendril-seed chart rendered with Gardener's chart renderer, per shoot
extension/manifest's tendril-server Service and pod, Gardener's kube-apiserver Service (apiserverexposure)
and a kube-apiserver pod with the egress webhook's mutation (shoot A: httpConnect, shoot B: grpc), and a
Prometheus pod. Gardener's own controllers then write every NetworkPolicy: gardenlet's seed NetworkPolicy
controller (deny-all, allow-to-dns, …) and the resource manager's NetworkPolicy controller (policies derived
from Services and ` + "`networking.resources.gardener.cloud/*`" + ` annotations). internal/netpoleval judges
each path by the NetworkPolicy API's semantics: the source's egress and the destination's ingress must both
admit it. Every pod is isolated (deny-all) on both sides, so each "allowed" names the policies that admit it.

`)
	b.WriteString(tableHeader)
	for _, r := range seedRows {
		b.WriteString(r + "\n")
	}
	b.WriteString(`
**Shoot.** kube-system with Gardener's vpn-shoot policies (` + "`gardener.cloud--allow-vpn`" + `,
` + "`gardener.cloud--allow-from-seed`" + `, transcribed from pkg/component/networking/vpn/shoot) and the
ManagedResource's policies (extension/manifest ShootObjects). No deny-all here: Gardener ships none in
kube-system, so "not isolated" is expected on some sides.

`)
	b.WriteString(tableHeader)
	for _, r := range shootRows {
		b.WriteString(r + "\n")
	}
	return b.String()
}
