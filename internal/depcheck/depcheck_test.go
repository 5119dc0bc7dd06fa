package depcheck

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
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
}

// list runs go list for patterns (relative to the module) from the repository's root.
func list(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	args := []string{"list", "-e", "-json=ImportPath,Deps"}
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
var fixtures = []string{"internal/kubetest", "internal/metrictest", "internal/testnet", "internal/testoci", "internal/testwait", "server/servertest"}

// TestBinariesLinkNoTestFixtures: no shipped binary (cmd/...) reaches a test fixture. tendril-local
// (make run) takes its kube-apiserver's binaries and CRDs from internal/kubeenv, not kubetest.
func TestBinariesLinkNoTestFixtures(t *testing.T) {
	pkgs := list(t, "cmd/...")
	for _, p := range pkgs {
		for _, d := range p.Deps {
			for _, f := range fixtures {
				if d == module+f {
					t.Errorf("%s links the test fixture %s", p.ImportPath, d)
				}
			}
		}
	}
	if len(pkgs) < 7 {
		t.Fatalf("go list matched %d binaries", len(pkgs))
	}
}

// TestWireImportsNothing: wire spells the names both planes speak, so that the control plane can
// name them without linking the data plane; it imports nothing, not even the standard library,
// and the control plane's translation and manifests do not link the ingress's epoll engine.
func TestWireImportsNothing(t *testing.T) {
	pkgs := list(t, "wire")
	if len(pkgs) != 1 {
		t.Fatalf("go list matched %d packages for wire", len(pkgs))
	}
	if d := pkgs[0].Deps; len(d) > 0 {
		t.Errorf("wire imports %v", d)
	}
	for _, p := range list(t, "xds/translate", "extension/manifest") {
		for _, d := range p.Deps {
			if d == module+"internal/relay" || d == module+"internal/connect" {
				t.Errorf("%s links %s (the data plane) for wire names: take them from wire", p.ImportPath, d)
			}
		}
	}
}
