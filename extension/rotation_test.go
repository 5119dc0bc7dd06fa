package extension_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// TestCARotationKeepsTheMountedClientSecret: the shoot's CA rotation renews kube-apiserver's client
// certificate. kube-apiserver's Deployment still names the old Secret until gardenlet applies it
// again, so the old Secret stays (a kube-apiserver pod started meanwhile must mount it); a day
// later it goes.
func TestCARotationKeepsTheMountedClientSecret(t *testing.T) {
	env := kubetest.Start(t)
	c := env.Client
	clk := clocktesting.NewFakeClock(time.Now())
	startController(t, env, clk)
	ctx := context.Background()
	ns := "shoot--local--rotate"
	key := client.ObjectKey{Namespace: ns, Name: "tendril"}
	shoot(t, c, ns, false)
	must(t, c.Create(ctx, newExtension(ns, "")))
	waitSucceeded(t, c, key, time.Now().Add(-time.Second))

	clientSecrets := func() []string { return secretNames(t, c, ns, extension.SecretNameAPIServerClient) }
	// reconcile asks for a reconciliation as gardenlet does and waits for it. lastUpdateTime has
	// one-second resolution: step past the previous reconciliation's second first. A merge patch,
	// not an update: the controller writes the Extension's status meanwhile.
	reconcile := func() {
		t.Helper()
		time.Sleep(1100 * time.Millisecond)
		start := time.Now().Truncate(time.Second)
		ext := &extensionsv1alpha1.Extension{}
		must(t, c.Get(ctx, key, ext))
		patch := client.MergeFrom(ext.DeepCopy())
		metav1.SetMetaDataAnnotation(&ext.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
		must(t, c.Patch(ctx, ext, patch))
		waitSucceeded(t, c, key, start)
	}
	before := clientSecrets()
	if len(before) != 1 {
		t.Fatalf("client certificate secrets before the rotation: %v", before)
	}

	// gardenlet starts the CA rotation: the Cluster's shoot says Preparing since a moment ago.
	clk.Step(time.Minute)
	cluster := &extensionsv1alpha1.Cluster{}
	must(t, c.Get(ctx, client.ObjectKey{Name: ns}, cluster))
	var sh gardencorev1beta1.Shoot
	must(t, json.Unmarshal(cluster.Spec.Shoot.Raw, &sh))
	sh.Status.Credentials = &gardencorev1beta1.ShootCredentials{Rotation: &gardencorev1beta1.ShootCredentialsRotation{
		CertificateAuthorities: &gardencorev1beta1.CARotation{
			Phase:              gardencorev1beta1.RotationPreparing,
			LastInitiationTime: &metav1.Time{Time: clk.Now().Add(-30 * time.Second)},
		},
	}}
	raw, err := json.Marshal(sh)
	must(t, err)
	cluster.Spec.Shoot.Raw = raw
	must(t, c.Update(ctx, cluster)) // only tests write the Cluster
	// The controller reads the Cluster from its cache, which may not have the update yet when
	// the reconciliation starts: reconcile until the rotation shows.
	// renewed reconciles until the client certificate has a second Secret, and checks that the
	// first is old (kept for the pods that still mount it).
	renewed := func(why, old string) {
		t.Helper()
		var now []string
		testwait.For(t, "client certificate renewed "+why, func() error {
			reconcile()
			if now = clientSecrets(); len(now) < 2 {
				return fmt.Errorf("client certificate secrets %v", now)
			}
			return nil
		})
		if len(now) != 2 || !slices.Contains(now, old) {
			t.Fatalf("client certificate secrets %v: %v, want the old %s and a new one", why, now, old)
		}
	}
	renewed("with the CA", before[0])

	// A day later the old one goes at the next reconciliation.
	clk.Step(25 * time.Hour)
	reconcile()
	var after []string
	testwait.For(t, "old client secret removed", func() error {
		if after = clientSecrets(); len(after) != 1 || after[0] == before[0] {
			return fmt.Errorf("client certificate secrets a day later: %v", after)
		}
		return nil
	})

	// Past 80 % of its validity the certificate is renewed (the old Secret kept again), the CA
	// not: the renewal is the certificate's own (extension's certificateValidity, 10 years).
	cas := secretNames(t, c, ns, extension.SecretNameCA)
	clk.Step(8*365*24*time.Hour + 24*time.Hour)
	renewed("before it expires", after[0])
	if now := secretNames(t, c, ns, extension.SecretNameCA); !slices.Equal(now, cas) {
		t.Errorf("CA secrets %v, were %v: the CA was renewed too", now, cas)
	}
}

// secretNames are the names of the secrets manager's Secrets for config name in ns, sorted.
func secretNames(t *testing.T, c client.Client, ns, name string) []string {
	t.Helper()
	var list corev1.SecretList
	must(t, c.List(context.Background(), &list, client.InNamespace(ns), client.MatchingLabels{
		secretsmanager.LabelKeyManagerIdentity: extension.SecretsManagerIdentity,
		secretsmanager.LabelKeyName:            name,
	}))
	var names []string
	for _, s := range list.Items {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	return names
}
