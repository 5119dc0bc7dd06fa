package realseed

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tendril-net/tendril/internal/kube/kubeenv"
)

// TestSeedbinDirMatchesScript: Start looks for the binaries where hack/seedbin.sh (make
// seedbin) puts them: given a cache directory that already holds them, the script prints that
// directory and builds nothing.
func TestSeedbinDirMatchesScript(t *testing.T) {
	home := t.TempDir()
	cache := filepath.Join(home, "cache")
	t.Setenv("XDG_CACHE_HOME", cache)
	dir, err := DefaultSeedbinDir()
	if err != nil {
		t.Fatal(err)
	}
	writeFiles(t, dir, SeedbinBinaries)
	// No go on PATH: were the directories to differ, the script would fail at once instead of
	// starting a long build.
	cmd := exec.Command("../hack/seedbin.sh")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + home, "XDG_CACHE_HOME=" + cache}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("hack/seedbin.sh: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != dir {
		t.Errorf("hack/seedbin.sh printed %q, DefaultSeedbinDir is %q", got, dir)
	}
}

func writeFiles(t *testing.T, dir string, names []string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range names {
		if err := os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPreflightNamesWhatIsMissing: before anything starts, a missing piece is named with what
// to run; on a machine that cannot run the seed at all, the reason is one a test skips on.
func TestPreflightNamesWhatIsMissing(t *testing.T) {
	tb, sb, bin := t.TempDir(), t.TempDir(), t.TempDir()
	writeFiles(t, tb, kubeenv.Binaries)
	cfg := Config{TestbinDir: tb, SeedbinDir: sb, BinDir: bin}
	err := Preflight(cfg)
	if errors.Is(err, ErrNotRoot) || errors.Is(err, ErrNoTools) {
		if !strings.Contains(err.Error(), "root") && !strings.Contains(err.Error(), "apt-get install") {
			t.Fatalf("machine error without its remedy: %v", err)
		}
		t.Skipf("the rest needs root and the tools: %v", err)
	}
	if err == nil || !strings.Contains(err.Error(), "make seedbin") || !strings.Contains(err.Error(), "kubelet") {
		t.Fatalf("empty seedbin directory: %v", err)
	}
	writeFiles(t, sb, SeedbinBinaries)
	if err := Preflight(cfg); err == nil || !strings.Contains(err.Error(), "tendril-pause") || !strings.Contains(err.Error(), "make build") {
		t.Fatalf("no tendril-pause: %v", err)
	}
	writeFiles(t, bin, []string{"tendril-pause"})
	if err := Preflight(cfg); err == nil || !strings.Contains(err.Error(), "tendril-probe") {
		t.Fatalf("no tendril-probe: %v", err)
	}
	writeFiles(t, bin, []string{"tendril-probe"})
	if err := Preflight(cfg); err != nil {
		t.Fatal(err)
	}
	if err := Preflight(Config{TestbinDir: t.TempDir(), SeedbinDir: sb, BinDir: bin}); !errors.Is(err, kubeenv.ErrNoTestbin) {
		t.Fatalf("empty testbin directory: %v", err)
	}
}

// TestCIInstallsThePackages: .ci/run's apt line installs every package Preflight asks for.
func TestCIInstallsThePackages(t *testing.T) {
	b, err := os.ReadFile("../.ci/run")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range strings.Fields(Packages) {
		if !strings.Contains(string(b), " "+p) {
			t.Errorf(".ci/run does not install %s", p)
		}
	}
}

// TestPreflightNamesMissingTools: a machine without the Debian tools is told which are missing
// and the apt line that installs them.
func TestPreflightNamesMissingTools(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tools are checked as root only (without root Preflight stops at that)")
	}
	t.Setenv("PATH", t.TempDir())
	err := Preflight(Config{TestbinDir: t.TempDir(), SeedbinDir: t.TempDir(), BinDir: t.TempDir()})
	if !errors.Is(err, ErrNoTools) {
		t.Fatalf("no tools on PATH: %v, want ErrNoTools", err)
	}
	for _, want := range []string{"containerd", "runc", "docker-registry", "nsenter", "apt-get install --no-install-recommends"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not name %s: %v", want, err)
		}
	}
}
