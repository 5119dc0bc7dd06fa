package depcheck

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/tendril-net/tendril/"

// forbidden are the import path prefixes the data plane must not reach, directly or not.
var forbidden = []string{"k8s.io/", "sigs.k8s.io/controller-runtime", "github.com/gardener/"}

// dataPlane are the packages (with everything below them) that must stay free of them: the
// connection edge and the wire names, the ingress, the tunnel, tendril-server, the agents, the
// egress relay, the benchmarks, the host and process plumbing they use, and the xDS model,
// translation, store, streams and server.
var dataPlane = []string{"wire", "edge", "ingress", "tunnel", "seedserver", "agent", "bench", "egressrelay", "cmd/tendril-egress-relay", "internal/host", "internal/proc", "xds/model", "xds/translate", "xds/store", "xds/ads", "xds/server"}

// audiences are the only folders directly below internal/: each is one audience's helpers
// (docs/architecture.md). depcheck itself is this test.
var audiences = []string{"internal/proc", "internal/host", "internal/kube", "internal/pki", "internal/testing", "internal/depcheck"}

// rule says which of the module's packages (and which outside ones) a folder's non-test code may
// import directly.
type rule struct {
	folder string
	// module are the module's folders it may import (itself always).
	module []string
	// outside are the import path prefixes outside the module and the standard library it may
	// import; nil: any.
	outside []string
	why     string
}

var rules = []rule{
	{folder: "wire", module: []string{}, outside: []string{}, why: "wire imports nothing: both planes name its strings without linking each other"},
	{folder: "edge", module: []string{"wire"}, outside: []string{"golang.org/x/sys/", "github.com/go-logr/logr"},
		why: "the connection edge is the data plane's floor: the standard library, x/sys, the log interface and wire"},
	{folder: "tunnel", module: []string{"wire", "edge", "internal/host"},
		why: "the tunnel stands on the edge and the host's Linux calls, nothing of the processes that run it"},
	{folder: "ingress", module: []string{"wire", "edge", "internal/host"}, why: "the ingress stands on the edge: no tunnel, no control plane"},
	{folder: "seedserver", module: []string{"wire", "edge", "tunnel", "internal/host", "internal/pki"}, why: "tendril-server stands on the edge and the tunnel"},
	{folder: "agent", module: []string{"wire", "edge", "tunnel", "internal/host"}, why: "the shoot agents stand on the edge and the tunnel"},
	{folder: "egressrelay", module: []string{"wire", "edge", "internal/host", "internal/pki"}, why: "the egress relay stands on the edge"},
	{folder: "internal/host", module: []string{"internal/host"}, why: "Linux calls: anything may stand on them, they stand on nothing of ours"},
	{folder: "internal/proc", module: []string{"internal/proc", "internal/host"}, why: "process plumbing stands on the host calls only"},
}

// procImporters are the only folders whose non-test code may import internal/proc: the processes'
// plumbing (flags, probes, logging, build info, GOMAXPROCS) belongs to the binaries.
var procImporters = []string{"cmd", "localseed", "internal/proc"}

// testingFolder holds tendril's test fixtures, which import testing: no package's non-test code
// reaches it (internal/pki/testpki is not one: it makes the certificates of local runs too).
const testingFolder = "internal/testing"

func TestDataPlaneImportsNoKubernetes(t *testing.T) {
	pkgs := list(t, folders(dataPlane)...)
	for _, p := range pkgs {
		for _, d := range p.Deps {
			for _, f := range forbidden {
				if strings.HasPrefix(d, f) {
					t.Errorf("%s imports %s", p.ImportPath, d)
				}
			}
			if in(strings.TrimPrefix(d, module), "internal/kube") {
				t.Errorf("%s imports %s", p.ImportPath, d)
			}
		}
	}
	if len(pkgs) < len(dataPlane) {
		t.Fatalf("go list matched %d packages for %d folders", len(pkgs), len(dataPlane))
	}
}

// TestFloorsImportOnlyWhatTheyMay checks every rule's folder, package by package, on its
// direct non-test imports.
func TestFloorsImportOnlyWhatTheyMay(t *testing.T) {
	for _, r := range rules {
		pkgs := list(t, r.folder+"/...")
		if len(pkgs) == 0 {
			t.Fatalf("%s: go list matched no packages", r.folder)
		}
		for _, p := range pkgs {
			for _, imp := range p.Imports {
				if !allowed(r, imp) {
					t.Errorf("%s imports %s: %s", p.ImportPath, imp, r.why)
				}
			}
		}
	}
}

// allowed reports whether rule r lets its folder import imp.
func allowed(r rule, imp string) bool {
	if rel, ok := strings.CutPrefix(imp, module); ok {
		if in(rel, r.folder) {
			return true
		}
		return slices.ContainsFunc(r.module, func(f string) bool { return in(rel, f) })
	}
	if standard(imp) || r.outside == nil {
		return true
	}
	return slices.ContainsFunc(r.outside, func(prefix string) bool { return strings.HasPrefix(imp, prefix) })
}

func TestOnlyBinariesImportProcessPlumbing(t *testing.T) {
	for _, p := range list(t, "...") {
		rel := strings.TrimPrefix(p.ImportPath, module)
		if slices.ContainsFunc(procImporters, func(f string) bool { return in(rel, f) }) {
			continue
		}
		for _, imp := range p.Imports {
			if in(strings.TrimPrefix(imp, module), "internal/proc") && strings.HasPrefix(imp, module) {
				t.Errorf("%s imports %s: only cmd/ and localseed/ run processes", p.ImportPath, imp)
			}
		}
	}
}

// TestNothingLinksTestFixtures: no package's non-test code, shipped binaries (cmd/...) and the
// libraries of realseed and bench among them, reaches a test fixture; fixtures may use each other.
// tendril-local (make run) takes its kube-apiserver's binaries and CRDs from internal/kube/kubeenv,
// not kubetest.
func TestNothingLinksTestFixtures(t *testing.T) {
	pkgs := list(t, "...")
	binaries, fixtures := 0, 0
	for _, p := range pkgs {
		rel := strings.TrimPrefix(p.ImportPath, module)
		if strings.HasPrefix(rel, "cmd/") {
			binaries++
		}
		if in(rel, testingFolder) {
			fixtures++
			continue
		}
		for _, d := range p.Deps {
			if rd, ok := strings.CutPrefix(d, module); ok && in(rd, testingFolder) {
				t.Errorf("%s links the test fixture %s", p.ImportPath, d)
			}
		}
	}
	if binaries < 7 || fixtures < 3 {
		t.Fatalf("go list matched %d binaries and %d fixtures", binaries, fixtures)
	}
}

// TestInternalIsSplitByAudience: every package below internal/ is in one audience's folder.
func TestInternalIsSplitByAudience(t *testing.T) {
	for _, p := range list(t, "internal/...") {
		rel := strings.TrimPrefix(p.ImportPath, module)
		if !slices.ContainsFunc(audiences, func(f string) bool { return in(rel, f) }) || slices.Contains(audiences[:len(audiences)-1], rel) {
			t.Errorf("%s is in no audience's folder (%s/<package>)", rel, strings.Join(audiences[:len(audiences)-1], "/, "))
		}
	}
}

// TestListsNameExistingPackages: every folder a rule here names holds packages, so that a rule
// cannot go on guarding a folder that was moved or removed and check nothing.
func TestListsNameExistingPackages(t *testing.T) {
	names := slices.Concat(dataPlane, audiences, procImporters, []string{testingFolder})
	for _, r := range rules {
		names = append(names, r.folder)
		names = append(names, r.module...)
	}
	for _, f := range names {
		if pkgs := list(t, f+"/..."); len(pkgs) == 0 || pkgs[0].Error != nil {
			t.Errorf("the rules name %s/..., which holds no package", f)
		}
	}
}

// in reports whether the module-relative package path rel is folder or below it.
func in(rel, folder string) bool {
	return rel == folder || strings.HasPrefix(rel, folder+"/")
}

// standard reports whether an import path is the standard library's: its first element has no
// dot (go list's Standard, without a second listing).
func standard(imp string) bool {
	first, _, _ := strings.Cut(imp, "/")
	return !strings.Contains(first, ".")
}

func folders(fs []string) []string {
	var patterns []string
	for _, f := range fs {
		patterns = append(patterns, f+"/...")
	}
	return patterns
}

// pkg is a package as go list reports it.
type pkg struct {
	ImportPath string
	Imports    []string
	Deps       []string
	Error      *struct{ Err string }
}

// list runs go list for patterns (relative to the module) from the repository's root.
func list(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	args := []string{"list", "-e", "-json=ImportPath,Imports,Deps,Error"}
	for _, p := range patterns {
		args = append(args, module+p)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			return pkgs
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
}
