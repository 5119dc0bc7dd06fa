package controlplane_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/go-logr/logr/testr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/internal/kubetest"
	"github.com/tendril-net/tendril/internal/testwait"
)

// TestControlPlane runs the whole control plane against a real API server: the
// gardener-extension-heartbeat Lease is created and renewed, as gardenlet expects, and a
// shoot's Extension ends in a Route that the route source picks up and reports on (no
// kube-apiserver endpoints yet: Programmed=False, NoEndpoints, for the Route's generation).
func TestControlPlane(t *testing.T) {
	env := kubetest.Start(t)
	c := env.Client
	ctx, cancel := context.WithCancel(context.Background())
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "extension-tendril"}}))
	done := make(chan error, 1)
	go func() {
		done <- controlplane.Run(ctx, controlplane.Config{
			REST:               env.Config,
			XDSAddress:         "127.0.0.1:0",
			MetricsAddress:     "0",
			HealthAddress:      "0",
			HeartbeatNamespace: "extension-tendril",
			HeartbeatInterval:  1,
			WebhookPort:        -1, // the webhook has its own envtest in extension/egresswebhook
			Extension:          extension.AddOptions{Config: extension.Config{Image: "example.org/tendril:test", Ingress: "ingress.example.org"}},
			Log:                testr.New(t),
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("control plane: %v", err)
		}
	})
	ns := "shoot--local--alpha"
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{"gardener.cloud/role": "shoot"}}}))
	must(t, c.Create(ctx, &extensionsv1alpha1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: ns},
		Spec: extensionsv1alpha1.ClusterSpec{
			CloudProfile: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"CloudProfile"}`)},
			Seed:         &runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Seed"}`)},
			Shoot: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Shoot",
				"metadata":{"name":"alpha","namespace":"garden-local"},
				"spec":{"dns":{"domain":"alpha.local.example.org"},"networking":{"nodes":"10.250.0.0/16","pods":"100.64.0.0/12","services":"100.104.0.0/13"}}}`)},
		},
	}))
	must(t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "kube-apiserver", Port: 443}}},
	}))
	must(t, c.Create(ctx, &extensionsv1alpha1.Extension{
		ObjectMeta: metav1.ObjectMeta{Name: "tendril", Namespace: ns},
		Spec:       extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: extension.Type}},
	}))
	testwait.For(t, "route reported on", func() error {
		r := &tendrilv1alpha1.Route{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril"}, r); err != nil {
			return err
		}
		cond := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed)
		if cond == nil || r.Status.ObservedGeneration != r.Generation {
			return fmt.Errorf("route status %+v", r.Status)
		}
		if cond.Status != metav1.ConditionFalse || cond.Reason != tendrilv1alpha1.ReasonNoEndpoints {
			return fmt.Errorf("Programmed %s/%s: %s", cond.Status, cond.Reason, cond.Message)
		}
		return nil
	})

	var first time.Time
	testwait.For(t, "heartbeat renewed twice", func() error {
		l := &coordinationv1.Lease{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: "extension-tendril", Name: "gardener-extension-heartbeat"}, l); err != nil {
			return err
		}
		if l.Spec.RenewTime == nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != extension.Type {
			return fmt.Errorf("lease %+v", l.Spec)
		}
		if first.IsZero() {
			first = l.Spec.RenewTime.Time
			return fmt.Errorf("first renewal seen at %s", first)
		}
		if !l.Spec.RenewTime.After(first) {
			return fmt.Errorf("renewTime %s not after %s", l.Spec.RenewTime.Time, first)
		}
		return nil
	})
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
