package wire_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/translate"
)

// gardenerDestination is the grammar of X-Gardener-Destination as Gardener's istio ingress
// gateway routes it on the unified port: the regex of its http-proxy EnvoyFilter, read from the
// gardener module this project builds against (not a copy of it).
func gardenerDestination(t testing.TB) *regexp.Regexp {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/gardener/gardener").Output()
	if err != nil {
		t.Fatalf("go list the gardener module: %v", err)
	}
	path := filepath.Join(strings.TrimSpace(string(out)), "pkg/component/networking/istio/charts/istio/istio-ingress/templates/http-proxy-envoy-filter.yaml")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*regex: '([^']+)'\s*$`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s: no X-Gardener-Destination regex", path)
	}
	// Envoy's safe_regex matches the whole value, as the regex's own anchors also say.
	re, err := regexp.Compile(string(m[1]))
	if err != nil {
		t.Fatalf("%s: Gardener's regex does not compile as RE2: %v", path, err)
	}
	return re
}

// shootNamespace is Gardener's form of a shoot's control-plane namespace: shoot--<project>--<name>.
var shootNamespace = regexp.MustCompile(`^shoot--[a-z0-9]+(-[a-z0-9]+)*--[a-z0-9]+(-[a-z0-9]+)*$`)

// gardenerNames are the destinations of shoot ns that Gardener's gateway routes: its
// kube-apiserver and its VPN servers, single and HA.
func gardenerNames(ns string) []string {
	names := []string{wire.APIServerWireName(ns), wire.GardenerVPNWireName(ns, -1)}
	for i := range 5 {
		names = append(names, wire.GardenerVPNWireName(ns, i))
	}
	return names
}

// TestWireNamesInGardenersGrammar: every Gardener destination tendril spells is one Gardener's
// gateway routes too, so that a shoot moves between the two without a change of its clients;
// tendril's own tunnel name is outside it, so that Gardener's gateway never takes a tendril agent
// for its VPN (and tendril's ingress never takes Gardener's VPN for its own).
func TestWireNamesInGardenersGrammar(t *testing.T) {
	re := gardenerDestination(t)
	for _, ns := range []string{"shoot--local--a", "shoot--garden--x-1", "shoot--p-1--s-2-b"} {
		for _, name := range gardenerNames(ns) {
			if !re.MatchString(name) {
				t.Errorf("%q is outside Gardener's X-Gardener-Destination grammar %s", name, re)
			}
		}
		if name := wire.TendrilServerWireName(ns); re.MatchString(name) {
			t.Errorf("tendril's own %q is inside Gardener's grammar", name)
		}
	}
	// And the grammar refuses what is not a destination: the check can fail.
	for _, bad := range []string{"", "kube-apiserver", "outbound|443||kube-apiserver.shoot--a--b.svc.cluster.local.evil", "outbound|22||sshd.shoot--a--b.svc.cluster.local",
		"outbound|1194||vpn-seed-server-5.shoot--a--b.svc.cluster.local"} {
		if re.MatchString(bad) {
			t.Errorf("Gardener's grammar accepts %q", bad)
		}
	}
}

// FuzzWireNamesInGardenersGrammar: for any shoot namespace of Gardener's form, tendril's
// spelling of Gardener's names is inside Gardener's grammar and its own tunnel name outside.
func FuzzWireNamesInGardenersGrammar(f *testing.F) {
	re := gardenerDestination(f)
	for _, s := range []string{"shoot--local--a", "shoot--a-b--c-d", "shoot--x--y"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ns string) {
		if !shootNamespace.MatchString(ns) {
			return
		}
		for _, name := range gardenerNames(ns) {
			if !re.MatchString(name) {
				t.Errorf("%q is outside Gardener's grammar", name)
			}
		}
		if name := wire.TendrilServerWireName(ns); re.MatchString(name) {
			t.Errorf("tendril's own %q is inside Gardener's grammar", name)
		}
	})
}

// FuzzIngressGuardWithinGardenersGrammar: what tendril's ingress admits on the unified port is
// Gardener's grammar plus tendril's own tunnel names: the relay's guard
// (translate.GardenerGatewayRegex) admits nothing Gardener's gateway would refuse, and the routing
// guard (translate.ProxyDestinationRegex) nothing but Gardener's kube-apiserver names and
// tendril's tunnel names, so no client can rely on tendril for a destination Gardener does not
// route, and no Gardener VPN name is routed by tendril itself.
func FuzzIngressGuardWithinGardenersGrammar(f *testing.F) {
	re := gardenerDestination(f)
	guard := regexp.MustCompile(translate.ProxyDestinationRegex)
	relay := regexp.MustCompile(translate.GardenerGatewayRegex)
	tendril := regexp.MustCompile(translate.TunnelDestinationRegex)
	// An HA shoot's server replicas, by their pod names under the tendril-server Service.
	replica := regexp.MustCompile(`^outbound\|1194\|\|tendril-server-[0-9]\.tendril-server\.[a-z0-9]([-a-z0-9]*[a-z0-9])?\.svc\.cluster\.local$`)
	for _, s := range []string{wire.APIServerWireName("shoot--a--b"), wire.TendrilServerWireName("x"), wire.GardenerVPNWireName("x", 3),
		wire.TendrilServerReplicaWireName("shoot--a--b", "tendril-server-1"),
		"outbound|443||kube-apiserver.a-.svc.cluster.local", "shoot--a--b--kube-apiserver-socket"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		if relay.MatchString(v) && !re.MatchString(v) {
			t.Errorf("tendril's relay admits %q, Gardener's grammar does not", v)
		}
		if relay.MatchString(v) && guard.MatchString(v) {
			t.Errorf("%q is both relayed and routed", v)
		}
		if guard.MatchString(v) && !re.MatchString(v) && !tendril.MatchString(v) && !replica.MatchString(v) {
			t.Errorf("tendril's ingress admits %q, which is neither in Gardener's grammar nor one of tendril's tunnel names", v)
		}
	})
}
