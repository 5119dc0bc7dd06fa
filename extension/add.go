package extension

import (
	"context"

	genericextension "github.com/gardener/gardener/extensions/pkg/controller/extension"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

// AddOptions configure the controller.
type AddOptions struct {
	Config
	// MaxConcurrentReconciles is the number of shoots reconciled at once (0: 5).
	MaxConcurrentReconciles int
	// IgnoreOperationAnnotation reconciles on every change instead of only when gardenlet
	// asks (operation annotation); Gardener's extensions offer it for development.
	IgnoreOperationAnnotation bool
}

// Add registers the Extension controller for type tendril with mgr.
func Add(ctx context.Context, mgr manager.Manager, opts AddOptions) error {
	if opts.MaxConcurrentReconciles == 0 {
		opts.MaxConcurrentReconciles = 5
	}
	return genericextension.Add(mgr, genericextension.AddArgs{
		Actuator:          NewActuator(mgr.GetClient(), mgr.GetAPIReader(), mgr.GetScheme(), opts.Config),
		Name:              "tendril-extension",
		FinalizerSuffix:   Type,
		Type:              Type,
		ControllerOptions: controller.Options{MaxConcurrentReconciles: opts.MaxConcurrentReconciles},
		Predicates:        genericextension.DefaultPredicates(ctx, mgr, opts.IgnoreOperationAnnotation),
	})
}
