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

// forbidden are the import path prefixes the data plane must not reach, directly or not.
var forbidden = []string{"k8s.io/", "sigs.k8s.io/controller-runtime", "github.com/gardener/"}

// guarded are the packages (with everything below them) that must stay free of them.
var guarded = []string{"ingress", "tunnel", "seedserver", "agent", "bench", "egressrelay", "cmd/tendril-egress-relay", "xds/model", "xds/translate", "xds/store", "xds/ads", "xds/server"}

const module = "github.com/tendril-net/tendril/"

func TestDataPlaneImportsNoKubernetes(t *testing.T) {
	var patterns []string
	for _, g := range guarded {
		patterns = append(patterns, g+"/...")
	}
	pkgs := list(t, patterns...)
	for _, p := range pkgs {
		for _, d := range p.Deps {
			for _, f := range forbidden {
				if strings.HasPrefix(d, f) {
					t.Errorf("%s imports %s", p.ImportPath, d)
				}
			}
		}
	}
	// The pattern of a guarded directory without packages matches nothing; the translation at
	// least must be there, or the test checks nothing.
	if len(pkgs) == 0 {
		t.Fatal("go list matched no packages")
	}
}

// pkg is a package as go list reports it.
type pkg struct {
	ImportPath string
	Deps       []string
	Error      *struct{ Err string }
}

// list runs go list for patterns (relative to the module) from the repository's root.
func list(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	args := []string{"list", "-e", "-json=ImportPath,Deps,Error"}
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

// fixtures are tendril's test fixtures, which import testing (testpki is not one: it makes the
// certificates of local runs too).
var fixtures = []string{"internal/kubetest", "internal/metrictest", "internal/testnet", "internal/testoci", "internal/testwait"}

// TestNothingLinksTestFixtures: no package's non-test code, shipped binaries (cmd/...) and the
// libraries of realseed and bench among them, reaches a test fixture; fixtures may use each other.
// tendril-local (make run) takes its kube-apiserver's binaries and CRDs from internal/kubeenv, not
// kubetest.
func TestNothingLinksTestFixtures(t *testing.T) {
	pkgs := list(t, "...")
	binaries := 0
	for _, p := range pkgs {
		if strings.HasPrefix(p.ImportPath, module+"cmd/") {
			binaries++
		}
		if slices.Contains(fixtures, strings.TrimPrefix(p.ImportPath, module)) {
			continue
		}
		for _, d := range p.Deps {
			for _, f := range fixtures {
				if d == module+f {
					t.Errorf("%s links the test fixture %s", p.ImportPath, d)
				}
			}
		}
	}
	if binaries < 7 {
		t.Fatalf("go list matched %d binaries", binaries)
	}
}

// TestListsNameExistingPackages: every package a rule here names exists, so that a rule cannot
// go on guarding a package that was moved or removed and check nothing.
func TestListsNameExistingPackages(t *testing.T) {
	for _, g := range guarded { // directories: every package below them is guarded
		if pkgs := list(t, g+"/..."); len(pkgs) == 0 || pkgs[0].Error != nil {
			t.Errorf("the rules guard %s/..., which holds no package", g)
		}
	}
	for _, p := range slices.Concat(fixtures, []string{"wire", "xds/translate", "extension/manifest", "internal/relay", "internal/connect"}) {
		if pkgs := list(t, p); len(pkgs) != 1 || pkgs[0].Error != nil {
			t.Errorf("the rules name %s, which is no package", p)
		}
	}
}
