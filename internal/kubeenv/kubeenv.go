// Package kubeenv provides what a local Kubernetes API server for tendril needs: the envtest
// binaries (kube-apiserver, etcd) built from the Go module proxy, the directory of tendril's own
// CRDs, and Gardener's CRDs installed with Gardener's own deployers. tendril-local (make run) and
// the test fixture internal/kubetest use it; it does not import testing, so a shipped binary can.
// It does not start anything itself.
package kubeenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/gardener/gardener/pkg/component/crddeployer"
	extensionscrds "github.com/gardener/gardener/pkg/component/extensions/crds"
	"github.com/gardener/gardener/pkg/component/gardener/resourcemanager"
	"github.com/gardener/gardener/pkg/component/observability/monitoring/prometheusoperator"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

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

// CRDDirectory holds tendril's own CRDs (the seed chart's), as Start installs them.
func CRDDirectory() string {
	return filepath.Join(RepoRoot(), "charts", "tendril-seed", "crds")
}

// InstallGardenerCRDs installs Gardener's extension CRDs, ManagedResource and prometheus-operator's
// CRDs into the API server c talks to. It uses Gardener's own deployers, so the CRDs are exactly those of the
// pinned gardener module.
func InstallGardenerCRDs(ctx context.Context, c client.Client) error {
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
