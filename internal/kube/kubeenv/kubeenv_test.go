package kubeenv

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// TestTestbinDirMatchesScript: tendril-local looks for the binaries where hack/testbin.sh (make
// testbin) puts them. The script, given a cache directory that already holds its binaries,
// prints that directory and builds nothing; it must be DefaultTestbinDir.
func TestTestbinDirMatchesScript(t *testing.T) {
	for _, xdg := range []bool{true, false} {
		home := t.TempDir()
		// No go on PATH: were the directories to differ, the script would fail at once instead of
		// starting a 9-minute build.
		env := []string{"PATH=/usr/bin:/bin", "HOME=" + home}
		t.Setenv("HOME", home)
		if xdg {
			cache := filepath.Join(home, "xdg-cache")
			env = append(env, "XDG_CACHE_HOME="+cache)
			t.Setenv("XDG_CACHE_HOME", cache)
		} else {
			t.Setenv("XDG_CACHE_HOME", "")
		}
		dir, err := DefaultTestbinDir()
		if err != nil {
			t.Fatal(err)
		}
		if err := CheckTestbin(dir); !errors.Is(err, ErrNoTestbin) {
			t.Fatalf("empty %s: %v, want ErrNoTestbin", dir, err)
		}
		writeBinaries(t, dir)
		if err := CheckTestbin(dir); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("../../../hack/testbin.sh")
		cmd.Env = env // no TESTBIN_DIR, K8S or ETCD: the script's defaults
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("hack/testbin.sh: %v\n%s", err, out)
		}
		if got := strings.TrimSpace(string(out)); got != dir {
			t.Errorf("XDG_CACHE_HOME set %v: hack/testbin.sh printed %q, DefaultTestbinDir is %q", xdg, got, dir)
		}
	}
}

func writeBinaries(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range Binaries {
		if err := os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCheckTestbin: a missing or non-executable binary is named, with what to run.
func TestCheckTestbin(t *testing.T) {
	dir := t.TempDir()
	writeBinaries(t, dir)
	if err := CheckTestbin(dir); err != nil {
		t.Fatalf("complete directory: %v", err)
	}
	if err := os.Chmod(filepath.Join(dir, "etcd"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := CheckTestbin(dir)
	if !errors.Is(err, ErrNoTestbin) || !strings.Contains(err.Error(), "no executable etcd") || !strings.Contains(err.Error(), "make testbin") {
		t.Errorf("etcd not executable: %v", err)
	}
	if err := os.Remove(filepath.Join(dir, "kubectl")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, "etcd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := CheckTestbin(dir); err == nil || !strings.Contains(err.Error(), "no executable kubectl") {
		t.Errorf("kubectl missing: %v", err)
	}
}

// TestCRDs: the embedded CRDs are the chart's files, every one of them.
func TestCRDs(t *testing.T) {
	crds, err := CRDs()
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("../../../charts/tendril-seed/crds/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("chart CRD files: %v %v", files, err)
	}
	if len(crds) != len(files) {
		t.Fatalf("%d CRDs embedded, %d files in the chart", len(crds), len(files))
	}
	var names []string
	for _, c := range crds {
		names = append(names, c.Name)
		if len(c.Spec.Versions) == 0 || c.Spec.Group == "" {
			t.Errorf("%s: no group or versions", c.Name)
		}
	}
	if !strings.Contains(strings.Join(names, ","), "routes.tendril.extensions.gardener.cloud") {
		t.Errorf("CRDs %v lack the Route", names)
	}
}

// TestStartRetriesTakenPort: a kube-apiserver whose port another process holds exits with
// "address already in use"; Start starts a new environment, with a new port, and it comes up.
// Another failure is not retried.
func TestStartRetriesTakenPort(t *testing.T) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		t.Skip("KUBEBUILDER_ASSETS unset (make test sets it)")
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	builds := 0
	te, cfg, err := Start(func() (*envtest.Environment, error) {
		builds++
		te := Environment(dir)
		if builds == 1 {
			api := te.ControlPlane.GetAPIServer()
			api.SecureServing.Address = "127.0.0.1"
			api.SecureServing.Port = strconv.Itoa(taken.Addr().(*net.TCPAddr).Port)
		}
		return te, nil
	})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer te.Stop()
	if builds != 2 {
		t.Errorf("%d environments built, want 2 (the first one's port taken)", builds)
	}
	if strings.Contains(cfg.Host, taken.Addr().String()) {
		t.Errorf("API server on the taken port: %s", cfg.Host)
	}

	builds = 0
	_, _, err = Start(func() (*envtest.Environment, error) {
		builds++
		te := Environment(dir)
		te.ControlPlane.GetAPIServer().Configure().Set("no-such-flag", "1")
		return te, nil
	})
	if err == nil || builds != 1 {
		t.Errorf("an unknown flag: %v after %d builds, want an error after 1", err, builds)
	}
}
