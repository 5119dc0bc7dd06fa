package extension

import (
	"context"
	"testing"
	"time"

	"github.com/gardener/gardener/extensions/pkg/controller/healthcheck"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
)

// TestServerCheck covers serverCheck's verdicts on Deployment states, among them those the
// envtest cannot hold still (the drift watch undoes a scale to zero at once). The transitions
// over time (Progressing, then False after the grace) are TestExtension/health's.
func TestServerCheck(t *testing.T) {
	const ns = "shoot--local--unit"
	dep := func(replicas, ready int32, generation, observed int64) *appsv1.Deployment {
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: manifest.ServerName, Namespace: ns, Generation: generation},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(replicas)},
			Status:     appsv1.DeploymentStatus{ReadyReplicas: ready, ObservedGeneration: observed},
		}
	}
	for _, tc := range []struct {
		name string
		dep  *appsv1.Deployment
		want gardencorev1beta1.ConditionStatus
	}{
		{"missing", nil, gardencorev1beta1.ConditionFalse},
		{"scaled to zero", dep(0, 0, 2, 2), gardencorev1beta1.ConditionFalse},
		{"tunnel up", dep(1, 1, 2, 2), gardencorev1beta1.ConditionTrue},
		{"tunnel down", dep(1, 0, 2, 2), gardencorev1beta1.ConditionProgressing},
		{"rollout not observed", dep(1, 1, 3, 2), gardencorev1beta1.ConditionProgressing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := fake.NewClientBuilder().WithScheme(kubescheme.New())
			if tc.dep != nil {
				b = b.WithObjects(tc.dep)
			}
			c := &serverCheck{grace: time.Minute, client: b.Build()}
			res, err := c.Check(context.Background(), types.NamespacedName{Namespace: ns, Name: "tendril"})
			if err != nil {
				t.Fatal(err)
			}
			if res.Status != tc.want {
				t.Errorf("status %s (%s), want %s", res.Status, res.Detail, tc.want)
			}
			if tc.want == gardencorev1beta1.ConditionProgressing && (res.ProgressingThreshold == nil || *res.ProgressingThreshold != time.Minute) {
				t.Errorf("progressing without the grace as threshold: %v", res.ProgressingThreshold)
			}
		})
	}
	var _ healthcheck.HealthCheck = &serverCheck{}
}
