package extension

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// fieldOwner is tendril's server-side-apply field manager.
const fieldOwner = client.FieldOwner("tendril-extension")

// apply server-side-applies obj: tendril owns exactly the fields it sets, the API server's
// defaults and other controllers' fields stay, and applying an unchanged object writes
// nothing (resourceVersion stays), which makes a second reconcile a no-op.
func (a *actuator) apply(ctx context.Context, obj client.Object) error {
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return fmt.Errorf("convert %T: %w", obj, err)
	}
	// Typed structs serialize empty status and a null creationTimestamp; applying them would
	// claim fields tendril does not own.
	delete(u, "status")
	unstructured.RemoveNestedField(u, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(u, "spec", "template", "metadata", "creationTimestamp")
	ac := client.ApplyConfigurationFromUnstructured(&unstructured.Unstructured{Object: u})
	if err := a.client.Apply(ctx, ac, fieldOwner, client.ForceOwnership); err != nil {
		return fmt.Errorf("apply %T %s: %w", obj, client.ObjectKeyFromObject(obj), err)
	}
	return nil
}
