package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/localseed"
)

// buildAsMake builds every binary as `make build` does (the Makefile's own target and flags,
// -trimpath among them) into a new temporary directory, and returns it.
func buildAsMake(t *testing.T) string {
	t.Helper()
	bin := t.TempDir()
	cmd := exec.Command("make", "build", "BIN="+bin)
	cmd.Dir = kubetest.RepoRoot(t)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make build BIN=%s: %v\n%s", bin, err, out)
	}
	return bin
}

// TestMainJob runs the README's main job as a newcomer does: the binaries as make build makes
// them, tendril-local --once started from a directory that is not the repository (nothing of the
// source tree is read: the CRDs are embedded, the envtest binaries come from make testbin's cache
// directory, the other binaries from tendril-local's own), exiting 0 with every check passed.
// A missing testbin directory fails at once, saying what to run. tendril-bench, the other shipped
// binary that starts the others, runs from there too.
func TestMainJob(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three API servers")
	}
	bin := buildAsMake(t)
	exe := filepath.Join(bin, "tendril-local")
	elsewhere := t.TempDir()

	out, err := exec.Command(exe, "--version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "tendril-local ") {
		t.Fatalf("--version: %v: %q", err, out)
	}

	missing := exec.Command(exe, "--once", "--testbin-dir", filepath.Join(elsewhere, "no-testbin"))
	missing.Dir = elsewhere
	out, err = missing.CombinedOutput()
	if code := exitCode(err); code != 1 || !strings.Contains(string(out), "run `make testbin`") {
		t.Errorf("without envtest binaries: exit %d, want 1 with what to run:\n%s", code, out)
	}

	// tendril-bench finds tendril-seed and tendril-ingress beside itself too.
	bench := exec.Command(filepath.Join(bin, "tendril-bench"), "sni", "--targets", "tendril", "--modes", "rate",
		"--concurrency", "1", "--duration", "300ms", "--json-file", filepath.Join(elsewhere, "sni.json"))
	bench.Dir = elsewhere
	out, err = bench.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "sni: tendril: ready on ") {
		t.Errorf("tendril-bench sni from %s: %v\n%s", elsewhere, err, out)
	}

	// make test's KUBEBUILDER_ASSETS is hack/testbin.sh's default directory unless TESTBIN_DIR
	// moved it; only then does the newcomer's command need the flag.
	args := []string{"--once"}
	assets, err := kubetest.Assets()
	if err != nil {
		t.Fatal(err)
	}
	if def, err := kubeenv.DefaultTestbinDir(); err != nil || filepath.Clean(def) != filepath.Clean(assets) {
		t.Logf("envtest binaries in %s, not in the default %s: passing --testbin-dir", assets, def)
		args = append(args, "--testbin-dir", assets)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	run := exec.CommandContext(ctx, exe, args...)
	run.Dir = elsewhere
	run.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "KUBEBUILDER_ASSETS=") })
	var stdout, stderr bytes.Buffer
	run.Stdout, run.Stderr = &stdout, &stderr
	start := time.Now()
	err = run.Run()
	t.Logf("tendril-local %s (in %s) took %v:\n%s\nstderr:\n%s", strings.Join(args, " "), elsewhere, time.Since(start).Round(time.Second), stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("tendril-local --once: %v", err)
	}
	report := stdout.String()
	if !strings.Contains(report, "\nready after ") {
		t.Errorf("no ready line")
	}
	for _, ns := range []string{"shoot--local--alpha", "shoot--local--beta"} {
		_, rest, ok := strings.Cut(report, "\n  "+ns+"\n")
		if !ok {
			t.Errorf("report lacks %s", ns)
			continue
		}
		for _, c := range []string{localseed.CheckRoute, localseed.CheckKubectl, localseed.CheckPod, localseed.CheckAgents, localseed.CheckInCluster} {
			line := "    " + c
			if !strings.Contains(rest, line) {
				t.Errorf("%s: no %s check", ns, c)
			}
		}
	}
	if strings.Contains(report, "FAILED") {
		t.Errorf("a check failed")
	}
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}
