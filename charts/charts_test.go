package charts

import (
	"bytes"
	"flag"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	"github.com/gardener/gardener/pkg/chartrenderer"
	gardenerutils "github.com/gardener/gardener/pkg/utils/gardener"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/version"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/xds/translate"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/, extension.yaml and controller-registration.yaml")

const namespace = "extension-tendril-abcde"

// gardenerValues are what gardenlet mixes into the values of every extension chart (seed 001 §5).
var gardenerValues = map[string]any{
	"version": "v1.150.0",
	"garden":  map[string]any{"clusterIdentity": "garden-identity", "genericKubeconfigSecretName": "generic-garden-kubeconfig-1a2b3c4d"},
	"seed": map[string]any{
		"name":            "aws-eu1",
		"clusterIdentity": "seed-aws-eu1",
		"provider":        "aws",
		"region":          "eu-west-1",
		"ingressDomain":   "ingress.aws-eu1.example.com",
		// The Seed's spec as gardenlet mixes it in (JSON field names); only what the chart reads.
		"spec": map[string]any{
			"dns":     map[string]any{"provider": map[string]any{"type": "aws-route53", "credentialsRef": map[string]any{"apiVersion": "v1", "kind": "Secret", "namespace": "garden", "name": "dns-aws"}}},
			"ingress": map[string]any{"domain": "ingress.aws-eu1.example.com", "controller": map[string]any{"kind": "nginx"}},
		},
		"labels":      map[string]any{},
		"annotations": map[string]any{},
		"protected":   false,
		"visible":     true,
	},
	"gardenlet": map[string]any{"featureGates": map[string]any{}},
}

// renderCase is one way of installing the chart; each has a golden file testdata/<name>.yaml.
type renderCase struct {
	name   string
	values map[string]any // on top of the chart's values.yaml, without gardener
}

func cases(t *testing.T) []renderCase {
	ha := map[string]any{}
	b, err := os.ReadFile("examples/values-ha.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &ha); err != nil {
		t.Fatalf("examples/values-ha.yaml: %v", err)
	}
	return []renderCase{
		{name: "default", values: map[string]any{}},
		{name: "ha", values: ha},
		{name: "envoy", values: map[string]any{"ingress": map[string]any{"engine": "envoy"}}},
	}
}

func renderer() chartrenderer.Interface {
	return chartrenderer.NewWithServerVersion(&version.Info{GitVersion: "v1.33.0", Major: "1", Minor: "33"})
}

func withGardener(values map[string]any) map[string]any {
	v := map[string]any{"gardener": gardenerValues}
	for k, x := range values {
		v[k] = x
	}
	return v
}

func render(t *testing.T, values map[string]any) *chartrenderer.RenderedChart {
	t.Helper()
	rc, err := renderer().RenderEmbeddedFS(FS, SeedChart, "tendril", namespace, withGardener(values))
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return rc
}

var codecs = func() serializer.CodecFactory {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := monitoringv1.AddToScheme(s); err != nil {
		panic(err)
	}
	return serializer.NewCodecFactory(s, serializer.EnableStrict)
}()

// decode parses every rendered manifest strictly (unknown or duplicate fields fail) into its
// typed object.
func decode(t *testing.T, rc *chartrenderer.RenderedChart) []client.Object {
	t.Helper()
	var objs []client.Object
	for _, m := range rc.Manifests {
		for doc := range strings.SplitSeq(m.Content, "\n---\n") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			obj, _, err := codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
			if err != nil {
				t.Fatalf("%s: %v\n%s", m.Name, err, doc)
			}
			objs = append(objs, obj.(client.Object))
		}
	}
	return objs
}

func find[T client.Object](t *testing.T, objs []client.Object, name string) T {
	t.Helper()
	for _, o := range objs {
		if x, ok := o.(T); ok && o.GetName() == name {
			return x
		}
	}
	var zero T
	t.Fatalf("no %T %s", zero, name)
	return zero
}

// usage builds a binary and returns the flag names its -h prints.
var usage = sync.OnceValues(func() (map[string]map[string]bool, error) {
	dir, err := os.MkdirTemp("", "tendril-charts-test")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	gocmd, err := exec.LookPath("go")
	if err != nil {
		return nil, err
	}
	cmds := []string{"tendril-seed", "tendril-ingress"}
	args := []string{"build", "-o", dir + string(filepath.Separator)}
	for _, c := range cmds {
		args = append(args, "github.com/tendril-net/tendril/cmd/"+c)
	}
	build := exec.Command(gocmd, args...)
	build.Env = append(os.Environ(), "GOTOOLCHAIN=local")
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build: %v\n%s", err, out)
	}
	flagLine := regexp.MustCompile(`(?m)^  -([a-zA-Z0-9-]+)`)
	flags := map[string]map[string]bool{}
	for _, c := range cmds {
		// -h exits 0 or 2 depending on the flag set's error handling; the text is what counts.
		out, _ := exec.Command(filepath.Join(dir, c), "-h").CombinedOutput()
		flags[c] = map[string]bool{}
		for _, m := range flagLine.FindAllStringSubmatch(string(out), -1) {
			flags[c][m[1]] = true
		}
		if len(flags[c]) == 0 {
			return nil, fmt.Errorf("%s -h printed no flags:\n%s", c, out)
		}
	}
	return flags, nil
})

// parseArgs turns --name=value / --name arguments into a map; anything else fails.
func parseArgs(t *testing.T, container string, args []string, known map[string]bool) map[string][]string {
	t.Helper()
	m := map[string][]string{}
	for _, a := range args {
		name, value, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") {
			t.Errorf("%s: argument %q is not --flag[=value]", container, a)
			continue
		}
		if !ok {
			value = "true"
		}
		if !known[name] {
			t.Errorf("%s: flag --%s is not in its -h", container, name)
		}
		m[name] = append(m[name], value)
	}
	return m
}

func addrPort(t *testing.T, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	return int32(n)
}

func containerPorts(c corev1.Container) map[string]int32 {
	m := map[string]int32{}
	for _, p := range c.Ports {
		m[p.Name] = p.ContainerPort
	}
	return m
}

func TestRender(t *testing.T) {
	flags, err := usage()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases(t) {
		t.Run(tc.name, func(t *testing.T) {
			rc := render(t, tc.values)
			golden(t, filepath.Join("testdata", tc.name+".yaml"), rc.Manifest())
			objs := decode(t, rc)
			checkObjects(t, objs)
			checkSeed(t, objs, flags["tendril-seed"])
			checkIngress(t, objs, flags["tendril-ingress"])
			checkIngressPDB(t, objs)
			checkPodSecurity(t, objs)
		})
	}
}

func golden(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./charts -update)", err)
	}
	if !bytes.Equal(got, want) {
		g, w := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
		i := 0
		for i < len(g) && i < len(w) && g[i] == w[i] {
			i++
		}
		line := func(l []string) string {
			if i < len(l) {
				return l[i]
			}
			return "<end of file>"
		}
		t.Errorf("%s is stale (go test ./charts -update): line %d is %q, rendered %q", path, i+1, line(w), line(g))
	}
}

// checkObjects: namespaced objects in the release namespace, cluster-scoped ones named by
// CONV-03, Services and PodDisruptionBudgets select pods that exist, named ports exist.
func checkObjects(t *testing.T, objs []client.Object) {
	deployments := map[string]*appsv1.Deployment{}
	for _, o := range objs {
		if d, ok := o.(*appsv1.Deployment); ok {
			deployments[d.Name] = d
		}
	}
	selects := func(sel map[string]string) []*appsv1.Deployment {
		var ds []*appsv1.Deployment
		for _, d := range deployments {
			if len(sel) > 0 && labels.SelectorFromSet(sel).Matches(labels.Set(d.Spec.Template.Labels)) {
				ds = append(ds, d)
			}
		}
		return ds
	}
	for _, o := range objs {
		switch x := o.(type) {
		case *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding:
			if !strings.HasPrefix(o.GetName(), "extensions.gardener.cloud:extension-tendril:") {
				t.Errorf("%T %s: want extensions.gardener.cloud:extension-tendril:<name> (CONV-03)", o, o.GetName())
			}
		case *rbacv1.Role, *rbacv1.RoleBinding:
			// The seed-level DNSRecord's rights are in garden; tendril's own in its namespace.
			if ns := o.GetNamespace(); ns != namespace && (ns != "garden" || !strings.HasPrefix(o.GetName(), "extensions.gardener.cloud:extension-tendril:")) {
				t.Errorf("%T %s/%s: want namespace %s, or garden with a CONV-03 name", o, ns, o.GetName(), namespace)
			}
		case *apiextensionsv1.CustomResourceDefinition:
		case *monitoringv1.PrometheusRule:
			// Gardener's seed monitoring reads contributions in garden (docs/extensions/logging-and-monitoring.md).
			if o.GetNamespace() != "garden" || o.GetLabels()["prometheus"] != "seed" {
				t.Errorf("PrometheusRule %s/%s labels %v: want garden and prometheus=seed", o.GetNamespace(), o.GetName(), o.GetLabels())
			}
		case *corev1.ConfigMap:
			if o.GetLabels()["dashboard.monitoring.gardener.cloud/seed"] == "true" {
				if o.GetNamespace() != "garden" {
					t.Errorf("dashboard ConfigMap %s in %q, want garden", o.GetName(), o.GetNamespace())
				}
			} else if o.GetNamespace() != namespace {
				t.Errorf("%T %s: namespace %q, want %q", o, o.GetName(), o.GetNamespace(), namespace)
			}
		default:
			if o.GetNamespace() != namespace {
				t.Errorf("%T %s: namespace %q, want %q", o, o.GetName(), o.GetNamespace(), namespace)
			}
			_ = x
		}
		switch x := o.(type) {
		case *corev1.Service:
			sel := x.Spec.Selector
			if _, ok := sel[tendrilv1alpha1.XDSLeaderLabel]; ok {
				// The label is the leader's, set on its Pod at run time (--pod-name).
				sel = maps.Clone(sel)
				delete(sel, tendrilv1alpha1.XDSLeaderLabel)
				for _, d := range selects(sel) {
					if !slices.ContainsFunc(d.Spec.Template.Spec.Containers, func(c corev1.Container) bool {
						return slices.Contains(c.Args, "--pod-name=$(POD_NAME)")
					}) {
						t.Errorf("Service %s selects the xDS leader label, which no container of %s sets (--pod-name)", x.Name, d.Name)
					}
				}
			}
			ds := selects(sel)
			if len(ds) != 1 {
				t.Errorf("Service %s selects %d Deployments", x.Name, len(ds))
				continue
			}
			for _, p := range x.Spec.Ports {
				// Numbers only: Gardener's resource manager names its NetworkPolicies and the
				// pod labels it selects after the target port, and the labels carry numbers.
				if p.TargetPort.Type != intstr.Int {
					t.Errorf("Service %s port %s: target %q is a name; GRM would select pods labelled …-tcp-%s", x.Name, p.Name, p.TargetPort.String(), p.TargetPort.String())
					continue
				}
				if !slices.ContainsFunc(ds[0].Spec.Template.Spec.Containers, func(c corev1.Container) bool {
					return slices.Contains(slices.Collect(maps.Values(containerPorts(c))), p.TargetPort.IntVal)
				}) {
					t.Errorf("Service %s port %s: target %q is no container port of %s", x.Name, p.Name, p.TargetPort.String(), ds[0].Name)
				}
			}
		case *policyv1.PodDisruptionBudget:
			if ds := selects(x.Spec.Selector.MatchLabels); len(ds) != 1 {
				t.Errorf("PodDisruptionBudget %s selects %d Deployments", x.Name, len(ds))
			}
		case *appsv1.Deployment:
			if !labels.SelectorFromSet(x.Spec.Selector.MatchLabels).Matches(labels.Set(x.Spec.Template.Labels)) {
				t.Errorf("Deployment %s: selector does not match its pods", x.Name)
			}
			spec := x.Spec.Template.Spec
			if !slices.Contains([]string{v1beta1constants.PriorityClassNameSeedSystem900, v1beta1constants.PriorityClassNameSeedSystemCritical}, spec.PriorityClassName) {
				t.Errorf("Deployment %s: priorityClassName %q is not one of Gardener's seed system classes", x.Name, spec.PriorityClassName)
			}
			ann := x.Spec.Template.Annotations
			found := false
			for _, c := range spec.Containers {
				ports := containerPorts(c)
				if p, ok := ports["metrics"]; ok && strconv.Itoa(int(p)) == ann["prometheus.io/port"] {
					found = true
				}
				for _, pr := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
					if pr == nil {
						t.Errorf("Deployment %s container %s: probe missing", x.Name, c.Name)
						continue
					}
					var port string
					if pr.HTTPGet != nil {
						port = pr.HTTPGet.Port.StrVal
					} else if pr.TCPSocket != nil {
						port = pr.TCPSocket.Port.StrVal
					}
					if _, ok := ports[port]; !ok {
						t.Errorf("Deployment %s container %s: probe port %q is no container port", x.Name, c.Name, port)
					}
				}
				if c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
					t.Errorf("Deployment %s container %s: no memory request or limit", x.Name, c.Name)
				}
			}
			if ann["prometheus.io/scrape"] != "true" || !found {
				t.Errorf("Deployment %s: prometheus.io annotations %v do not name its metrics port", x.Name, ann)
			}
		}
	}
}

func checkSeed(t *testing.T, objs []client.Object, known map[string]bool) {
	d := find[*appsv1.Deployment](t, objs, "gardener-extension-tendril")
	c := d.Spec.Template.Spec.Containers[0]
	if !slices.Equal(c.Command, []string{"/tendril-seed"}) {
		t.Errorf("tendril-seed command %q", c.Command)
	}
	args := parseArgs(t, "tendril-seed", c.Args, known)
	ports := containerPorts(c)
	want := map[string]int32{
		"xds":     addrPort(t, args["xds-address"][0]),
		"metrics": addrPort(t, args["metrics-address"][0]),
		"health":  addrPort(t, args["health-bind-address"][0]),
	}
	wp, err := strconv.Atoi(args["webhook-port"][0])
	if err != nil {
		t.Fatal(err)
	}
	want["webhook"] = int32(wp)
	if fmt.Sprint(ports) != fmt.Sprint(want) {
		t.Errorf("tendril-seed container ports %v, flags say %v", ports, want)
	}
	if host, _, _ := net.SplitHostPort(args["xds-address"][0]); host != "" {
		t.Errorf("--xds-address=%s: the ingress reaches it through a Service, listen on the pod IP", args["xds-address"][0])
	}
	if img := args["image"]; len(img) != 1 || img[0] != c.Image {
		t.Errorf("--image=%v, container image %s: the shoots must run the seed's image", img, c.Image)
	}
	for _, f := range []string{"webhook-namespace", "leader-election-namespace", "heartbeat-namespace", "ingress-namespace"} {
		if v := args[f]; len(v) != 1 || v[0] != namespace {
			t.Errorf("--%s=%v, want %s", f, v, namespace)
		}
	}
	// The agents dial the seed-level DNSRecord's name, outside the seed's wildcard record
	// *.ingress.aws-eu1.example.com (gardenlet's, pointing at Istio).
	for f, want := range map[string]string{
		"ingress-address":      "tendril.aws-eu1.example.com",
		"dns-record-name":      "tendril.aws-eu1.example.com",
		"dns-provider-type":    "aws-route53",
		"dns-secret-name":      "seed-ingress",
		"dns-secret-namespace": "garden",
		"ingress-service":      "tendril-ingress",
	} {
		if v := args[f]; len(v) != 1 || v[0] != want {
			t.Errorf("--%s=%v, want %s", f, v, want)
		}
	}
	for _, a := range args["ingress-address"] {
		if strings.HasSuffix(a, ".ingress.aws-eu1.example.com") {
			t.Errorf("--ingress-address=%s lies under the seed's wildcard record", a)
		}
	}
	for _, s := range args["ingress-service"] {
		find[*corev1.Service](t, objs, s)
	}
	dnsRole := find[*rbacv1.Role](t, objs, "extensions.gardener.cloud:extension-tendril:tendril-seed")
	if dnsRole.Namespace != "garden" || !slices.ContainsFunc(dnsRole.Rules, func(r rbacv1.PolicyRule) bool {
		return slices.Contains(r.APIGroups, "extensions.gardener.cloud") && slices.Contains(r.Resources, "dnsrecords") &&
			slices.Contains(r.Verbs, "create") && slices.Contains(r.Verbs, "watch") && slices.Contains(r.Verbs, "delete")
	}) {
		t.Errorf("Role %s/%s: no dnsrecords rule for the seed DNS record: %+v", dnsRole.Namespace, dnsRole.Name, dnsRole.Rules)
	}
	binding := find[*rbacv1.RoleBinding](t, objs, dnsRole.Name)
	if binding.Namespace != "garden" || binding.RoleRef.Name != dnsRole.Name || len(binding.Subjects) != 1 ||
		binding.Subjects[0].Name != d.Spec.Template.Spec.ServiceAccountName || binding.Subjects[0].Namespace != namespace {
		t.Errorf("RoleBinding %s/%s: %+v %+v", binding.Namespace, binding.Name, binding.RoleRef, binding.Subjects)
	}
	if d.Spec.Template.Spec.ServiceAccountName != "gardener-extension-tendril" {
		t.Errorf("service account %q", d.Spec.Template.Spec.ServiceAccountName)
	}
	svc := find[*corev1.Service](t, objs, "gardener-extension-tendril")
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != want["webhook"] {
		t.Errorf("webhook Service ports %v: the webhook configuration names the webhook server's port %d", svc.Spec.Ports, want["webhook"])
	}
	role := find[*rbacv1.ClusterRole](t, objs, "extensions.gardener.cloud:extension-tendril:tendril-seed")
	for _, need := range [][2]string{
		{"extensions.gardener.cloud", "clusters"}, {"extensions.gardener.cloud", "extensions"},
		{"resources.gardener.cloud", "managedresources"},
		{"tendril.extensions.gardener.cloud", "routes"}, {"tendril.extensions.gardener.cloud", "routes/status"},
		{"apps", "deployments"}, {"", "services"}, {"networking.k8s.io", "networkpolicies"}, {"", "secrets"},
		{"", "configmaps"}, {"discovery.k8s.io", "endpointslices"},
		{"", "events"}, {"", "namespaces"}, {"admissionregistration.k8s.io", "mutatingwebhookconfigurations"},
	} {
		if !slices.ContainsFunc(role.Rules, func(r rbacv1.PolicyRule) bool {
			return slices.Contains(r.APIGroups, need[0]) && slices.Contains(r.Resources, need[1])
		}) {
			t.Errorf("ClusterRole: no rule for %s %s", need[0], need[1])
		}
	}
	// Nothing reads pods since the pod-proxy tunnel probe went: least privilege.
	for _, r := range role.Rules {
		for _, res := range r.Resources {
			if res == "pods" || strings.HasPrefix(res, "pods/") {
				t.Errorf("ClusterRole: rule for %s, which nothing reads", res)
			}
		}
	}
	lease := find[*rbacv1.Role](t, objs, "gardener-extension-tendril")
	if len(lease.Rules) == 0 || !slices.Contains(lease.Rules[0].Resources, "leases") {
		t.Errorf("Role: no leases rule")
	}
	// The xDS leader lists its namespace's Pods (an uncached read) and moves
	// tendrilv1alpha1.XDSLeaderLabel onto its own.
	if !slices.ContainsFunc(lease.Rules, func(r rbacv1.PolicyRule) bool {
		return slices.Contains(r.Resources, "pods") && slices.Contains(r.Verbs, "list") && slices.Contains(r.Verbs, "patch")
	}) {
		t.Errorf("Role: no rule to list and patch the Pods of its namespace (the xDS leader label)")
	}
	find[*apiextensionsv1.CustomResourceDefinition](t, objs, "routes.tendril.extensions.gardener.cloud")
}

// checkIngress: the listener ports are the ones xds/translate generates, the ingress dials the
// xDS Service, and its LoadBalancer Service has ports 443, 8443 and 8132.
func checkIngress(t *testing.T, objs []client.Object, known map[string]bool) {
	d := find[*appsv1.Deployment](t, objs, "tendril-ingress")
	seed := find[*appsv1.Deployment](t, objs, "gardener-extension-tendril")
	if len(d.Spec.Template.Spec.Containers) != 1 {
		t.Fatalf("ingress containers: %d", len(d.Spec.Template.Spec.Containers))
	}
	c := d.Spec.Template.Spec.Containers[0]
	ports := containerPorts(c)
	listeners := map[string]int32{
		translate.SNIListener: translate.SNIPort, translate.ProxyListener: translate.ProxyPort, translate.TunnelListener: translate.TunnelPort,
	}
	for name, port := range listeners {
		if ports[name] != port {
			t.Errorf("ingress container port %s = %d, xds/translate binds listener %s on %d", name, ports[name], name, port)
		}
	}
	xdsSvc := find[*corev1.Service](t, objs, "tendril-xds")
	certDir := checkXDSClientSecret(t, seed, d, c)
	xdsAddr := net.JoinHostPort("tendril-xds."+namespace+".svc", strconv.Itoa(int(xdsSvc.Spec.Ports[0].Port)))
	switch c.Name {
	case "tendril-ingress":
		if c.Image != seed.Spec.Template.Spec.Containers[0].Image {
			t.Errorf("tendril-ingress image %s, tendril-seed's %s: one image", c.Image, seed.Spec.Template.Spec.Containers[0].Image)
		}
		args := parseArgs(t, "tendril-ingress", c.Args, known)
		for name := range listeners {
			if v := args[name+"-address"]; len(v) != 1 || addrPort(t, v[0]) != ports[name] {
				t.Errorf("--%s-address=%v, container port %d", name, v, ports[name])
			}
		}
		if v := args["metrics-address"]; len(v) != 1 || addrPort(t, v[0]) != ports["metrics"] {
			t.Errorf("--metrics-address=%v, container port %d", v, ports["metrics"])
		}
		if v := args["xds"]; len(v) != 1 || v[0] != xdsAddr {
			t.Errorf("--xds=%v, want %s", v, xdsAddr)
		}
		if v := args["node-id"]; len(v) != 1 || v[0] != "$(POD_NAME)" {
			t.Errorf("--node-id=%v, want the pod name", v)
		}
		for flag, file := range map[string]string{"xds-cert-file": "tls.crt", "xds-key-file": "tls.key", "xds-ca-file": "ca.crt"} {
			if v := args[flag]; len(v) != 1 || v[0] != certDir+"/"+file {
				t.Errorf("--%s=%v, want %s/%s (the xDS client Secret)", flag, v, certDir, file)
			}
		}
		if _, ok := args["xds-insecure"]; ok {
			t.Error("tendril-ingress --xds-insecure: xDS must be mutual TLS on a seed")
		}
		checkDrain(t, d, args)
	case "envoy":
		cm := find[*corev1.ConfigMap](t, objs, "tendril-ingress-envoy")
		checkEnvoyBootstrap(t, cm.Data, xdsAddr, ports["metrics"], certDir)
	default:
		t.Errorf("ingress container %s", c.Name)
	}
	// The labels Gardener's resource manager selects (docs/network-paths.md proves the paths):
	// tendril-xds in this namespace, every shoot's kube-apiserver and tendril-server tunnel port
	// (alias all-shoots), and nothing more of tendril-server.
	podLabels := d.Spec.Template.Labels
	for _, key := range []string{
		gardenerutils.NetworkPolicyLabel("tendril-xds", xdsSvc.Spec.Ports[0].TargetPort.IntVal),
		"networking.resources.gardener.cloud/to-all-shoots-kube-apiserver-tcp-443",
		manifest.IngressLabelToServerTunnel(),
		v1beta1constants.LabelNetworkPolicyToDNS,
	} {
		if podLabels[key] != v1beta1constants.LabelNetworkPolicyAllowed {
			t.Errorf("ingress pods lack %s=allowed: %v", key, podLabels)
		}
	}
	for key := range podLabels {
		if strings.Contains(key, manifest.ServerName) && key != manifest.IngressLabelToServerTunnel() {
			t.Errorf("ingress pods may reach more of tendril-server than its tunnel port: %s", key)
		}
	}
	svc := find[*corev1.Service](t, objs, "tendril-ingress")
	if want := `[{"protocol":"TCP","port":443},{"protocol":"TCP","port":8443},{"protocol":"TCP","port":8132}]`; svc.Annotations["networking.resources.gardener.cloud/from-world-to-ports"] != want {
		t.Errorf("ingress Service from-world-to-ports %q, want %s", svc.Annotations["networking.resources.gardener.cloud/from-world-to-ports"], want)
	}
	if svc.Spec.Type != corev1.ServiceTypeLoadBalancer {
		t.Errorf("ingress Service type %s", svc.Spec.Type)
	}
	var got []int32
	for _, p := range svc.Spec.Ports {
		got = append(got, p.Port)
	}
	if !slices.Equal(got, []int32{443, 8443, 8132}) {
		t.Errorf("ingress Service ports %v, want 443, 8443, 8132", got)
	}
	if svc.Annotations["service.beta.kubernetes.io/aws-load-balancer-type"] != "nlb" {
		t.Errorf("ingress Service on an aws seed: annotations %v", svc.Annotations)
	}
}

// checkDrain: the pod's grace period covers tendril-ingress's drain (--drain-delay, then
// --drain-timeout) with time to exit before SIGKILL, and the ingress PodDisruptionBudget lets
// one replica at a time go while another serves.
func checkDrain(t *testing.T, d *appsv1.Deployment, args map[string][]string) {
	t.Helper()
	var drain time.Duration
	for _, f := range []string{"drain-delay", "drain-timeout"} {
		v := args[f]
		if len(v) != 1 {
			t.Errorf("--%s=%v: the chart sets it", f, v)
			continue
		}
		dur, err := time.ParseDuration(v[0])
		if err != nil {
			t.Errorf("--%s=%s: %v", f, v[0], err)
		}
		drain += dur
	}
	const margin = 5 * time.Second // the process's exit after the drain, with room to spare
	grace := 30 * time.Second      // unset: Kubernetes's default
	if g := d.Spec.Template.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = time.Duration(*g) * time.Second
	}
	if grace < drain+margin {
		t.Errorf("terminationGracePeriodSeconds %v: the drain takes up to %v, want at least %v more", grace, drain, margin)
	}
}

// checkIngressPDB: with several ingress replicas evictions take one at a time (it drains while
// the others serve); a single replica may be evicted, so it never blocks a node's drain.
func checkIngressPDB(t *testing.T, objs []client.Object) {
	t.Helper()
	d := find[*appsv1.Deployment](t, objs, "tendril-ingress")
	pdb := find[*policyv1.PodDisruptionBudget](t, objs, "tendril-ingress")
	replicas := int32(1)
	if d.Spec.Replicas != nil {
		replicas = *d.Spec.Replicas
	}
	if pdb.Spec.MinAvailable != nil || pdb.Spec.MaxUnavailable == nil {
		t.Fatalf("ingress PodDisruptionBudget: want maxUnavailable, got %+v", pdb.Spec)
	}
	if n := pdb.Spec.MaxUnavailable.IntValue(); n < 1 || (replicas > 1 && int32(n) >= replicas) {
		t.Errorf("ingress PodDisruptionBudget maxUnavailable %d with %d replicas: want 1 up to replicas-1", n, replicas)
	}
}

// checkPodSecurity evaluates every pod template against the restricted Pod Security Standard,
// the level the ControllerRegistration enforces.
func checkPodSecurity(t *testing.T, objs []client.Object) {
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	lv := api.LevelVersion{Level: api.LevelRestricted, Version: api.LatestVersion()}
	for _, o := range objs {
		d, ok := o.(*appsv1.Deployment)
		if !ok {
			continue
		}
		for _, r := range eval.EvaluatePod(lv, &d.Spec.Template.ObjectMeta, &d.Spec.Template.Spec) {
			if !r.Allowed {
				t.Errorf("Deployment %s violates restricted: %s: %s", d.Name, r.ForbiddenReason, r.ForbiddenDetail)
			}
		}
	}
}

// TestRenderDNS: the seed-level DNSRecord's flags and the agents' address for each way of
// configuring (or not configuring) a DNS provider.
func TestRenderDNS(t *testing.T) {
	noProvider := map[string]any{}
	for k, v := range gardenerValues {
		noProvider[k] = v
	}
	seed := map[string]any{}
	for k, v := range gardenerValues["seed"].(map[string]any) {
		seed[k] = v
	}
	delete(seed, "spec")
	noProvider["seed"] = seed
	for name, tc := range map[string]struct {
		values                   map[string]any
		record, typ, ingressAddr string
	}{
		"seed provider": {withGardener(nil), "tendril.aws-eu1.example.com", "aws-route53", "tendril.aws-eu1.example.com"},
		"no provider":   {map[string]any{"gardener": noProvider}, "", "", "tendril.ingress.aws-eu1.example.com"},
		"explicit provider": {map[string]any{"gardener": noProvider, "dns": map[string]any{"provider": map[string]any{"type": "google-clouddns"}}},
			"tendril.aws-eu1.example.com", "google-clouddns", "tendril.aws-eu1.example.com"},
		"disabled": {withGardener(map[string]any{"dns": map[string]any{"enabled": false}}), "", "", "tendril.ingress.aws-eu1.example.com"},
		"name":     {withGardener(map[string]any{"dns": map[string]any{"name": "sni.seeds.example.org"}}), "sni.seeds.example.org", "aws-route53", "sni.seeds.example.org"},
		"ingress address wins": {withGardener(map[string]any{"ingress": map[string]any{"address": "203.0.113.7"}}),
			"tendril.aws-eu1.example.com", "aws-route53", "203.0.113.7"},
	} {
		t.Run(name, func(t *testing.T) {
			rc, err := renderer().RenderEmbeddedFS(FS, SeedChart, "tendril", namespace, tc.values)
			if err != nil {
				t.Fatal(err)
			}
			d := find[*appsv1.Deployment](t, decode(t, rc), "gardener-extension-tendril")
			args := map[string]string{}
			for _, a := range d.Spec.Template.Spec.Containers[0].Args {
				k, v, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				args[k] = v
			}
			if args["dns-record-name"] != tc.record || args["dns-provider-type"] != tc.typ || args["ingress-address"] != tc.ingressAddr {
				t.Errorf("--dns-record-name=%q --dns-provider-type=%q --ingress-address=%q, want %q %q %q",
					args["dns-record-name"], args["dns-provider-type"], args["ingress-address"], tc.record, tc.typ, tc.ingressAddr)
			}
		})
	}
}

func TestRenderErrors(t *testing.T) {
	for name, tc := range map[string]struct {
		values map[string]any
		want   string
	}{
		"engine":  {map[string]any{"gardener": gardenerValues, "ingress": map[string]any{"engine": "istio"}}, `ingress.engine "istio"`},
		"address": {map[string]any{}, "set ingress.address"},
		"dns name": {map[string]any{"gardener": map[string]any{"seed": map[string]any{"ingressDomain": "example.com"}},
			"dns": map[string]any{"provider": map[string]any{"type": "aws-route53"}}}, "set dns.name"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := renderer().RenderEmbeddedFS(FS, SeedChart, "tendril", namespace, tc.values)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestCRDsInstall(t *testing.T) {
	objs := decode(t, render(t, map[string]any{"crds": map[string]any{"install": false}}))
	for _, o := range objs {
		if _, ok := o.(*apiextensionsv1.CustomResourceDefinition); ok {
			t.Errorf("crds.install=false rendered CRD %s", o.GetName())
		}
	}
}

// checkXDSClientSecret checks that the ingress container mounts the Secret tendril-seed writes
// the xDS client certificate into (--xds-client-secret), for the Deployment name it names as
// the certificate's (--xds-client-name), and returns the mount's directory.
func checkXDSClientSecret(t *testing.T, seed, ingress *appsv1.Deployment, c corev1.Container) string {
	t.Helper()
	seedArgs := map[string]string{}
	for _, a := range seed.Spec.Template.Spec.Containers[0].Args {
		if k, v, ok := strings.Cut(strings.TrimPrefix(a, "--"), "="); ok {
			seedArgs[k] = v
		}
	}
	if _, ok := seedArgs["xds-insecure"]; ok {
		t.Error("tendril-seed --xds-insecure: xDS must be mutual TLS on a seed")
	}
	if seedArgs["xds-client-name"] != ingress.Name {
		t.Errorf("tendril-seed --xds-client-name=%q, the ingress Deployment is %s: its Pods' node IDs would be refused", seedArgs["xds-client-name"], ingress.Name)
	}
	secret := seedArgs["xds-client-secret"]
	var volume string
	for _, v := range ingress.Spec.Template.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == secret && secret != "" {
			volume = v.Name
		}
	}
	for _, m := range c.VolumeMounts {
		if m.Name == volume && volume != "" {
			if !m.ReadOnly {
				t.Errorf("%s mounts the xDS client Secret writable", c.Name)
			}
			return m.MountPath
		}
	}
	t.Errorf("%s does not mount the xDS client Secret %q (tendril-seed --xds-client-secret)", c.Name, secret)
	return ""
}
