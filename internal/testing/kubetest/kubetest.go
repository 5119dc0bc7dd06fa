// Package kubetest starts a real kube-apiserver and etcd (controller-runtime's envtest) for
// controller tests, with the CRDs tendril works with installed: Gardener's extension
// resources (Cluster, Extension, …), ManagedResource, and tendril's own Route. It is a test
// fixture; no production code imports it.
//
// The binaries come from KUBEBUILDER_ASSETS (make test sets it) or else from hack/testbin.sh, which
// builds them from the Go module proxy once into a cache directory; the CRDs from internal/kube/kubeenv.
// RepoRoot is for tests that read the repository's files: a test fixture may find the source tree
// (from the working directory go test gives it), a shipped binary never does.
package kubetest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/tendril-net/tendril/internal/kube/kubeenv"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
)

// Env is one running API server.
type Env struct {
	Config *rest.Config
	Client client.Client
	Scheme *kruntime.Scheme
}

// RepoRoot is the repository's top directory: the nearest directory above the working directory
// whose go.mod declares tendril's module (go test runs each test in its package's directory).
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for d := dir; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && declares(b, module) {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no go.mod of %s above %s", module, dir)
		}
	}
}

// declares tells whether go.mod content b declares module path m.
func declares(b []byte, m string) bool {
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) == m
		}
	}
	return false
}

// module is tendril's module path, as go.mod declares it.
const module = "github.com/tendril-net/tendril"

var assets struct {
	once sync.Once
	dir  string
	err  error
}

// Assets returns the directory with kube-apiserver, etcd and kubectl: KUBEBUILDER_ASSETS, or
// hack/testbin.sh's, which builds them on first use.
func Assets() (string, error) {
	assets.once.Do(func() {
		if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
			assets.dir, assets.err = d, kubeenv.CheckTestbin(d)
			return
		}
		root, err := repoRoot()
		if err != nil {
			assets.err = err
			return
		}
		cmd := exec.Command(filepath.Join(root, "hack", "testbin.sh"))
		cmd.Stderr = os.Stderr // progress of a first build is worth seeing
		out, err := cmd.Output()
		if err != nil {
			assets.err = fmt.Errorf("hack/testbin.sh: %w", err)
			return
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		assets.dir = lines[len(lines)-1]
	})
	return assets.dir, assets.err
}

// NewScheme is kubescheme.New, for tests that build their own clients.
func NewScheme() *kruntime.Scheme { return kubescheme.New() }

// Start starts an API server with the CRDs installed and stops it when t ends.
func Start(t testing.TB) *Env {
	t.Helper()
	return StartWith(t, nil)
}

// StartWith is Start with kube-apiserver flags (name without dashes → value) set over envtest's.
func StartWith(t testing.TB, apiServerFlags map[string]string) *Env {
	t.Helper()
	dir, err := Assets()
	if err != nil {
		t.Fatalf("kube-apiserver and etcd for envtest: %v", err)
	}
	crds, err := kubeenv.CRDs()
	if err != nil {
		t.Fatalf("tendril's CRDs: %v", err)
	}
	scheme := NewScheme()
	te, cfg, err := kubeenv.Start(func() (*envtest.Environment, error) {
		te := kubeenv.Environment(dir)
		te.CRDs, te.Scheme = crds, scheme
		for k, v := range apiServerFlags {
			te.ControlPlane.GetAPIServer().Configure().Set(k, v)
		}
		return te, nil
	})
	if err != nil {
		t.Fatalf("start envtest: %v", err)
	}
	t.Cleanup(func() {
		if err := te.Stop(); err != nil {
			t.Errorf("stop envtest: %v", err)
		}
	})
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := kubeenv.InstallGardenerCRDs(ctx, c); err != nil {
		t.Fatalf("install Gardener CRDs: %v", err)
	}
	return &Env{Config: cfg, Client: c, Scheme: scheme}
}
