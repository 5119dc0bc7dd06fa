package extension

import (
	"context"
	"fmt"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	genericextension "github.com/gardener/gardener/extensions/pkg/controller/extension"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	gardenerextensions "github.com/gardener/gardener/pkg/extensions"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
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
		WatchBuilder: extensionscontroller.NewWatchBuilder(
			func(c controller.Controller) error { return watchDrift(mgr, c) },
			func(c controller.Controller) error { return watchHibernation(mgr, c) },
		),
	})
}

// watchDrift reconciles a shoot when one of tendril's own seed objects is changed or deleted
// by someone else — the one exception to reconciling only when gardenlet asks. Only spec
// changes (generation) and deletions count: status updates and creations (including the
// cache's initial list at start-up) do not, so a restart does not reconcile every shoot, and
// tendril's own no-op apply writes nothing that would trigger another round.
func watchDrift(mgr manager.Manager, c controller.Controller) error {
	ours := predicate.NewPredicateFuncs(func(o client.Object) bool {
		return o.GetName() == manifest.ServerName || o.GetName() == manifest.RouteName
	})
	drift := predicate.Funcs{
		CreateFunc:  func(event.CreateEvent) bool { return false },
		UpdateFunc:  func(e event.UpdateEvent) bool { return e.ObjectNew.GetGeneration() != e.ObjectOld.GetGeneration() },
		DeleteFunc:  func(event.DeleteEvent) bool { return true },
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
	toExtension := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		return extensionsIn(ctx, mgr.GetClient(), o.GetNamespace())
	})
	for _, obj := range []client.Object{&appsv1.Deployment{}, &appsv1.StatefulSet{}, &policyv1.PodDisruptionBudget{}, &corev1.Service{}, &networkingv1.NetworkPolicy{}, &tendrilv1alpha1.Route{}} {
		if err := c.Watch(source.Kind[client.Object](mgr.GetCache(), obj, toExtension, ours, drift)); err != nil {
			return fmt.Errorf("watch %T: %w", obj, err)
		}
	}
	return nil
}

// extensionsIn lists the tendril Extensions of a shoot namespace that are not being deleted.
func extensionsIn(ctx context.Context, c client.Reader, namespace string) []reconcile.Request {
	list := &extensionsv1alpha1.ExtensionList{}
	if err := c.List(ctx, list, client.InNamespace(namespace)); err != nil {
		return nil
	}
	var reqs []reconcile.Request
	for _, e := range list.Items {
		if e.Spec.Type == Type && e.DeletionTimestamp == nil {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&e)})
		}
	}
	return reqs
}

// watchHibernation reconciles a shoot when its Cluster's hibernation changes. gardenlet v1.150
// does reconcile tendril while the shoot goes to sleep, once kube-apiserver is down
// ("Hibernating extension resources after kube-apiserver hibernation",
// pkg/gardenlet/controller/shoot/shoot/reconciler_reconcile.go l.899–902), but the Cluster
// still says status.isHibernated=false then: gardenlet sets it in
// patchShootStatusOperationSuccess (reconciler.go l.821) and writes it into the Cluster only
// after the flow (reconciler.go l.137), and asks nothing more of tendril. tendril scales down
// on IsHibernated (enabled and isHibernated), so that reconcile leaves the tunnel up while the
// workers drain, and only this watch scales tendril-server to zero and withdraws the Route
// once isHibernated arrives. On wake-up the watch is not needed: the Cluster (enabled=false)
// is written before the flow (reconciler.go l.346) and "Deploying extension resources before
// kube-apiserver" (reconciler_reconcile.go l.389–391) reconciles tendril. Only a change of
// spec.hibernation.enabled or status.isHibernated counts, not every Cluster update.
func watchHibernation(mgr manager.Manager, c controller.Controller) error {
	changed := predicate.Funcs{
		CreateFunc: func(event.CreateEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			oldEnabled, oldDone, okOld := hibernation(e.ObjectOld)
			newEnabled, newDone, okNew := hibernation(e.ObjectNew)
			return okOld && okNew && (oldEnabled != newEnabled || oldDone != newDone)
		},
		DeleteFunc:  func(event.DeleteEvent) bool { return false },
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
	// A Cluster is named after its shoot namespace.
	toExtension := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		return extensionsIn(ctx, mgr.GetClient(), o.GetName())
	})
	if err := c.Watch(source.Kind[client.Object](mgr.GetCache(), &extensionsv1alpha1.Cluster{}, toExtension, changed)); err != nil {
		return fmt.Errorf("watch clusters: %w", err)
	}
	return nil
}

// hibernation reads spec.hibernation.enabled and status.isHibernated of a Cluster's shoot;
// ok is false when the object is no Cluster or its shoot does not decode.
func hibernation(o client.Object) (enabled, hibernated, ok bool) {
	cl, isCluster := o.(*extensionsv1alpha1.Cluster)
	if !isCluster {
		return false, false, false
	}
	shoot, err := gardenerextensions.ShootFromCluster(cl)
	if err != nil || shoot == nil {
		return false, false, false
	}
	enabled = shoot.Spec.Hibernation != nil && ptr.Deref(shoot.Spec.Hibernation.Enabled, false)
	return enabled, shoot.Status.IsHibernated, true
}
