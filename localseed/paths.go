package localseed

import (
	"context"
	"fmt"
	"time"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/networkpaths"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
)

// ExtensionNamespace is where the local seed puts the tendril-seed chart's objects, named as
// gardenlet names an extension's namespace; tendril's control plane and tendril-ingress run as
// processes, the chart's Services and a pod per Deployment stand for them in the seed.
const ExtensionNamespace = "extension-tendril-local"

// pathsTimeout bounds the wait for Gardener's NetworkPolicy controllers: they settle in
// seconds; a path that never comes out as wanted fails the report after this.
const pathsTimeout = 90 * time.Second

// egressMode is the shoot's kube-apiserver egress: the second shoot uses gRPC, so that the
// path table covers both front-ends, as docs/network-paths.md does.
func (sh *shoot) egressMode() tendrilv1alpha1.EgressMode {
	if sh.index%2 == 1 {
		return tendrilv1alpha1.EgressGRPC
	}
	return tendrilv1alpha1.EgressHTTPConnect
}

func (sh *shoot) pathsShoot() networkpaths.Shoot {
	// Gardener's VPN as the HA pair where the egress mode is gRPC, so that the table has both.
	return networkpaths.Shoot{Name: sh.name, Namespace: sh.namespace, Egress: sh.egressMode(), VPNHighAvailability: sh.index%2 == 1}
}

// startPaths builds the network-paths world over this seed's objects (the shoot namespaces
// labelled as gardenlet labels them, tendril-server's Service from the extension and its pod
// from the extension's Deployment, Gardener's kube-apiserver Service with a kube-apiserver pod
// as the egress webhook mutates it, the chart's objects in ExtensionNamespace) and starts
// gardenlet's and the resource manager's NetworkPolicy controllers over it; they run until ctx
// ends and the cleanup waits for them. settle then judges every path once the policies settle.
func (s *seed) startPaths(ctx context.Context) (settle func() (networkpaths.Result, error), err error) {
	w := networkpaths.NewWorld(s.client)
	if err := w.Seed(ctx, kubescheme.New(), ExtensionNamespace); err != nil {
		return nil, err
	}
	for _, sh := range s.shoots {
		if err := w.Shoot(ctx, sh.pathsShoot(), sh.serverTemplate); err != nil {
			return nil, fmt.Errorf("%s: %w", sh.namespace, err)
		}
	}
	mgr, err := networkpaths.NewControllers(ctx, s.rest, s.log.WithName("networkpolicy"))
	if err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	s.addCleanup(func() {
		if err := <-done; err != nil {
			s.log.Error(err, "NetworkPolicy controllers")
		}
	})
	return func() (networkpaths.Result, error) {
		if len(s.shoots) < 2 {
			return networkpaths.Result{}, fmt.Errorf("the path table needs two shoots, have %d", len(s.shoots))
		}
		paths := networkpaths.SeedPaths(s.shoots[0].pathsShoot(), s.shoots[1].pathsShoot())
		return networkpaths.Settle(ctx, s.client, w.Actors(), paths, pathsTimeout)
	}, nil
}

func (s *seed) printPaths(r networkpaths.Result, err error) {
	s.printf("\nnetwork paths (Gardener's NetworkPolicy controllers over this seed's objects; docs/network-paths.md):\n")
	if err != nil {
		s.printf("  FAILED: %v\n", err)
		return
	}
	s.printf("%s", r.Table())
	for _, p := range r.Problems {
		s.printf("  FAILED: %s\n", p)
	}
	if r.OK() {
		s.printf("every path as wanted: %d paths\n", len(r.Rows))
	}
}
