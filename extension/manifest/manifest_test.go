package manifest

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
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
			AgentAddress:    netip.MustParseAddr("fd8f:6d53:b97a:1::2"),
			ServerPublicKey: "c2VydmVyLXB1YmxpYy1rZXktMzItYnl0ZXMtbG9uZyE=",
			AgentPublicKey:  "YWdlbnQtcHVibGljLWtleS0zMi1ieXRlcy1sb25nISE=",
			AgentPrivateKey: "YWdlbnQtcHJpdmF0ZS1rZXktMzItYnl0ZXMtbG9uZyE=",
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
	for name, objs := range map[string][]client.Object{
		"seed.yaml":            append(SeedObjects(v), Route(v)),
		"shoot.yaml":           ShootObjects(v),
		"seed-hibernated.yaml": SeedObjects(hib),
		"shoot-no-proxy.yaml":  ShootObjects(hib),
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

func TestValidate(t *testing.T) {
	for name, mutate := range map[string]func(*Values){
		"no namespace":          func(v *Values) { v.Namespace = "" },
		"no image":              func(v *Values) { v.Image = "" },
		"no cidrs":              func(v *Values) { v.ShootCIDRs = nil },
		"no hostnames":          func(v *Values) { v.Hostnames = nil },
		"no ingress":            func(v *Values) { v.Ingress = "" },
		"no agent key":          func(v *Values) { v.Tunnel.AgentPublicKey = "" },
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
	for in, want := range map[string]string{"ingress.example.org": "ingress.example.org:8132", "192.0.2.1": "192.0.2.1:8132", "2001:db8::1": "[2001:db8::1]:8132"} {
		if got := hostPort(in, PortIngressTunnel); got != want {
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
