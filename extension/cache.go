package extension

import (
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
)

// CacheOptions is what the manager that runs the extension needs to cache. A seed hosts hundreds
// of shoots, each with its own Deployments and NetworkPolicies; the extension reads only
// tendril-server's (the drift watch and the health check), so only objects labelled as tendril's
// are cached of those kinds. kube-apiserver's Deployment, which gives the advertised address, is
// read without the cache. Managed fields are stripped from every cached object: nothing reads them
// (server-side apply keeps them on the server) and they are a large part of each object.
func CacheOptions() cache.Options {
	ours := labels.SelectorFromSet(labels.Set{v1beta1constants.LabelApp: manifest.ServerName})
	return cache.Options{
		DefaultTransform: cache.TransformStripManagedFields(),
		ByObject: map[client.Object]cache.ByObject{
			&appsv1.Deployment{}:            {Label: ours},
			&appsv1.StatefulSet{}:           {Label: ours},
			&policyv1.PodDisruptionBudget{}: {Label: ours},
			&networkingv1.NetworkPolicy{}:   {Label: ours},
		},
	}
}

// Uncached are the kinds the extension's client reads straight from the API server. The secrets
// manager lists its own Secrets by label on every reconcile: through a cache, that would hold every
// Secret of every shoot in the seed (memory, and credentials tendril has no business keeping);
// ConfigMaps likewise (the egress webhook's). Gardener's own extensions disable both. The
// heartbeat reads its one Lease every renew interval: through the cache, that read would start a
// watch of every Lease in the seed, which the chart's RBAC (leases in the extension's namespace
// only) forbids, so the heartbeat would never beat (found on the real seed, where tendril-seed
// runs with its chart's service account).
func Uncached() []client.Object {
	return []client.Object{&corev1.Secret{}, &corev1.ConfigMap{}, &coordinationv1.Lease{}}
}
