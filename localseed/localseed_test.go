package localseed_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/kubetest"
	"github.com/tendril-net/tendril/localseed"
)

// TestLocalSeed runs the whole local seed as `make run --once` does — a seed API server, the
// control plane, tendril-ingress, two shoots with their own API servers, tendril-server and
// tendril-agent started from the objects the extension created — and asserts that every check
// passes for both shoots: the Route is Programmed, kubectl reaches the shoot's API server
// through the SNI listener, and a request from the seed side reaches the shoot's pod through
// tendril-server, the tunnel and the agent.
func TestLocalSeed(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three API servers")
	}
	bin := t.TempDir()
	build := exec.Command("go", "build", "-o", bin+"/", "./cmd/tendril-ingress", "./cmd/tendril-server", "./cmd/tendril-agent")
	build.Dir = kubetest.RepoRoot()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := localseed.Run(ctx, localseed.Config{
		BinDir: bin,
		Dir:    t.TempDir(),
		Shoots: []string{"alpha", "beta"},
		Once:   true,
		Out:    &out,
	})
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Shoots) != 2 {
		t.Fatalf("%d shoots reported, want 2", len(rep.Shoots))
	}
	for _, s := range rep.Shoots {
		names := map[string]bool{}
		for _, c := range s.Checks {
			names[c.Name] = true
			if c.Err != nil {
				t.Errorf("%s: %s: %v", s.Namespace, c.Name, c.Err)
			}
		}
		for _, c := range s.Checks {
			if c.Name == localseed.CheckInCluster && os.Geteuid() != 0 {
				t.Logf("%s: %s: %s (run the test as root for apiserver-proxy in a node network namespace)", s.Namespace, c.Name, c.Detail)
			}
		}
		for _, want := range []string{localseed.CheckRoute, localseed.CheckKubectl, localseed.CheckPod, localseed.CheckInCluster} {
			if !names[want] {
				t.Errorf("%s: check %s missing", s.Namespace, want)
			}
		}
	}
}
