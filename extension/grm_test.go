package extension_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	v1beta1helper "github.com/gardener/gardener/pkg/api/core/v1beta1/helper"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"github.com/go-logr/logr/testr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kube/shootgrm"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// grmClusterID is the seed identity the test's resource manager writes into origin annotations.
const grmClusterID = "seed-local"

// TestShootResourcesByGRM runs Gardener's own resource manager controllers between a seed and
// a shoot API server, so the shoot-side objects get there as on a real seed: GRM applies the
// extension's ManagedResource (ResourcesApplied, origin annotation, managed-by label), judges
// the agent (ResourcesHealthy/Progressing feed SystemComponentsHealthy: not healthy until the
// agent's Deployment is available, healthy after), repairs an agent deleted in the shoot,
// and on Migrate (keepObjects) leaves the shoot's objects where they are. kube-controller-
// manager's part (a Deployment's status) is written by the test.
func TestShootResourcesByGRM(t *testing.T) {
	seed, shootAPI := kubetest.Start(t), kubetest.Start(t)
	startController(t, seed, nil)
	ctx := context.Background()
	ns := "shoot--local--theta"
	startGRM(t, seed, shootAPI, ns)
	// gardenlet creates its priority classes in every shoot.
	must(t, shootAPI.Client.Create(ctx, &schedulingv1.PriorityClass{
		ObjectMeta: metav1.ObjectMeta{Name: v1beta1constants.PriorityClassNameShootSystem900}, Value: 999999900, // gardener pkg/component/shoot/system
	}))

	shoot(t, seed.Client, ns, false)
	ext := createExtension(t, seed.Client, ns, "")
	setServerReady(t, seed.Client, ns, 1)

	waitMRCondition(t, seed.Client, ns, resourcesv1alpha1.ResourcesApplied, gardencorev1beta1.ConditionTrue)
	agentKey := client.ObjectKey{Namespace: manifest.ShootNamespace, Name: manifest.AgentName}
	agent := &appsv1.Deployment{}
	must(t, shootAPI.Client.Get(ctx, agentKey, agent))
	origin := grmClusterID + ":" + ns + "/" + manifest.ManagedResourceName
	if got := agent.Annotations[resourcesv1alpha1.OriginAnnotation]; got != origin {
		t.Errorf("agent origin annotation %q, want %q", got, origin)
	}
	if got := agent.Labels[resourcesv1alpha1.ManagedBy]; got != resourcesv1alpha1.GardenerManager {
		t.Errorf("agent label %s=%q, want %q", resourcesv1alpha1.ManagedBy, got, resourcesv1alpha1.GardenerManager)
	}
	secrets := &corev1.SecretList{}
	must(t, shootAPI.Client.List(ctx, secrets, client.InNamespace(manifest.ShootNamespace), client.MatchingLabels{resourcesv1alpha1.ManagedBy: resourcesv1alpha1.GardenerManager}))
	if len(secrets.Items) == 0 {
		t.Error("no Secret applied to the shoot: the agent has no key")
	}

	// No kube-controller-manager in the shoot: the agent is not available, and GRM says so.
	waitMRCondition(t, seed.Client, ns, resourcesv1alpha1.ResourcesHealthy, gardencorev1beta1.ConditionFalse)
	waitConditionNot(t, seed.Client, ext, gardencorev1beta1.ShootSystemComponentsHealthy, gardencorev1beta1.ConditionTrue)
	markAgentAvailable(t, shootAPI.Client, agentKey)
	waitMRCondition(t, seed.Client, ns, resourcesv1alpha1.ResourcesHealthy, gardencorev1beta1.ConditionTrue)
	waitMRCondition(t, seed.Client, ns, resourcesv1alpha1.ResourcesProgressing, gardencorev1beta1.ConditionFalse)
	waitCondition(t, seed.Client, ext, gardencorev1beta1.ShootSystemComponentsHealthy, gardencorev1beta1.ConditionTrue)

	// Someone deletes the agent in the shoot: GRM puts it back.
	must(t, shootAPI.Client.Delete(ctx, agent))
	testwait.For(t, "agent re-created in the shoot", func() error {
		d := &appsv1.Deployment{}
		if err := shootAPI.Client.Get(ctx, agentKey, d); err != nil {
			return err
		}
		if d.UID == agent.UID {
			return fmt.Errorf("still the deleted one")
		}
		agent = d
		return nil
	})

	// Migrate: keepObjects, the ManagedResource goes from the seed, the objects stay. GRM's
	// finalizer makes the deletion wait for GRM, which then leaves the objects alone.
	if mr := managedResource(t, seed.Client, ns); !slices.Contains(mr.Finalizers, "resources.gardener.cloud/gardener-resource-manager") {
		t.Errorf("ManagedResource finalizers %v: GRM's is missing", mr.Finalizers)
	}
	must(t, seed.Client.Get(ctx, client.ObjectKeyFromObject(ext), ext))
	migrate(t, seed.Client, ext)
	if err := seed.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, &resourcesv1alpha1.ManagedResource{}); !apierrors.IsNotFound(err) {
		t.Errorf("ManagedResource after migrate: %v, want it gone", err)
	}
	kept := &appsv1.Deployment{}
	must(t, shootAPI.Client.Get(ctx, agentKey, kept))
	if kept.UID != agent.UID || kept.DeletionTimestamp != nil {
		t.Errorf("agent after migrate: uid %s (was %s), deleting %v: keepObjects must leave it running", kept.UID, agent.UID, kept.DeletionTimestamp)
	}
	after := &corev1.SecretList{}
	must(t, shootAPI.Client.List(ctx, after, client.InNamespace(manifest.ShootNamespace), client.MatchingLabels{resourcesv1alpha1.ManagedBy: resourcesv1alpha1.GardenerManager}))
	if len(after.Items) != len(secrets.Items) {
		t.Errorf("%d managed Secrets in the shoot after migrate, want %d", len(after.Items), len(secrets.Items))
	}
}

// startGRM runs Gardener's resource manager for ns (seed → shoot) until the test ends.
func startGRM(t *testing.T, seed, shootAPI *kubetest.Env, ns string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	mgr, err := shootgrm.New(ctx, shootgrm.Config{
		Seed: seed.Config, Shoot: shootAPI.Config, Namespace: ns, ClusterID: grmClusterID,
		SyncPeriod: 2 * time.Second, Logger: testr.New(t).WithName("grm"),
	})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("resource manager: %v", err)
		}
	})
}

func waitMRCondition(t *testing.T, c client.Client, ns string, typ gardencorev1beta1.ConditionType, want gardencorev1beta1.ConditionStatus) {
	t.Helper()
	testwait.For(t, fmt.Sprintf("ManagedResource %s=%s", typ, want), func() error {
		mr := &resourcesv1alpha1.ManagedResource{}
		if err := c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: manifest.ManagedResourceName}, mr); err != nil {
			return err
		}
		cond := v1beta1helper.GetCondition(mr.Status.Conditions, typ)
		if cond == nil {
			return fmt.Errorf("no %s condition in %v", typ, mr.Status.Conditions)
		}
		if cond.Status != want {
			return fmt.Errorf("%s is %s: %s %s", typ, cond.Status, cond.Reason, cond.Message)
		}
		return nil
	})
}

// markAgentAvailable does for the agent Deployment what the shoot's kube-controller-manager
// and kubelet would: one running pod per replica (GRM's progressing check counts them) and
// the Deployment's status once they are Ready.
func markAgentAvailable(t *testing.T, c client.Client, key types.NamespacedName) {
	t.Helper()
	ctx := context.Background()
	d := &appsv1.Deployment{}
	must(t, c.Get(ctx, key, d))
	replicas := ptr.Deref(d.Spec.Replicas, 1)
	for i := range replicas {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: d.Namespace, Name: fmt.Sprintf("%s-%d", d.Name, i), Labels: d.Spec.Template.Labels},
			Spec:       d.Spec.Template.Spec,
		}
		must(t, c.Create(ctx, pod))
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
		must(t, c.Status().Update(ctx, pod))
	}
	d.Status = appsv1.DeploymentStatus{
		ObservedGeneration: d.Generation, Replicas: replicas, UpdatedReplicas: replicas, ReadyReplicas: replicas, AvailableReplicas: replicas,
		Conditions: []appsv1.DeploymentCondition{
			{Type: appsv1.DeploymentAvailable, Status: corev1.ConditionTrue, Reason: "MinimumReplicasAvailable"},
			{Type: appsv1.DeploymentProgressing, Status: corev1.ConditionTrue, Reason: "NewReplicaSetAvailable"},
		},
	}
	must(t, c.Status().Update(ctx, d))
}
