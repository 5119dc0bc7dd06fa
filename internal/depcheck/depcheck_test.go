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
var guarded = []string{"ingress", "tunnel", "server", "agent", "bench", "egressrelay", "cmd/tendril-egress-relay", "xds/model", "xds/translate"}

const module = "github.com/tendril-net/tendril/"

func TestDataPlaneImportsNoKubernetes(t *testing.T) {
	args := []string{"list", "-e", "-json=ImportPath,Deps"}
	for _, g := range guarded {
		args = append(args, module+g+"/...")
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	checked := 0
	for {
		var p struct {
			ImportPath string
			Deps       []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		checked++
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
	if checked == 0 {
		t.Fatal("go list matched no packages")
	}
}

// fixtures are tendril's test fixtures, which import testing (testpki is not one: it makes the
// certificates of local runs too).
var fixtures = []string{"internal/kubetest", "internal/metrictest", "internal/testnet", "internal/testwait", "server/servertest"}

// TestBinariesLinkNoTestFixtures: no shipped binary (cmd/...) reaches a test fixture. tendril-local
// (make run) takes its kube-apiserver's binaries and CRDs from internal/kubeenv, not kubetest.
func TestBinariesLinkNoTestFixtures(t *testing.T) {
	cmd := exec.Command("go", "list", "-e", "-json=ImportPath,Deps", module+"cmd/...")
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	checked := 0
	for {
		var p struct {
			ImportPath string
			Deps       []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, d := range p.Deps {
			for _, f := range fixtures {
				if d == module+f {
					t.Errorf("%s links the test fixture %s", p.ImportPath, d)
				}
			}
		}
	}
	if checked < 7 {
		t.Fatalf("go list matched %d binaries", checked)
	}
}
