// Package kubetest starts a real kube-apiserver and etcd (controller-runtime's envtest) for
// controller tests, with the CRDs tendril works with installed: Gardener's extension
// resources (Cluster, Extension, …), ManagedResource, and tendril's own Route. It is a test
// fixture; no production code imports it.
//
// The binaries come from hack/testbin.sh, which builds them from the Go module proxy once
// into a cache directory; KUBEBUILDER_ASSETS, when set, names that directory instead.
package kubetest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gardener/gardener/pkg/component/crddeployer"
	extensionscrds "github.com/gardener/gardener/pkg/component/extensions/crds"
	"github.com/gardener/gardener/pkg/component/gardener/resourcemanager"
	"github.com/gardener/gardener/pkg/component/observability/monitoring/prometheusoperator"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/tendril-net/tendril/internal/kubescheme"
)

// Env is one running API server.
type Env struct {
	Config *rest.Config
	Client client.Client
	Scheme *kruntime.Scheme
}

// NewScheme is kubescheme.New, for tests that build their own clients.
func NewScheme() *kruntime.Scheme { return kubescheme.New() }

// RepoRoot is the repository's top directory, found from this file's location.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

var assets struct {
	once sync.Once
	dir  string
	err  error
}

// Assets returns the directory with kube-apiserver and etcd, building them on first use.
func Assets() (string, error) {
	assets.once.Do(func() {
		if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
			assets.dir = d
			return
		}
		cmd := exec.Command(filepath.Join(RepoRoot(), "hack", "testbin.sh"))
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
	scheme := NewScheme()
	te := &envtest.Environment{
		BinaryAssetsDirectory:    dir,
		CRDDirectoryPaths:        []string{filepath.Join(RepoRoot(), "charts", "tendril-seed", "crds")},
		ErrorIfCRDPathMissing:    true,
		Scheme:                   scheme,
		ControlPlaneStartTimeout: time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	for k, v := range apiServerFlags {
		te.ControlPlane.GetAPIServer().Configure().Set(k, v)
	}
	cfg, err := te.Start()
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
	if err := installGardenerCRDs(ctx, c); err != nil {
		t.Fatalf("install Gardener CRDs: %v", err)
	}
	return &Env{Config: cfg, Client: c, Scheme: scheme}
}

// installGardenerCRDs uses Gardener's own deployers, so the CRDs are exactly those of the
// pinned gardener module.
func installGardenerCRDs(ctx context.Context, c client.Client) error {
	ext, err := extensionscrds.NewCRD(c, true, true)
	if err != nil {
		return err
	}
	mr, err := crddeployer.New(c, []string{resourcemanager.CRD}, false)
	if err != nil {
		return err
	}
	// prometheus-operator's CRDs, as every Gardener seed has them (gardenlet deploys the
	// operator): the extension applies ScrapeConfigs and a PrometheusRule per shoot.
	mon, err := prometheusoperator.NewCRDs(c)
	if err != nil {
		return err
	}
	for _, d := range []interface {
		Deploy(context.Context) error
		Wait(context.Context) error
	}{ext, mr, mon} {
		if err := d.Deploy(ctx); err != nil {
			return err
		}
		if err := d.Wait(ctx); err != nil {
			return err
		}
	}
	return nil
}
