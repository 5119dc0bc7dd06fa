package charts

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/agent/vpn"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/seedserver/seedservertest"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/kubesource"
	xdsserver "github.com/tendril-net/tendril/xds/server"
)

// exporter is the registry a binary serves on /metrics, recording the descriptors of every
// collector registered with it: a labelled vector has no sample before its first label value,
// but its descriptor names it and its labels.
type exporter struct {
	reg    *prometheus.Registry
	labels map[string]map[string]bool // series name → label names
}

func newExporter() *exporter {
	return &exporter{reg: prometheus.NewRegistry(), labels: map[string]map[string]bool{}}
}

var descRE = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", .*constLabels: \{([^}]*)\}, variableLabels: \{([^}]*)\}\}$`)

func (e *exporter) Register(c prometheus.Collector) error {
	if err := e.reg.Register(c); err != nil {
		return err
	}
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		m := descRE.FindStringSubmatch(d.String())
		if m == nil {
			return fmt.Errorf("unparsable descriptor %s", d)
		}
		ls := map[string]bool{}
		for _, kv := range strings.Split(m[2], ",") {
			if k, _, ok := strings.Cut(kv, "="); ok {
				ls[k] = true
			}
		}
		for _, l := range strings.Split(m[3], ",") {
			if l != "" {
				ls[strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")")] = true
			}
		}
		// A histogram is scraped as three series; which one a descriptor is does not show,
		// so every declared name gets the histogram series' names too: the check is that a
		// name was declared, not that it is a histogram.
		for _, name := range []string{m[1], m[1] + "_bucket", m[1] + "_sum", m[1] + "_count"} {
			if e.labels[name] == nil {
				e.labels[name] = map[string]bool{}
			}
			for l := range ls {
				e.labels[name][l] = true
			}
		}
		e.labels[m[1]+"_bucket"]["le"] = true
	}
	return nil
}

func (e *exporter) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := e.Register(c); err != nil {
			panic(err)
		}
	}
}

func (e *exporter) Unregister(c prometheus.Collector) bool { return e.reg.Unregister(c) }

// scrape serves the registry as the binary does and reads /metrics back: the registry must
// gather cleanly, and every series it shows must have been declared.
func (e *exporter) scrape(t *testing.T, binary string) {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(e.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%s /metrics: %d %v\n%s", binary, resp.StatusCode, err, body)
	}
	for _, line := range strings.Split(string(body), "\n") {
		if name, _, _ := strings.Cut(line, "{"); line != "" && !strings.HasPrefix(line, "#") {
			name, _, _ = strings.Cut(name, " ")
			if e.labels[name] == nil {
				t.Errorf("%s serves %s, which no descriptor declares", binary, name)
			}
		}
	}
}

// exporters builds each binary's metric-owning components as its main does, each with the
// registry the binary serves.
func exporters(t *testing.T) map[string]*exporter {
	t.Helper()
	ex := map[string]*exporter{
		"tendril-server": newExporter(), "tendril-agent": newExporter(),
		"tendril-seed": newExporter(), "tendril-ingress": newExporter(),
	}
	seedservertest.Start(t, seedservertest.Options{Registry: ex["tendril-server"]})

	agentKey, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	serverKey, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	a, err := vpn.New(vpn.Config{
		PrivateKey: agentKey, ServerPublicKey: serverKey.PublicKey(),
		Address: seedservertest.AgentAddr, ServerAddresses: []netip.Addr{seedservertest.ServerAddr},
		ShootCIDRs: []netip.Prefix{netip.MustParsePrefix("10.250.0.0/16")},
		Seed:       "127.0.0.1:1", Destination: manifest.TunnelDestination("shoot--dev--alpha"),
		Registry: ex["tendril-agent"],
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })

	xs := xdsserver.New(xdsserver.Config{Registry: ex["tendril-seed"]})
	if _, err := kubesource.New(kubesource.Config{Server: xs, Registry: ex["tendril-seed"]}, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	ingress.New(ingress.Config{Registry: ex["tendril-ingress"]})

	for name, e := range ex {
		e.scrape(t, name)
	}
	return ex
}

// owner is the binary that exports a metric, by the name's prefix (docs/metrics.md).
func owner(metric string) string {
	for prefix, binary := range map[string]string{
		"tendril_server_": "tendril-server", "tendril_agent_": "tendril-agent",
		"tendril_ingress_": "tendril-ingress", "tendril_xds_": "tendril-seed", "tendril_kubesource_": "tendril-seed",
	} {
		if strings.HasPrefix(metric, prefix) {
			return binary
		}
	}
	return ""
}

var (
	metricRE   = regexp.MustCompile(`\btendril_[a-z0-9_]+`)
	selectorRE = regexp.MustCompile(`\b(tendril_[a-z0-9_]+)\{([^}]*)\}`)
	matcherRE  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	groupingRE = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	// label_replace(v, "dst", ...) adds the label dst.
	replaceRE = regexp.MustCompile(`label_replace\(.*?,\s*"([a-zA-Z_][a-zA-Z0-9_]*)"`)
)

// checkExpr reports every metric of expr its binary does not export, and every label a
// selector or grouping names that none of the expression's metrics has. scrapeLabels are
// the labels the scrape adds (job).
func checkExpr(t *testing.T, where, expr string, ex map[string]*exporter, scrapeLabels ...string) {
	t.Helper()
	names := metricRE.FindAllString(expr, -1)
	if len(names) == 0 {
		t.Errorf("%s: %q names no tendril metric", where, expr)
	}
	all := map[string]bool{}
	for _, l := range scrapeLabels {
		all[l] = true
	}
	for _, n := range names {
		e := ex[owner(n)]
		if e == nil || e.labels[n] == nil {
			t.Errorf("%s: %s is not exported by %q", where, n, owner(n))
			continue
		}
		for l := range e.labels[n] {
			all[l] = true
		}
	}
	for _, m := range selectorRE.FindAllStringSubmatch(expr, -1) {
		e := ex[owner(m[1])]
		if e == nil {
			continue
		}
		for _, lm := range matcherRE.FindAllStringSubmatch(m[2], -1) {
			if !e.labels[m[1]][lm[1]] && !slices.Contains(scrapeLabels, lm[1]) {
				t.Errorf("%s: %s has no label %q", where, m[1], lm[1])
			}
		}
	}
	for _, m := range replaceRE.FindAllStringSubmatch(expr, -1) {
		all[m[1]] = true
	}
	for _, g := range groupingRE.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(g[1], ",") {
			if l = strings.TrimSpace(l); l != "" && !all[l] {
				t.Errorf("%s: groups by %q, which none of its metrics has", where, l)
			}
		}
	}
}

// promtoolCheck runs Prometheus's own rule checker (Debian's prometheus package) on groups.
func promtoolCheck(t *testing.T, name string, groups []monitoringv1.RuleGroup) string {
	t.Helper()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (apt-get install prometheus): %v", err)
	}
	b, err := yaml.Marshal(map[string]any{"groups": groups})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), name+".yaml")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("promtool check rules %s: %v\n%s\n%s", name, err, out, b)
	}
	return path
}

// promtoolTest runs the unit tests testdata/rules/<name>.test.yaml against the rules file
// promtoolCheck wrote: each alert fires when it should, with its labels and annotations.
func promtoolTest(t *testing.T, name, rules string) {
	t.Helper()
	tests, err := os.ReadFile(filepath.Join("testdata", "rules", name+".test.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(filepath.Dir(rules), name+".test.yaml")
	if err := os.WriteFile(path, tests, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("promtool", "test", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules testdata/rules/%s.test.yaml: %v\n%s", name, err, out)
	}
}

// TestMonitoring: every rule and dashboard expression parses and checks with promtool, and
// every metric and label it names is exported by the binary that owns it; the shoot
// Prometheus's scrape allow lists keep every metric the shoot rules use.
func TestMonitoring(t *testing.T) {
	ex := exporters(t)

	// Seed: the chart's PrometheusRule and dashboard.
	seedRule := find[*monitoringv1.PrometheusRule](t, decode(t, render(t, nil)), "seed-tendril")
	promtoolTest(t, "seed", promtoolCheck(t, "seed", seedRule.Spec.Groups))
	for _, g := range seedRule.Spec.Groups {
		for _, r := range g.Rules {
			checkExpr(t, "seed rule "+r.Alert, r.Expr.String(), ex)
		}
	}
	var dash struct {
		Panels []struct {
			Title, Type string
			Datasource  string
			Targets     []struct{ Expr string }
		}
	}
	raw, err := FS.ReadFile(SeedChart + "/dashboards/tendril.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	// promtool checks expressions only inside rules: each panel query becomes a recording rule.
	dashGroup := monitoringv1.RuleGroup{Name: "dashboard"}
	for _, p := range dash.Panels {
		// The seed Prometheus's data source in Gardener's seed Plutono.
		if p.Type != "row" && p.Datasource != "prometheus-seed" {
			t.Errorf("dashboard panel %q: data source %q, want prometheus-seed", p.Title, p.Datasource)
		}
		for _, tg := range p.Targets {
			checkExpr(t, fmt.Sprintf("dashboard panel %q", p.Title), tg.Expr, ex)
			dashGroup.Rules = append(dashGroup.Rules, monitoringv1.Rule{
				Record: fmt.Sprintf("tendril:dashboard:%d", len(dashGroup.Rules)), Expr: intstr.FromString(tg.Expr),
			})
		}
	}
	if len(dashGroup.Rules) == 0 {
		t.Error("dashboard has no queries")
	}
	promtoolCheck(t, "dashboard", []monitoringv1.RuleGroup{dashGroup})

	// Shoot: the extension's PrometheusRule, whose series carry the ScrapeConfigs' job label.
	shootRule := manifest.PrometheusRule(manifest.Values{Namespace: "shoot--dev--alpha"})
	promtoolTest(t, "shoot", promtoolCheck(t, "shoot", shootRule.Spec.Groups))
	kept := append(slices.Clone(manifest.ServerMetrics), manifest.AgentMetrics...)
	for _, g := range shootRule.Spec.Groups {
		for _, r := range g.Rules {
			checkExpr(t, "shoot rule "+r.Alert, r.Expr.String(), ex, "job")
			for _, n := range metricRE.FindAllString(r.Expr.String(), -1) {
				if !slices.Contains(kept, n) {
					t.Errorf("shoot rule %s: %s is dropped by the ScrapeConfigs' allow lists", r.Alert, n)
				}
			}
		}
	}
	for _, n := range kept {
		if e := ex[owner(n)]; e == nil || e.labels[n] == nil {
			t.Errorf("scrape allow list: %s is not exported by %q", n, owner(n))
		}
	}
}

// TestMetricsDoc: docs/metrics.md's table lists every metric the four binaries' exporters
// declare, with the binary and labels they declare, and no metric of theirs that they do not.
func TestMetricsDoc(t *testing.T) {
	ex := exporters(t)
	raw, err := os.ReadFile(filepath.Join("..", "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("^\\| `(tendril_[a-z0-9_]+)` \\| ([a-z]+) \\|([^|]*)\\| ([^|]+) \\| [^|]+ \\|$")
	documented := map[string]bool{}
	for _, line := range strings.Split(string(raw), "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		m := row.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("docs/metrics.md: row %q is not | `metric` | type | labels | binary | meaning |", line)
			continue
		}
		name, binary := m[1], strings.TrimSpace(m[4])
		documented[name] = true
		e := ex[owner(name)]
		if e == nil {
			continue // a binary this test does not build (egress relay, apiserver-proxy, route file, DNSRecord webhook)
		}
		if !strings.HasPrefix(binary, owner(name)) {
			t.Errorf("docs/metrics.md: %s in %q, exported by %s", name, binary, owner(name))
		}
		if e.labels[name] == nil {
			t.Errorf("docs/metrics.md: %s is not exported by %s", name, owner(name))
			continue
		}
		var labels []string
		for _, l := range strings.Split(m[3], ",") {
			if l = strings.Trim(strings.TrimSpace(l), "`"); l != "" {
				labels = append(labels, l)
			}
		}
		slices.Sort(labels)
		if want := slices.Sorted(maps.Keys(e.labels[name])); !slices.Equal(labels, want) {
			t.Errorf("docs/metrics.md: %s labels %v, exported with %v", name, labels, want)
		}
	}
	missing := map[string]string{}
	for binary, e := range ex {
		for name := range e.labels {
			base := name
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				base = strings.TrimSuffix(base, s)
			}
			if !documented[base] {
				missing[base] = binary
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(missing)) {
		t.Errorf("docs/metrics.md lacks %s (%s)", name, missing[name])
	}
}
