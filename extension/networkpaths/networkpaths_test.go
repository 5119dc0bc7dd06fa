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
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	vpnseedserver "github.com/gardener/gardener/pkg/component/networking/vpn/seedserver"
	vpnshoot "github.com/gardener/gardener/pkg/component/networking/vpn/shoot"
	shootsystem "github.com/gardener/gardener/pkg/component/shoot/system"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	fakesecretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager/fake"
	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/netpoleval"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
)

var update = flag.Bool("update", false, "rewrite docs/network-paths.md")

// The namespaces as gardenlet labels them: the extension's (ControllerInstallation reconciler)
// and two shoots' control planes (botanist DeployControlPlaneNamespace).
const (
	extNS  = "extension-tendril-abcde"
	shootA = "shoot--a--x"
	shootB = "shoot--b--y"
)

var (
	a = Shoot{Name: "A", Namespace: shootA, Egress: tendrilv1alpha1.EgressHTTPConnect}
	b = Shoot{Name: "B", Namespace: shootB, Egress: tendrilv1alpha1.EgressGRPC, VPNHighAvailability: true}
)

func shootValues(ns string, mode tendrilv1alpha1.EgressMode) manifest.Values {
	return ShootValues(ns, mode, extNS)
}

// TestNetworkPaths runs Gardener's seed NetworkPolicy controllers over the rendered chart and two
// shoots' objects and judges every path tendril needs or must not have.
func TestNetworkPaths(t *testing.T) {
	logf.SetLogger(logr.Discard())
	env := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := NewWorld(env.Client)
	if err := w.Seed(ctx, env.Scheme, extNS); err != nil {
		t.Fatal(err)
	}
	// Two shoots: tendril-server (extension/manifest), Gardener's kube-apiserver Service
	// (apiserverexposure, Gardener's own code) and pods, a Prometheus.
	for _, s := range []Shoot{a, b} {
		if err := w.ShootControlPlane(ctx, s, extNS); err != nil {
			t.Fatal(err)
		}
	}

	// Everything is in place before the controllers start, so their first pass sees it all.
	mgr, err := NewControllers(ctx, env.Config, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	mctx, stop := context.WithCancel(ctx)
	go func() { done <- mgr.Start(mctx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	}()

	res, err := Settle(ctx, env.Client, w.Actors(), SeedPaths(a, b), 90*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK() {
		t.Errorf("paths:\n%s", strings.Join(res.Problems, "\n"))
	}
	rows := res.Rows

	shootRows := shootPaths(ctx, t, env.Client)
	doc := document(rows, shootRows)
	t.Log("\n" + doc)
	docPath := filepath.Join(kubetest.RepoRoot(t), "docs", "network-paths.md")
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

// gardenerShootSystemPolicies are the NetworkPolicies of Gardener's shoot system component
// (pkg/component/shoot/system: gardener.cloud--deny-all in kube-system for Kubernetes ≥ 1.33 and
// the allow-to-* policies), produced by Gardener's own code: the component deploys its
// ManagedResource into namespace ns of the API server c talks to, and Gardener's
// managedresources.GetObjects reads the objects back from it.
func gardenerShootSystemPolicies(ctx context.Context, t *testing.T, c client.Client, ns string) []networkingv1.NetworkPolicy {
	t.Helper()
	sh := &gardencorev1beta1.Shoot{ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "garden-local"},
		Spec: gardencorev1beta1.ShootSpec{Kubernetes: gardencorev1beta1.Kubernetes{Version: strings.TrimPrefix(kubeenv.KubernetesVersion, "v")},
			Provider: gardencorev1beta1.Provider{Type: "local"}, Region: "local",
			Maintenance: &gardencorev1beta1.Maintenance{TimeWindow: &gardencorev1beta1.MaintenanceTimeWindow{Begin: "220000+0000", End: "230000+0000"}}}}
	sys := shootsystem.New(c, ns, shootsystem.Values{
		Extensions: []string{"tendril"}, ExternalClusterDomain: ptr.To("a.local.example.org"),
		KubernetesVersion: semver.MustParse(kubeenv.KubernetesVersion), Object: sh, ProjectName: "local",
		PodNetworkCIDRs: cidr("100.64.0.0/16"), ServiceNetworkCIDRs: cidr("100.96.0.0/16"), NodeNetworkCIDRs: cidr("10.250.0.0/16"),
	})
	if err := sys.Deploy(ctx); err != nil {
		t.Fatalf("Gardener's shoot system component: %v", err)
	}
	objs, err := managedresources.GetObjects(ctx, c, ns, shootsystem.ManagedResourceName)
	if err != nil {
		t.Fatalf("Gardener's shoot system ManagedResource: %v", err)
	}
	var policies []networkingv1.NetworkPolicy
	for _, o := range objs {
		if np, ok := o.(*networkingv1.NetworkPolicy); ok {
			policies = append(policies, *np)
		}
	}
	if !slices.ContainsFunc(policies, func(p networkingv1.NetworkPolicy) bool { return p.Name == "gardener.cloud--deny-all" }) {
		t.Fatalf("Gardener's shoot system component wrote no gardener.cloud--deny-all for Kubernetes %s: %d policies", kubeenv.KubernetesVersion, len(policies))
	}
	return policies
}

// gardenerVPNShoot is vpn-shoot as Gardener's own component (pkg/component/networking/vpn/shoot)
// deploys it, run against the API server c talks to in namespace ns with Gardener's fake secrets
// manager (a real CA in ca-vpn, which it signs vpn-shoot's client certificate with): its
// NetworkPolicies (gardener.cloud--allow-vpn, gardener.cloud--allow-from-seed) and its pods'
// labels, read back from its ManagedResource.
func gardenerVPNShoot(ctx context.Context, t *testing.T, c client.Client, ns string) ([]networkingv1.NetworkPolicy, map[string]string) {
	t.Helper()
	ca, err := (&secretsutils.CertificateSecretConfig{Name: v1beta1constants.SecretNameCAVPN, CommonName: v1beta1constants.SecretNameCAVPN,
		CertType: secretsutils.CACert}).Generate()
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string]map[string][]byte{
		v1beta1constants.SecretNameCAVPN: ca.SecretData(),
		vpnseedserver.SecretNameTLSAuth:  {"vpn.tlsauth": []byte("static key of the test")},
	} {
		if err := c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	vpn := vpnshoot.New(c, ns, fakesecretsmanager.New(c, ns), vpnshoot.Values{
		Image: "vpn-shoot:test",
		ReversedVPN: vpnshoot.ReversedVPNValues{Header: "outbound|1194||vpn-seed-server." + ns + ".svc.cluster.local",
			Endpoint: "api.a.local.example.org", IPFamilies: []gardencorev1beta1.IPFamily{gardencorev1beta1.IPFamilyIPv4}},
		SeedPodNetwork: "10.244.0.0/16",
		Network:        vpnshoot.NetworkValues{PodCIDRs: cidr("100.64.0.0/16"), ServiceCIDRs: cidr("100.96.0.0/16"), NodeCIDRs: cidr("10.250.0.0/16")},
	})
	if err := vpn.Deploy(ctx); err != nil {
		t.Fatalf("Gardener's vpn-shoot component: %v", err)
	}
	objs, err := managedresources.GetObjects(ctx, c, ns, "shoot-core-vpn-shoot")
	if err != nil {
		t.Fatalf("Gardener's vpn-shoot ManagedResource: %v", err)
	}
	var policies []networkingv1.NetworkPolicy
	var labels map[string]string
	for _, o := range objs {
		switch o := o.(type) {
		case *networkingv1.NetworkPolicy:
			policies = append(policies, *o)
		case *appsv1.Deployment:
			labels = o.Spec.Template.Labels
		}
	}
	if len(policies) == 0 || labels == nil {
		t.Fatalf("Gardener's vpn-shoot component wrote %d policies and no Deployment: %d objects", len(policies), len(objs))
	}
	return policies, labels
}

// shootPaths judges the shoot side: the agent, as the seed's end inside the shoot, must reach
// the pods Gardener opens to the seed (vpn-shoot's from-seed pods), through the ManagedResource's
// policies (extension/manifest ShootObjects), under Gardener's own kube-system policies (the
// shoot system component's deny-all among them).
func shootPaths(ctx context.Context, t *testing.T, c client.Client) []string {
	t.Helper()
	policies, vpnShootLabels := gardenerVPNShoot(ctx, t, c, shootA)
	policies = append(policies, gardenerShootSystemPolicies(ctx, t, c, shootA)...)
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
		coreDNS:  pod("coredns", "100.64.0.13", map[string]string{"k8s-app": "kube-dns"}),
		plainPod: pod("plain", "100.64.0.14", map[string]string{"app": "plain"}),
		world:    netpoleval.External(world, netip.MustParseAddr("203.0.113.10")),
	}
	p := func(from, to string, port int32, want bool, why string) Path { return Path{from, to, port, want, why} }
	paths := []Path{
		p(agent, metricsSv, 10250, true, "kubectl top, HPA: the seed through the tunnel"),
		p(vpnShoot, metricsSv, 10250, true, "Gardener's own VPN, for comparison"),
		p(agent, world, manifest.PortIngressProxy, true, "the agent dials the seed ingress"),
		p(coreDNS, metricsSv, 10250, false, "from-seed is the seed's only"),
		p(plainPod, metricsSv, 10250, false, "Gardener's deny-all in kube-system"),
		p(plainPod, world, manifest.PortIngressProxy, false, "Gardener's deny-all in kube-system"),
	}
	rows := make([]string, 0, len(paths))
	for _, p := range paths {
		v, err := netpoleval.Evaluate(policies, actors[p.From], actors[p.To], corev1.ProtocolTCP, p.Port)
		if err != nil {
			t.Fatal(err)
		}
		got := map[bool]string{true: "allowed", false: "denied"}
		mark := ""
		if v.Allowed != p.Want {
			mark = " ✗"
			t.Errorf("shoot: %s → %s :%d: %v, want allowed=%v", p.From, p.To, p.Port, v, p.Want)
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %d | %s | %s%s | %s | %s |", p.From, p.To, p.Port, p.Why, got[v.Allowed], mark, v.Egress, v.Ingress))
	}
	return rows
}

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
and a kube-apiserver pod with the egress webhook's mutation (shoot A: httpConnect, shoot B: grpc), a
Prometheus pod, and Gardener's own reversed VPN beside tendril's, each made by Gardener's component into a
fake client and read back: the istio ingress gateway's namespace, Service and pod (pkg/component/shared
NewIstio, as gardenlet's seed reconciler calls it) and per shoot the vpn-seed-server's Service and pod
(pkg/component/networking/vpn/seedserver; shoot B as the HA pair, vpn-seed-server-0). tendril-ingress relays
Gardener's CONNECTs to the gateway's unified port (docs/design-notes/gardener-coexistence.md); the gateway
alone reaches vpn-seed-server. Gardener's own controllers then write every NetworkPolicy: gardenlet's seed NetworkPolicy
controller (deny-all, allow-to-dns, …) and the resource manager's NetworkPolicy controller (policies derived
from Services and ` + "`networking.resources.gardener.cloud/*`" + ` annotations). internal/kube/netpoleval judges
each path by the NetworkPolicy API's semantics: the source's egress and the destination's ingress must both
admit it. Every pod is isolated (deny-all) on both sides, so each "allowed" names the policies that admit it.

`)
	b.WriteString(TableHeader)
	for _, r := range seedRows {
		b.WriteString(r + "\n")
	}
	b.WriteString(`
**Shoot.** kube-system with Gardener's shoot system component's policies, produced by Gardener's own code
(pkg/component/shoot/system, deployed into envtest and read back from its ManagedResource:
` + "`gardener.cloud--deny-all`" + ` for Kubernetes ≥ 1.33 and the allow-to-* policies), Gardener's vpn-shoot
policies and pod labels from its own component (pkg/component/networking/vpn/shoot, deployed the same way with
Gardener's fake secrets manager: ` + "`gardener.cloud--allow-vpn`" + `, ` + "`gardener.cloud--allow-from-seed`" + `) and the ManagedResource's policies
(extension/manifest ShootObjects). The real seed measures these rows against kube-router on a shoot node
([network-paths-measured.md](network-paths-measured.md)).

`)
	b.WriteString(TableHeader)
	for _, r := range shootRows {
		b.WriteString(r + "\n")
	}
	return b.String()
}
