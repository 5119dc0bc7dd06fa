// Package kubeenv provides what a local Kubernetes API server for tendril needs: the directory of
// the envtest binaries (kube-apiserver, etcd, kubectl) that hack/testbin.sh builds from the Go module
// proxy, tendril's own CRDs (embedded from the seed chart), and Gardener's CRDs installed with
// Gardener's own deployers. tendril-local (make run) and the test fixture internal/testing/kubetest use it;
// it does not import testing, so a shipped binary can. It neither builds the binaries nor starts
// anything itself, and it never looks for the source tree: a binary built with -trimpath runs the
// same from any directory.
package kubeenv

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gardener/gardener/pkg/component/crddeployer"
	extensionscrds "github.com/gardener/gardener/pkg/component/extensions/crds"
	"github.com/gardener/gardener/pkg/component/gardener/resourcemanager"
	"github.com/gardener/gardener/pkg/component/observability/monitoring/prometheusoperator"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/charts"
)

// The versions hack/testbin.sh builds by default (its K8S and ETCD); TestTestbinDirMatchesScript
// holds the two in step.
const (
	KubernetesVersion = "v1.37.1"
	EtcdVersion       = "v3.7.3"
)

// Binaries are the files a testbin directory holds, all of which tendril-local runs.
var Binaries = []string{"etcd", "kube-apiserver", "kubectl"}

// DefaultTestbinDir is where hack/testbin.sh (make testbin) puts the binaries when TESTBIN_DIR
// is unset: ${XDG_CACHE_HOME:-$HOME/.cache}/tendril/testbin/k8s-<version>-etcd-<version>-static.
func DefaultTestbinDir() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("cache directory of hack/testbin.sh: %w", err)
	}
	return filepath.Join(cache, "tendril", "testbin", "k8s-"+KubernetesVersion+"-etcd-"+EtcdVersion+"-static"), nil
}

// Environment is an envtest environment that runs the binaries in dir (a testbin directory):
// their paths are set, so neither KUBEBUILDER_ASSETS nor $PATH can swap them. Etcd and the API
// server get a minute to start and to stop.
func Environment(dir string) *envtest.Environment {
	te := &envtest.Environment{
		BinaryAssetsDirectory:    dir,
		ControlPlaneStartTimeout: time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	te.ControlPlane.GetAPIServer().Path = filepath.Join(dir, "kube-apiserver")
	te.ControlPlane.Etcd = &envtest.Etcd{Path: filepath.Join(dir, "etcd")}
	te.ControlPlane.KubectlPath = filepath.Join(dir, "kubectl")
	return te
}

// StartAttempts is how often Start starts a control plane whose port another process took.
const StartAttempts = 3

// Start starts the environment newEnv builds and returns it with its admin configuration. etcd and
// kube-apiserver cannot inherit a socket: envtest (or the caller) picks their ports free just
// before they bind them, and another process may take one in between. When one of them then says
// "address already in use", Start stops that environment and starts a new one from newEnv, with
// new ports, up to StartAttempts times (envtest's own retries reuse the ports that failed).
func Start(newEnv func() (*envtest.Environment, error)) (*envtest.Environment, *rest.Config, error) {
	var last error
	for range StartAttempts {
		te, err := newEnv()
		if err != nil {
			return nil, nil, err
		}
		var out tail
		api := te.ControlPlane.GetAPIServer()
		api.Err = teeTo(api.Err, &out)
		if te.ControlPlane.Etcd == nil {
			te.ControlPlane.Etcd = &envtest.Etcd{}
		}
		te.ControlPlane.Etcd.Err = teeTo(te.ControlPlane.Etcd.Err, &out)
		cfg, startErr := te.Start()
		if startErr == nil {
			return te, cfg, nil
		}
		_ = te.Stop()
		if !strings.Contains(strings.ToLower(out.String()), "address already in use") {
			return nil, nil, startErr
		}
		last = fmt.Errorf("%w (a port was taken: %s)", startErr, out.lastLine("address already in use"))
	}
	return nil, nil, last
}

func teeTo(w, also io.Writer) io.Writer {
	if w == nil {
		return also
	}
	return io.MultiWriter(w, also)
}

// tail keeps the last tailBytes that etcd and kube-apiserver wrote to stderr.
type tail struct {
	mu sync.Mutex
	b  []byte
}

// tailBytes is enough for the lines a process prints before it exits on a bind failure.
const tailBytes = 64 << 10

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - tailBytes; over > 0 {
		t.b = t.b[over:]
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// lastLine is the last line that contains substr, case-insensitively.
func (t *tail) lastLine(substr string) string {
	lines := strings.Split(strings.TrimSpace(t.String()), "\n")
	for _, l := range slices.Backward(lines) {
		if strings.Contains(strings.ToLower(l), substr) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// ErrNoTestbin is wrapped by CheckTestbin when a binary is missing.
var ErrNoTestbin = errors.New("envtest binaries missing")

// CheckTestbin checks that dir holds every one of Binaries as an executable file. The error for
// a missing one says how to get them.
func CheckTestbin(dir string) error {
	for _, b := range Binaries {
		fi, err := os.Stat(filepath.Join(dir, b))
		if err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			continue
		}
		return fmt.Errorf("%w: no executable %s in %s: run `make testbin` in the repository (it builds "+
			"kube-apiserver %s, kubectl and etcd %s there once, about 9 minutes on 2 cores), or name "+
			"another directory with --testbin-dir", ErrNoTestbin, b, dir, KubernetesVersion, EtcdVersion)
	}
	return nil
}

// crdDir is where the seed chart keeps tendril's CRDs in charts.FS.
var crdDir = path.Join(charts.SeedChart, "crds")

// CRDs are tendril's own CRDs, read from the seed chart embedded in the binary, as envtest's
// Environment.CRDs takes them.
func CRDs() ([]*apiextensionsv1.CustomResourceDefinition, error) {
	files, err := fs.Glob(charts.FS, path.Join(crdDir, "*.yaml"))
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no CRD in the embedded chart's %s", crdDir)
	}
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, f := range files {
		b, err := charts.FS.ReadFile(f)
		if err != nil {
			return nil, err
		}
		docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
		for {
			d, err := docs.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			if len(bytes.TrimSpace(d)) == 0 {
				continue
			}
			crd := &apiextensionsv1.CustomResourceDefinition{}
			if err := yaml.UnmarshalStrict(d, crd); err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			if crd.Kind != "CustomResourceDefinition" {
				return nil, fmt.Errorf("%s: kind %q, want CustomResourceDefinition", f, crd.Kind)
			}
			crds = append(crds, crd)
		}
	}
	return crds, nil
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
