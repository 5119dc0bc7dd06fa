package extension

import (
	"strings"
	"testing"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestIstioTerminationNote: a shoot whose TLS Gardener's gateway would terminate (no annotation,
// or one that does not disable it) gets the note naming the annotation; a shoot carrying it gets
// none. The verdict is Gardener's helper's, and the annotation is Gardener's own constant.
func TestIstioTerminationNote(t *testing.T) {
	if DisableIstioTLSTermination != v1beta1constants.ShootDisableIstioTLSTermination {
		t.Fatalf("annotation %q, Gardener's is %q", DisableIstioTLSTermination, v1beta1constants.ShootDisableIstioTLSTermination)
	}
	shoot := func(annotations map[string]string) *extensionscontroller.Cluster {
		return &extensionscontroller.Cluster{Shoot: &gardencorev1beta1.Shoot{
			ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: "garden-p", Annotations: annotations},
			Spec: gardencorev1beta1.ShootSpec{Provider: gardencorev1beta1.Provider{
				Workers: []gardencorev1beta1.Worker{{Name: "w", Minimum: 1, Maximum: 1}},
			}},
		}}
	}
	for _, tc := range []struct {
		name    string
		cluster *extensionscontroller.Cluster
		note    bool
	}{
		{"no annotation (Gardener's default: terminated)", shoot(nil), true},
		{"annotation true", shoot(map[string]string{DisableIstioTLSTermination: "true"}), false},
		{"annotation false", shoot(map[string]string{DisableIstioTLSTermination: "false"}), true},
		{"no shoot", &extensionscontroller.Cluster{}, false},
	} {
		note := istioTerminationNote(tc.cluster)
		if got := note != ""; got != tc.note {
			t.Errorf("%s: note %q, want one: %v", tc.name, note, tc.note)
		}
		if note != "" && !strings.Contains(note, DisableIstioTLSTermination+"=true") {
			t.Errorf("%s: the note does not name the annotation: %q", tc.name, note)
		}
	}
}
