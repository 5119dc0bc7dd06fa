package controlplane_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/internal/kubetest"
	"github.com/tendril-net/tendril/internal/testwait"
)

// TestHeartbeat runs the whole control plane against a real API server and watches the
// gardener-extension-heartbeat Lease being created and renewed, as gardenlet does.
func TestHeartbeat(t *testing.T) {
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
