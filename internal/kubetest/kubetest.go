// Package kubetest starts a real kube-apiserver and etcd (controller-runtime's envtest) for
// controller tests, with the CRDs tendril works with installed: Gardener's extension
// resources (Cluster, Extension, …), ManagedResource, and tendril's own Route. It is a test
// fixture; no production code imports it.
//
// The binaries and CRDs come from internal/kubeenv (hack/testbin.sh builds the binaries from the Go
// module proxy once into a cache directory; KUBEBUILDER_ASSETS, when set, names that directory
// instead). RepoRoot is kubeenv's, for tests that read the repository's files.
package kubetest

import (
	"context"
	"testing"
	"time"

	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/tendril-net/tendril/internal/kubeenv"
	"github.com/tendril-net/tendril/internal/kubescheme"
)

// Env is one running API server.
type Env struct {
	Config *rest.Config
	Client client.Client
	Scheme *kruntime.Scheme
}

// RepoRoot is the repository's top directory.
func RepoRoot() string { return kubeenv.RepoRoot() }

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
	dir, err := kubeenv.Assets()
	if err != nil {
		t.Fatalf("kube-apiserver and etcd for envtest: %v", err)
	}
	scheme := NewScheme()
	te := &envtest.Environment{
		BinaryAssetsDirectory:    dir,
		CRDDirectoryPaths:        []string{kubeenv.CRDDirectory()},
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
	if err := kubeenv.InstallGardenerCRDs(ctx, c); err != nil {
		t.Fatalf("install Gardener CRDs: %v", err)
	}
	return &Env{Config: cfg, Client: c, Scheme: scheme}
}
