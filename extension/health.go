package extension

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/gardener/gardener/extensions/pkg/controller/healthcheck"
	"github.com/gardener/gardener/extensions/pkg/controller/healthcheck/general"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/tendril-net/tendril/extension/manifest"
)

// HealthOptions configure the health check controller.
type HealthOptions struct {
	// SyncPeriod is how often every Extension is checked (30 s when 0, Gardener's default).
	SyncPeriod time.Duration
	// RolloutGrace is how long tendril-server may run without a live tunnel before the
	// condition turns from Progressing to False (3 minutes when 0).
	RolloutGrace time.Duration
}

// AddHealthCheck registers Gardener's health check controller for tendril Extensions: the
// shoot-side ManagedResource feeds SystemComponentsHealthy; the tendril-server Deployment,
// whose pods are Ready only while an agent's tunnel is up, feeds ControlPlaneHealthy (a shoot
// whose agent is not connected is not healthy). Never APIServerAvailable: that condition is
// Gardener's own.
func AddHealthCheck(mgr manager.Manager, opts HealthOptions) error {
	opts.SyncPeriod = cmp.Or(opts.SyncPeriod, 30*time.Second)
	opts.RolloutGrace = cmp.Or(opts.RolloutGrace, 3*time.Minute)
	args := healthcheck.DefaultAddArgs{}
	args.HealthCheckConfig.SyncPeriod = metav1.Duration{Duration: opts.SyncPeriod}
	return healthcheck.DefaultRegistration(
		Type,
		extensionsv1alpha1.SchemeGroupVersion.WithKind(extensionsv1alpha1.ExtensionResource),
		func() client.ObjectList { return &extensionsv1alpha1.ExtensionList{} },
		func() extensionsv1alpha1.Object { return &extensionsv1alpha1.Extension{} },
		mgr, args, nil,
		[]healthcheck.ConditionTypeToHealthCheck{
			{ConditionType: string(gardencorev1beta1.ShootSystemComponentsHealthy), HealthCheck: general.CheckManagedResource(manifest.ManagedResourceName)},
			{ConditionType: string(gardencorev1beta1.ShootControlPlaneHealthy), HealthCheck: &serverCheck{grace: opts.RolloutGrace, client: mgr.GetClient()}},
		},
		nil,
	)
}

// serverCheck is ControlPlaneHealthy: tendril-server is deployed and one of its pods is Ready.
// The pod's readiness probe is tendril-server's /readyz, which passes only while an agent's
// tunnel is up, so kubelet carries the tunnel's state to the Deployment's readyReplicas: the
// extension needs no network path into the shoot namespace (which Gardener's NetworkPolicies
// deny) and no API server pod proxy. It replaces Gardener's general Deployment check, which
// would turn False the moment the tunnel drops (a not-ready pod makes the Deployment
// unavailable) instead of granting a freshly started server time for its agent to dial in.
type serverCheck struct {
	grace  time.Duration
	client client.Client
}

func (c *serverCheck) SetLoggerSuffix(string, string) {}

func (c *serverCheck) Check(ctx context.Context, req types.NamespacedName) (*healthcheck.SingleCheckResult, error) {
	w, err := c.workload(ctx, req.Namespace)
	if err != nil {
		return nil, err
	}
	if w == nil {
		return &healthcheck.SingleCheckResult{Status: gardencorev1beta1.ConditionFalse, Detail: "tendril-server not found (no Deployment or StatefulSet " + manifest.ServerName + ")"}, nil
	}
	// The health library does not run checks for a hibernated shoot, and the actuator
	// scales to zero only then: zero replicas here is someone else's doing.
	if w.replicas == 0 {
		return &healthcheck.SingleCheckResult{Status: gardencorev1beta1.ConditionFalse, Detail: w.kind + " " + manifest.ServerName + " is scaled to zero"}, nil
	}
	// One Ready replica carries the shoot: every agent keeps a tunnel to each.
	if w.ready > 0 && w.observed >= w.generation {
		return &healthcheck.SingleCheckResult{Status: gardencorev1beta1.ConditionTrue}, nil
	}
	// No Ready pod: a server that just started (or restarted, or is being replaced) waits for
	// its agent; Progressing until the grace runs out, after which the library turns the
	// condition False.
	detail := fmt.Sprintf("no shoot agent tunnel: %d of %d tendril-server pods ready (readiness is the tunnel)", w.ready, w.replicas)
	if w.observed < w.generation {
		detail = fmt.Sprintf("tendril-server rollout not observed yet (generation %d, observed %d)", w.generation, w.observed)
	}
	return &healthcheck.SingleCheckResult{
		Status:               gardencorev1beta1.ConditionProgressing,
		Detail:               detail,
		ProgressingThreshold: &c.grace,
	}, nil
}

// serverWorkload is what the check reads of tendril-server's Deployment or StatefulSet.
type serverWorkload struct {
	kind                 string
	replicas, ready      int32
	generation, observed int64
}

// workload reads tendril-server as it runs: the StatefulSet of an HA shoot, else the Deployment
// (nil: neither). While a shoot changes shape both may exist for a moment; the StatefulSet,
// the newer shape of the two, is read first.
func (c *serverCheck) workload(ctx context.Context, ns string) (*serverWorkload, error) {
	key := client.ObjectKey{Namespace: ns, Name: manifest.ServerName}
	sts := &appsv1.StatefulSet{}
	switch err := c.client.Get(ctx, key, sts); {
	case err == nil:
		return &serverWorkload{kind: "statefulset", replicas: ptr.Deref(sts.Spec.Replicas, 1), ready: sts.Status.ReadyReplicas,
			generation: sts.Generation, observed: sts.Status.ObservedGeneration}, nil
	case !apierrors.IsNotFound(err):
		return nil, fmt.Errorf("read statefulset %s: %w", manifest.ServerName, err)
	}
	dep := &appsv1.Deployment{}
	switch err := c.client.Get(ctx, key, dep); {
	case err == nil:
		return &serverWorkload{kind: "deployment", replicas: ptr.Deref(dep.Spec.Replicas, 1), ready: dep.Status.ReadyReplicas,
			generation: dep.Generation, observed: dep.Status.ObservedGeneration}, nil
	case apierrors.IsNotFound(err):
		return nil, nil
	default:
		return nil, fmt.Errorf("read deployment %s: %w", manifest.ServerName, err)
	}
}
