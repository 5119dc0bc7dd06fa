package localseed_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
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
	build.Dir = kubetest.RepoRoot(t)
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
		// beta runs two agents: both start, and tendril-server sees both live (CheckAgents).
		HAShoots: []string{"beta"},
		Once:     true,
		Out:      &out,
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
			if want := "1 of 1 agents live"; c.Name == localseed.CheckAgents && s.Namespace == "shoot--local--beta" {
				want = "2 of 2 agents live"
				if !strings.Contains(c.Detail, want) {
					t.Errorf("%s: %s: %q, want %q", s.Namespace, c.Name, c.Detail, want)
				}
			}
			if c.Name == localseed.CheckInCluster && os.Geteuid() != 0 {
				t.Logf("%s: %s: %s (run the test as root for apiserver-proxy in a node network namespace)", s.Namespace, c.Name, c.Detail)
			}
		}
		for _, want := range []string{localseed.CheckRoute, localseed.CheckKubectl, localseed.CheckPod, localseed.CheckAgents, localseed.CheckInCluster} {
			if !names[want] {
				t.Errorf("%s: check %s missing", s.Namespace, want)
			}
		}
	}
	// The network paths: Gardener's NetworkPolicy controllers over the local seed's objects,
	// judged and printed as docs/network-paths.md's table.
	if rep.PathsErr != nil || rep.Paths == nil {
		t.Fatalf("network paths not judged: %v", rep.PathsErr)
	}
	if !rep.Paths.OK() {
		t.Errorf("network paths: %q", rep.Paths.Problems)
	}
	for _, row := range []string{
		"| tendril-ingress | alpha tendril-server | 1194 | agent alpha's tunnel | allowed |",
		"| alpha kube-apiserver (httpConnect) | alpha tendril-server | 9443 | egress, HTTP CONNECT | allowed |",
		"| beta kube-apiserver (grpc) | beta tendril-server | 8090 | egress, gRPC (relay sidecar) | allowed |",
		"| alpha kube-apiserver (httpConnect) | beta tendril-server | 9443 | cross-shoot | denied |",
	} {
		if !strings.Contains(out.String(), row) {
			t.Errorf("output lacks the path row %q", row)
		}
	}
	if !rep.OK() {
		t.Errorf("report not OK: --once would exit 1")
	}
}

// TestReportPaths: a path that is not as wanted fails the report (tendril-local --once exits 1)
// even when every shoot's checks pass.
func TestReportPaths(t *testing.T) {
	shoots := []localseed.ShootReport{{Namespace: "shoot--local--alpha", Checks: []localseed.Check{{Name: localseed.CheckRoute}}}}
	good := networkpaths.Result{Rows: []string{"| a | b | 1 | x | allowed | … | … |"}}
	for _, c := range []struct {
		name string
		rep  localseed.Report
		want bool
	}{
		{"paths as wanted", localseed.Report{Shoots: shoots, Paths: &good}, true},
		{"no paths judged (one shoot)", localseed.Report{Shoots: shoots}, true},
		{"cross-shoot path allowed", localseed.Report{Shoots: shoots, Paths: &networkpaths.Result{
			Rows: good.Rows, Problems: []string{"alpha kube-apiserver → beta tendril-server :9443: allowed, want denied"},
		}}, false},
		{"paths not judged", localseed.Report{Shoots: shoots, PathsErr: errors.New("no API server")}, false},
	} {
		if got := c.rep.OK(); got != c.want {
			t.Errorf("%s: OK() = %v, want %v", c.name, got, c.want)
		}
	}
}
