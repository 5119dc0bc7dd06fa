// Package kubescheme is the one runtime.Scheme tendril's Kubernetes code uses: client-go's
// built-in types, CRDs, Gardener's extension and resource types, prometheus-operator's monitoring types, and tendril's own API. It
// exists so the controllers and their tests agree on what they can decode.
package kubescheme

import (
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	monitoringv1alpha1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1alpha1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
)

// New returns a fresh scheme with every type tendril reads or writes.
func New() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		apiextensionsv1.AddToScheme,
		extensionsv1alpha1.AddToScheme,
		resourcesv1alpha1.AddToScheme,
		// The per-shoot ScrapeConfigs and PrometheusRule (extension/manifest).
		monitoringv1.AddToScheme,
		monitoringv1alpha1.AddToScheme,
		tendrilv1alpha1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err) // only a programming error: the types conflict
		}
	}
	return s
}
