package manifest

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/wire"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func testValues() Values {
	return Values{
		Namespace:         "shoot--dev--alpha",
		Image:             "example.org/tendril:v0.1.0",
		ShootCIDRs:        []netip.Prefix{netip.MustParsePrefix("10.250.0.0/16"), netip.MustParsePrefix("100.64.0.0/12")},
		Hostnames:         []string{"api.alpha.dev.example.org"},
		AdvertisedAddress: netip.MustParseAddr("240.0.0.10"),
		Ingress:           "ingress.seed.example.org",
		APIServerProxy:    true,
		Egress:            tendrilv1alpha1.EgressGRPC,
		Tunnel: Tunnel{
			ServerAddresses: []netip.Addr{netip.MustParseAddr("fd8f:6d53:b97a:1::1"), netip.MustParseAddr("198.18.0.1")},
			ServerPublicKey: "c2VydmVyLXB1YmxpYy1rZXktMzItYnl0ZXMtbG9uZyE=",
			Agents: []Agent{{
				Address:    netip.MustParseAddr("fd8f:6d53:b97a:1::2"),
				PublicKey:  "YWdlbnQtcHVibGljLWtleS0zMi1ieXRlcy1sb25nISE=",
				PrivateKey: "YWdlbnQtcHJpdmF0ZS1rZXktMzItYnl0ZXMtbG9uZyE=",
			}},
		},
		Secrets: SecretNames{ServerTLS: "tendril-server-tls-0e15e25d", ClientCA: "ca-tendril-bundle-c6457b02", ServerWireGuard: "tendril-server-wireguard-c42257bc"},
	}
}

// TestGolden pins every object a shoot gets; `go test ./extension/manifest -update` rewrites
// the files after an intended change, and the diff is the review.
func TestGolden(t *testing.T) {
	v := testValues()
	if err := v.Validate(); err != nil {
		t.Fatal(err)
	}
	hib := v
	hib.Hibernated, hib.APIServerProxy = true, false
	ha := haValues()
	kernel := v
	kernel.KernelTunnel, kernel.APIServerProxy = true, false
	for name, objs := range map[string][]client.Object{
		"seed.yaml":            append(SeedObjects(v), Route(v)),
		"shoot.yaml":           ShootObjects(v),
		"seed-hibernated.yaml": SeedObjects(hib),
		"shoot-no-proxy.yaml":  ShootObjects(hib),
		"seed-ha.yaml":         SeedObjects(ha),
		"shoot-ha.yaml":        ShootObjects(ha),
		"seed-kernel.yaml":     SeedObjects(kernel),
		"shoot-kernel.yaml":    ShootObjects(kernel),
	} {
		var b strings.Builder
		for _, o := range objs {
			y, err := yaml.Marshal(o)
			if err != nil {
				t.Fatal(err)
			}
			b.WriteString("---\n")
			b.Write(y)
		}
		path := filepath.Join("testdata", name)
		if *update {
			if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%v (run with -update to create)", err)
		}
		if string(want) != b.String() {
			t.Errorf("%s differs from the builders' output; run `go test ./extension/manifest -update` and review the diff", path)
		}
	}
}

// haValues are testValues with a second agent, as for a highly available control plane.
func haValues() Values {
	v := testValues()
	v.Tunnel.Agents = append(v.Tunnel.Agents, Agent{
		Address:    netip.MustParseAddr("fd8f:6d53:b97a:1::3"),
		PublicKey:  "YWdlbnQxLXB1YmxpYy1rZXktMzItYnl0ZXMtbG9uZyE=",
		PrivateKey: "YWdlbnQxLXByaXZhdGUta2V5LTMyLWJ5dGVzLWxvbmc=",
	})
	v.Tunnel.Servers = HAServers
	return v
}

// TestHAServers: several servers are a StatefulSet under the tendril-server Service with a
// budget, and the agents dial every replica by name; one server is the Deployment, dialled as a
// whole; each shape names the other's objects as stale, and hibernation scales either to zero.
func TestHAServers(t *testing.T) {
	ha := haValues()
	objs := SeedObjects(ha)
	sts, ok := objs[0].(*appsv1.StatefulSet)
	if !ok {
		t.Fatalf("HA workload %T, want a StatefulSet", objs[0])
	}
	if *sts.Spec.Replicas != HAServers || sts.Spec.ServiceName != ServerName || sts.Spec.Template.Spec.Affinity == nil {
		t.Errorf("statefulset %+v", sts.Spec)
	}
	var pdbs int
	for _, o := range objs {
		if _, ok := o.(*policyv1.PodDisruptionBudget); ok {
			pdbs++
		}
	}
	if pdbs != 1 {
		t.Errorf("%d budgets among the seed objects, want 1", pdbs)
	}
	want := "--destination=" + wire.TendrilServerReplicaWireName(ha.Namespace, "tendril-server-0") + "," + wire.TendrilServerReplicaWireName(ha.Namespace, "tendril-server-1")
	for i := range ha.Tunnel.Agents {
		if args := AgentDeployment(ha, i).Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, want) {
			t.Errorf("agent %d args %q lack %q", i, args, want)
		}
	}
	if stale := StaleSeedObjects(ha); len(stale) != 1 || reflect.TypeOf(stale[0]) != reflect.TypeOf(&appsv1.Deployment{}) {
		t.Errorf("stale objects of the HA shape: %T", stale)
	}
	one := testValues()
	if _, ok := SeedObjects(one)[0].(*appsv1.Deployment); !ok {
		t.Errorf("one server's workload %T, want a Deployment", SeedObjects(one)[0])
	}
	if args := AgentDeployment(one, 0).Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, "--destination="+TunnelDestination(one.Namespace)) {
		t.Errorf("single-server agent args %q", args)
	}
	if stale := StaleSeedObjects(one); len(stale) != 2 {
		t.Errorf("stale objects of the one-server shape: %T", stale)
	}
	ha.Hibernated = true
	if r := *ServerStatefulSet(ha).Spec.Replicas; r != 0 {
		t.Errorf("hibernated HA replicas %d", r)
	}
}

// TestHAAgents: each agent is its own Deployment mounting its own Secret with its own key and
// address; tendril-server has both as peers; one PodDisruptionBudget, the NetworkPolicies and
// the anti-affinity select both agents' pods and nothing else; no Deployment selects another's pods.
func TestHAAgents(t *testing.T) {
	v := haValues()
	if err := v.Validate(); err != nil {
		t.Fatal(err)
	}
	var deps []*appsv1.Deployment
	secrets := map[string]*corev1.Secret{}
	var pdbs []*policyv1.PodDisruptionBudget
	var pols []*networkingv1.NetworkPolicy
	for _, o := range ShootObjects(v) {
		switch x := o.(type) {
		case *appsv1.Deployment:
			deps = append(deps, x)
		case *corev1.Secret:
			secrets[x.Name] = x
		case *policyv1.PodDisruptionBudget:
			pdbs = append(pdbs, x)
		case *networkingv1.NetworkPolicy:
			pols = append(pols, x)
		}
	}
	if len(deps) != 2 || len(pdbs) != 1 || len(pols) != 2 {
		t.Fatalf("%d Deployments, %d PodDisruptionBudgets, %d NetworkPolicies: want 2, 1, 2", len(deps), len(pdbs), len(pols))
	}
	selects := func(t *testing.T, what string, ls *metav1.LabelSelector, d *appsv1.Deployment) bool {
		t.Helper()
		sel, err := metav1.LabelSelectorAsSelector(ls)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return sel.Matches(labels.Set(d.Spec.Template.Labels))
	}
	for i, d := range deps {
		spec := d.Spec.Template.Spec
		args := strings.Join(spec.Containers[0].Args, " ")
		if want := "--address=" + v.Tunnel.Agents[i].Address.String() + " "; d.Name != AgentObjectName(i) || !strings.Contains(args, want) {
			t.Errorf("Deployment %d %s: args %q lack %q", i, d.Name, args, want)
		}
		s := secrets[spec.Volumes[0].Secret.SecretName]
		if s == nil || string(s.Data["private-key"]) != v.Tunnel.Agents[i].PrivateKey {
			t.Errorf("Deployment %s mounts secret %s, which lacks agent %d's private key", d.Name, spec.Volumes[0].Secret.SecretName, i)
		}
		for j, other := range deps {
			if j != i && selects(t, d.Name, d.Spec.Selector, other) {
				t.Errorf("Deployment %s's selector matches %s's pods", d.Name, other.Name)
			}
		}
		if !selects(t, "pdb", pdbs[0].Spec.Selector, d) {
			t.Errorf("PodDisruptionBudget does not select %s", d.Name)
		}
		for _, p := range pols {
			if !selects(t, p.Name, &p.Spec.PodSelector, d) && !selects(t, p.Name, p.Spec.Ingress[0].From[0].PodSelector, d) {
				t.Errorf("NetworkPolicy %s does not select %s", p.Name, d.Name)
			}
		}
		aa := spec.Affinity.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution
		topologies := map[string]bool{}
		for _, term := range aa {
			if !selects(t, "anti-affinity", term.PodAffinityTerm.LabelSelector, deps[1-i]) {
				t.Errorf("%s's anti-affinity term %s does not select the other agent", d.Name, term.PodAffinityTerm.TopologyKey)
			}
			topologies[term.PodAffinityTerm.TopologyKey] = true
		}
		if !topologies[corev1.LabelTopologyZone] || !topologies[corev1.LabelHostname] {
			t.Errorf("%s's anti-affinity spreads over %v, want zones and nodes", d.Name, topologies)
		}
	}
	if pdbs[0].Spec.MaxUnavailable == nil || pdbs[0].Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget %+v: want maxUnavailable 1", pdbs[0].Spec)
	}
	args := strings.Join(ServerDeployment(v).Spec.Template.Spec.Containers[0].Args, " ")
	for _, want := range []string{
		"--agent-public-key=" + v.Tunnel.Agents[0].PublicKey + "," + v.Tunnel.Agents[1].PublicKey + " ",
		"--agent-address=fd8f:6d53:b97a:1::2,fd8f:6d53:b97a:1::3 ",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("tendril-server args %q lack %q", args, want)
		}
	}
	// One agent: no PodDisruptionBudget, no affinity, the selector it always had.
	for _, o := range ShootObjects(testValues()) {
		switch x := o.(type) {
		case *policyv1.PodDisruptionBudget:
			t.Errorf("one agent got PodDisruptionBudget %s", x.Name)
		case *appsv1.Deployment:
			if x.Spec.Template.Spec.Affinity != nil {
				t.Errorf("one agent got affinity %+v", x.Spec.Template.Spec.Affinity)
			}
		}
	}
}

func TestValidate(t *testing.T) {
	for name, mutate := range map[string]func(*Values){
		"no namespace":          func(v *Values) { v.Namespace = "" },
		"no image":              func(v *Values) { v.Image = "" },
		"no cidrs":              func(v *Values) { v.ShootCIDRs = nil },
		"no hostnames":          func(v *Values) { v.Hostnames = nil },
		"no ingress":            func(v *Values) { v.Ingress = "" },
		"no agent key":          func(v *Values) { v.Tunnel.Agents[0].PublicKey = "" },
		"no agents":             func(v *Values) { v.Tunnel.Agents = nil },
		"agent without address": func(v *Values) { v.Tunnel.Agents[0].Address = netip.Addr{} },
		"agents share address": func(v *Values) {
			v.Tunnel.Agents = append(v.Tunnel.Agents, Agent{Address: v.Tunnel.Agents[0].Address, PublicKey: "k", PrivateKey: "p"})
		},
		"proxy without address": func(v *Values) { v.AdvertisedAddress = netip.Addr{} },
		"no secret names":       func(v *Values) { v.Secrets.ServerTLS = "" },
	} {
		v := testValues()
		mutate(&v)
		if v.Validate() == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestHostPort(t *testing.T) {
	for in, want := range map[string]string{"ingress.example.org": "ingress.example.org:8443", "192.0.2.1": "192.0.2.1:8443", "2001:db8::1": "[2001:db8::1]:8443"} {
		if got := hostPort(in, PortIngressProxy); got != want {
			t.Errorf("hostPort(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestServerServiceForGRM: Gardener's resource manager names the pod label it selects after the
// Service's target port, so every target port must be the container port's number (the egress
// webhook labels kube-apiserver …/to-tendril-server-tcp-9443 and -8090; the chart labels the
// ingress …/to-all-shoots-tendril-server-tcp-1194).
func TestServerServiceForGRM(t *testing.T) {
	v := testValues()
	v.IngressNamespace = "extension-tendril-abcde"
	svc := ServerService(v)
	container := map[int32]bool{}
	for _, p := range ServerDeployment(v).Spec.Template.Spec.Containers[0].Ports {
		container[p.ContainerPort] = true
	}
	for _, p := range svc.Spec.Ports {
		if p.TargetPort.Type != intstr.Int || !container[p.TargetPort.IntVal] || p.TargetPort.IntVal != p.Port {
			t.Errorf("port %s: target %s, want the container port's number %d", p.Name, p.TargetPort.String(), p.Port)
		}
	}
	want := map[string]string{
		resourcesv1alpha1.NetworkingNamespaceSelectors:                              `[{"matchLabels":{"kubernetes.io/metadata.name":"extension-tendril-abcde"}}]`,
		resourcesv1alpha1.NetworkingPodLabelSelectorNamespaceAlias:                  "all-shoots",
		"networking.resources.gardener.cloud/from-all-scrape-targets-allowed-ports": `[{"protocol":"TCP","port":9090}]`,
	}
	for k, w := range want {
		if got := svc.Annotations[k]; got != w {
			t.Errorf("annotation %s = %q, want %q", k, got, w)
		}
	}
	if got := IngressLabelToServerTunnel(); got != "networking.resources.gardener.cloud/to-all-shoots-tendril-server-tcp-1194" {
		t.Errorf("IngressLabelToServerTunnel() = %s", got)
	}
	if got := ServerService(Values{Namespace: "x"}).Annotations[resourcesv1alpha1.NetworkingNamespaceSelectors]; !strings.Contains(got, `"garden"`) {
		t.Errorf("default ingress namespace: selectors %s, want garden", got)
	}
}
