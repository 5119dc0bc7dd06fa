package kubetest

import (
	"context"
	"testing"

	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
)

// TestStart proves the API server serves every kind the controllers use, including the
// Route CRD's validation (a Route without hostnames is refused by the schema).
func TestStart(t *testing.T) {
	env := Start(t)
	ctx := context.Background()
	for _, l := range []client.ObjectList{
		&extensionsv1alpha1.ClusterList{}, &extensionsv1alpha1.ExtensionList{},
		&resourcesv1alpha1.ManagedResourceList{}, &tendrilv1alpha1.RouteList{},
	} {
		if err := env.Client.List(ctx, l); err != nil {
			t.Errorf("list %T: %v", l, err)
		}
	}
	bad := &tendrilv1alpha1.Route{}
	bad.Name, bad.Namespace = "r", "default"
	bad.Spec.APIServer = tendrilv1alpha1.ServiceReference{Name: "kube-apiserver", Port: 443}
	if err := env.Client.Create(ctx, bad); err == nil {
		t.Fatal("Route without hostnames was accepted")
	}
	good := bad.DeepCopy()
	good.Spec.Hostnames = []string{"api.alpha.example.com"}
	if err := env.Client.Create(ctx, good); err != nil {
		t.Fatalf("create Route: %v", err)
	}
}
