package translate_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/source"
	"github.com/tendril-net/tendril/xds/translate"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/out")

// TestGolden pins the Envoy JSON of every input route set and checks that every resource, and
// every typed_config inside it, passes validation.
func TestGolden(t *testing.T) {
	inputs, err := filepath.Glob("testdata/in/*.yaml")
	if err != nil || len(inputs) == 0 {
		t.Fatalf("no golden inputs: %v", err)
	}
	want := map[string]bool{}
	for _, in := range inputs {
		name := strings.TrimSuffix(filepath.Base(in), ".yaml")
		out := filepath.Join("testdata", "out", name+".json")
		want[out] = true
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			shoots, err := source.ParseRoutes(context.Background(), data, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Inputs named lb-proxy-protocol* are translated for a seed whose load balancer
			// prepends its own PROXY header; gardener-gateway* for a seed that relays
			// Gardener's VPN to its istio gateway and serves no legacy port.
			// Inputs with proxy-protocol in their name serve PROXY headers on the unified port.
			opts := translate.Options{LBProxyProtocol: strings.HasPrefix(name, "lb-proxy-protocol"), ProxyProtocol: strings.Contains(name, "proxy-protocol")}
			if strings.HasPrefix(name, "gardener-gateway") {
				opts.GardenerGateway = translate.HostPort{Host: "istio-ingressgateway.istio-ingress.svc.cluster.local", Port: 8443}
				opts.RemoveHTTPProxyLegacyPort = true
			}
			r := translate.All(opts, shoots)
			for _, m := range messages(r) {
				if err := translate.Validate(m); err != nil {
					t.Errorf("invalid resource: %v", err)
				}
			}
			got := render(t, r)
			if *update {
				if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(out, got, 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			golden, err := os.ReadFile(out)
			if err != nil {
				t.Fatalf("%v (run go test ./xds/translate -update)", err)
			}
			if !bytes.Equal(got, golden) {
				t.Errorf("%s differs from the translation (run go test ./xds/translate -update and review the diff):\n%s", out, got)
			}
		})
	}
	// Stale outputs are deleted on -update and fail the test otherwise.
	outs, _ := filepath.Glob("testdata/out/*.json")
	for _, o := range outs {
		if !want[o] {
			if *update {
				_ = os.Remove(o)
			} else {
				t.Errorf("stale golden file %s has no input", o)
			}
		}
	}
}

func messages(r translate.Resources) []proto.Message {
	var ms []proto.Message
	for _, l := range r.Listeners {
		ms = append(ms, l)
	}
	for _, c := range r.Clusters {
		ms = append(ms, c)
	}
	for _, e := range r.Endpoints {
		ms = append(ms, e)
	}
	for _, e := range r.Secrets {
		ms = append(ms, e)
	}
	return ms
}

// render prints resources as indented JSON. protojson varies its whitespace on purpose, so the
// output is compacted and indented again to be byte-stable.
func render(t *testing.T, r translate.Resources) []byte {
	t.Helper()
	var buf bytes.Buffer
	buf.WriteString("{")
	section := func(name string, ms []proto.Message, last bool) {
		fmt.Fprintf(&buf, "%q: [", name)
		for i, m := range ms {
			b, err := protojson.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			if i > 0 {
				buf.WriteString(",")
			}
			buf.Write(b)
		}
		buf.WriteString("]")
		if !last {
			buf.WriteString(",")
		}
	}
	section("listeners", messages(translate.Resources{Listeners: r.Listeners}), false)
	section("clusters", messages(translate.Resources{Clusters: r.Clusters}), false)
	// Secrets only where there are any, so that route sets without a terminating shoot render
	// as they did before the terminating mode existed.
	section("endpoints", messages(translate.Resources{Endpoints: r.Endpoints}), len(r.Secrets) == 0)
	if len(r.Secrets) > 0 {
		section("secrets", messages(translate.Resources{Secrets: r.Secrets}), true)
	}
	buf.WriteString("}")
	var compact, out bytes.Buffer
	if err := json.Compact(&compact, buf.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := json.Indent(&out, compact.Bytes(), "", "  "); err != nil {
		t.Fatal(err)
	}
	out.WriteString("\n")
	return out.Bytes()
}

// TestConstantIndependentOfShoots checks the layout's promise: the listeners do not depend on the
// shoots, and a shoot's resources do not depend on the other shoots.
func TestConstantIndependentOfShoots(t *testing.T) {
	base := translate.All(translate.Options{}, nil)
	var shoots []model.Shoot
	for i := range 100 {
		shoots = append(shoots, testShoot(i))
	}
	all := translate.All(translate.Options{}, shoots)
	if len(all.Listeners) != len(base.Listeners) {
		t.Fatalf("listeners: %d with 100 shoots, %d with none", len(all.Listeners), len(base.Listeners))
	}
	for i := range base.Listeners {
		if !proto.Equal(all.Listeners[i], base.Listeners[i]) {
			t.Errorf("listener %s changes with shoots", base.Listeners[i].GetName())
		}
	}
	alone := translate.Shoot(shoots[42])
	var clusters int
	for _, c := range all.Clusters {
		for _, a := range alone.Clusters {
			if c.GetName() == a.GetName() {
				clusters++
				if !proto.Equal(c, a) {
					t.Errorf("cluster %s depends on other shoots", a.GetName())
				}
			}
		}
	}
	// One per host and the CONNECT wire name (the test shoots have no advertised address or vpn server).
	if clusters != len(alone.Clusters) || clusters != len(shoots[42].Hosts)+1 {
		t.Errorf("found %d of shoot 42's %d clusters, want %d", clusters, len(alone.Clusters), len(shoots[42].Hosts)+1)
	}
}

// TestValidateRejects makes sure Validate looks inside typed_config: a tcp_proxy without a stat
// prefix is invalid only there, so the listener's own Validate passes it.
func TestValidateRejects(t *testing.T) {
	l := proto.Clone(translate.Constant(translate.Options{}).Listeners[0]).(*listenerv3.Listener)
	bad, err := anypb.New(&tcpproxyv3.TcpProxy{ClusterSpecifier: &tcpproxyv3.TcpProxy_Cluster{Cluster: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	l.FilterChains[0].Filters[1].ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: bad}
	if err := l.ValidateAll(); err != nil {
		t.Fatalf("the outer Validate already fails, the test proves nothing: %v", err)
	}
	err = translate.Validate(l)
	if err == nil || !strings.Contains(err.Error(), "StatPrefix") {
		t.Fatalf("Validate = %v, want an error about the tcp_proxy StatPrefix", err)
	}
}

func testShoot(i int) model.Shoot {
	return model.Shoot{
		Name:      fmt.Sprintf("shoot--p%d--s%d", i%7, i),
		Hosts:     []string{fmt.Sprintf("api.s%d.p%d.example.com", i, i%7), fmt.Sprintf("api.s%d.internal.example.com", i)},
		APIServer: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 1}), 443),
	}
}

// TestDestinationRegexes pins what the CONNECT guards admit: only the wire names tendril
// generates, of any shoot (an HA server's replicas by their pod names), and on the tunnel port
// only tendril-servers as a whole; Gardener's VPN names
// (single and HA) and kube-apiserver sockets are Gardener's, matched only by the relay's guard.
func TestDestinationRegexes(t *testing.T) {
	proxy := regexp.MustCompile(translate.ProxyDestinationRegex)
	tunnel := regexp.MustCompile(translate.TunnelDestinationRegex)
	gardener := regexp.MustCompile(translate.GardenerGatewayRegex)
	for _, tc := range []struct {
		value                   string
		proxy, tunnel, gardener bool
	}{
		{translate.APIServerWireName("shoot--dev--alpha"), true, false, false},
		{translate.TendrilServerWireName("shoot--dev--alpha"), true, true, false},
		{translate.TendrilServerReplicaWireName("shoot--dev--alpha", "tendril-server-0"), true, false, false},
		{translate.TendrilServerReplicaWireName("shoot--dev--alpha", "tendril-server-9"), true, false, false},
		{translate.TendrilServerReplicaWireName("shoot--dev--alpha", "tendril-server-10"), false, false, false},
		{translate.TendrilServerReplicaWireName("shoot--dev--alpha", "kube-apiserver-0"), false, false, false},
		{"outbound|1194||tendril-server-0.shoot--dev--alpha.svc.cluster.local", false, false, false},
		{wire.GardenerVPNWireName("shoot--dev--alpha", -1), false, true, true},
		{wire.GardenerVPNWireName("shoot--dev--alpha", 0), false, false, true},
		{wire.GardenerVPNWireName("shoot--dev--alpha", 4), false, false, true},
		{wire.GardenerVPNWireName("shoot--dev--alpha", 5), false, false, false},
		{"outbound|1194||vpn-seed-server-01.shoot--dev--alpha.svc.cluster.local", false, false, false},
		{"outbound|1194||vpn-seed-server.a.b.svc.cluster.local", false, false, false},
		{"shoot--dev--alpha--kube-apiserver-socket", false, false, true},
		{"shoot-garden-x--kube-apiserver-socket", false, false, true},
		{"x--kube-apiserver-socket", false, false, false},
		{"shoot--dev--alpha--kube-apiserver-socket.evil", false, false, false},
		{"sni|api.alpha.example.com", false, false, false},
		{"proxy|10.0.0.1:443", false, false, false},
		{"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local.evil", false, false, false},
		{"outbound|443||kube-apiserver.a.b.svc.cluster.local", false, false, false},
		{"outbound|443||kube-apiserver.-x.svc.cluster.local", false, false, false},
		{"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\n", false, false, false},
		{"", false, false, false},
	} {
		if got := proxy.MatchString(tc.value); got != tc.proxy {
			t.Errorf("proxy regex on %q: %v, want %v", tc.value, got, tc.proxy)
		}
		if got := tunnel.MatchString(tc.value); got != tc.tunnel {
			t.Errorf("tunnel regex on %q: %v, want %v", tc.value, got, tc.tunnel)
		}
		if got := gardener.MatchString(tc.value); got != tc.gardener {
			t.Errorf("Gardener gateway regex on %q: %v, want %v", tc.value, got, tc.gardener)
		}
	}
}

// TestLegacyPortAndRelay: the legacy tunnel listener goes with RemoveHTTPProxyLegacyPort, as
// Gardener's gateway port goes with its gate, and the relay's cluster exists only with a relay.
func TestLegacyPortAndRelay(t *testing.T) {
	names := func(opts translate.Options) (ls, cs []string) {
		r := translate.Constant(opts)
		for _, l := range r.Listeners {
			ls = append(ls, l.GetName())
		}
		for _, c := range r.Clusters {
			cs = append(cs, c.GetName())
		}
		return ls, cs
	}
	ls, cs := names(translate.Options{})
	if strings.Join(ls, ",") != "sni,proxy,tunnel" || strings.Join(cs, ",") != translate.BlackholeCluster {
		t.Errorf("zero options: listeners %v, clusters %v", ls, cs)
	}
	ls, cs = names(translate.Options{RemoveHTTPProxyLegacyPort: true, GardenerGateway: translate.HostPort{Host: "10.0.0.1", Port: 8443}})
	if strings.Join(ls, ",") != "sni,proxy" || strings.Join(cs, ",") != translate.BlackholeCluster+","+translate.GardenerGatewayCluster {
		t.Errorf("relay, no legacy port: listeners %v, clusters %v", ls, cs)
	}
}

// TestNoEndpoints: a shoot without a ready kube-apiserver keeps its clusters, with an empty
// assignment that still validates, and has no tunnel cluster without tunnel endpoints.
func TestNoEndpoints(t *testing.T) {
	r := translate.Shoot(model.Shoot{Name: "shoot--a--b", Hosts: []string{"api.b.example.com"}})
	if len(r.Clusters) != 2 || len(r.Endpoints) != 1 {
		t.Fatalf("%d clusters, %d assignments; want the SNI and CONNECT clusters and one assignment", len(r.Clusters), len(r.Endpoints))
	}
	if la := r.Endpoints[0]; la.GetClusterName() != translate.APIServerService("shoot--a--b") || len(la.GetEndpoints()) != 0 {
		t.Errorf("assignment %v, want %s without endpoints", la, translate.APIServerService("shoot--a--b"))
	}
	for _, m := range messages(r) {
		if err := translate.Validate(m); err != nil {
			t.Error(err)
		}
	}
}
