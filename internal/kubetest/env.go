package kubetest

import (
	"context"
	"path/filepath"

	"sigs.k8s.io/controller-runtime/pkg/client"
)

// CRDDirectory holds tendril's own CRDs (the seed chart's), as Start installs them.
func CRDDirectory() string {
	return filepath.Join(RepoRoot(), "charts", "tendril-seed", "crds")
}

// InstallGardenerCRDs installs Gardener's extension CRDs, ManagedResource and prometheus-operator's CRDs into the API
// server c talks to, as Start does, for callers without a testing.T (the local seed).
func InstallGardenerCRDs(ctx context.Context, c client.Client) error {
	return installGardenerCRDs(ctx, c)
}
