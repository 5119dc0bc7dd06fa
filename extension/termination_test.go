package extension_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"testing"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
)

// gardenletSecrets generates, with Gardener's own secrets manager under gardenlet's identity,
// the CAs and the kube-apiserver serving certificate gardenlet keeps in a shoot namespace, and
// returns the manager (to read them back as gardenlet would, and to rotate).
func gardenletSecrets(t *testing.T, c client.Client, ns string, serverDNS ...string) secretsmanager.Interface {
	t.Helper()
	ctx := context.Background()
	sm, err := secretsmanager.New(ctx, testr.New(t), clock.RealClock{}, c, v1beta1constants.SecretManagerIdentityGardenlet, secretsmanager.WithNamespaces(ns))
	if err != nil {
		t.Fatal(err)
	}
	for _, ca := range []string{v1beta1constants.SecretNameCACluster, v1beta1constants.SecretNameCAClient, v1beta1constants.SecretNameCAFrontProxy} {
		if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: ca, CommonName: ca, CertType: secretsutils.CACert},
			secretsmanager.Rotate(secretsmanager.KeepOld)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: extension.SecretNameKubeAPIServerServer, CommonName: "kube-apiserver",
		DNSNames: append([]string{"kube-apiserver", "kube-apiserver." + ns}, serverDNS...), CertType: secretsutils.ServerCert, SkipPublishingCACertificate: true},
		secretsmanager.SignedByCA(v1beta1constants.SecretNameCACluster)); err != nil {
		t.Fatal(err)
	}
	return sm
}

// TestPerRequestBalancing: providerConfig kubeAPIServer.balancing PerRequest gives the Route a
// termination whose Secret holds gardenlet's current kube-apiserver serving certificate and
// client and cluster CA bundles (as Gardener's secrets manager keeps them), and a front-proxy
// client certificate signed by gardenlet's front-proxy CA, which the control plane's model
// accepts; a new serving certificate is followed; switching back removes both.
func TestPerRequestBalancing(t *testing.T) {
	env := kubetest.Start(t)
	startController(t, env, nil)
	c := env.Client
	ctx := context.Background()
	ns := "shoot--local--balanced"
	shoot(t, c, ns, false)
	gsm := gardenletSecrets(t, c, ns, "api.balanced.local.example.org")
	ext := createExtension(t, c, ns, `{"kubeAPIServer":{"balancing":"PerRequest"}}`)

	route := &tendrilv1alpha1.Route{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.RouteName}, route))
	if tm := route.Spec.Termination; tm == nil || tm.SecretName != manifest.TerminationSecretName || tm.APIServerName != "kube-apiserver" {
		t.Fatalf("Route termination %+v", route.Spec.Termination)
	}
	sec := &corev1.Secret{}
	must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.TerminationSecretName}, sec))
	if sec.Labels[tendrilv1alpha1.TerminationSecretLabel] != "true" {
		t.Errorf("termination Secret labels %v", sec.Labels)
	}
	current := func(name string, opts ...secretsmanager.GetOption) *corev1.Secret {
		s, ok := gsm.Get(name, opts...)
		if !ok {
			t.Fatalf("gardenlet's secrets manager has no %s", name)
		}
		return s
	}
	server := current(extension.SecretNameKubeAPIServerServer, secretsmanager.Current)
	for key, want := range map[string][]byte{
		tendrilv1alpha1.TerminationServingCert: server.Data[secretsutils.DataKeyCertificate],
		tendrilv1alpha1.TerminationServingKey:  server.Data[secretsutils.DataKeyPrivateKey],
		tendrilv1alpha1.TerminationClientCA:    current(v1beta1constants.SecretNameCAClient, secretsmanager.Bundle).Data[secretsutils.DataKeyCertificateBundle],
		tendrilv1alpha1.TerminationAPIServerCA: current(v1beta1constants.SecretNameCACluster, secretsmanager.Bundle).Data[secretsutils.DataKeyCertificateBundle],
	} {
		if len(want) == 0 || !bytes.Equal(sec.Data[key], want) {
			t.Errorf("%s: %d bytes, want gardenlet's %d", key, len(sec.Data[key]), len(want))
		}
	}
	// The front-proxy certificate verifies against the bundle kube-apiserver's
	// --requestheader-client-ca-file holds, for client authentication.
	blk, _ := pem.Decode(sec.Data[tendrilv1alpha1.TerminationFrontProxyCert])
	if blk == nil {
		t.Fatal("no front-proxy certificate")
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	must(t, err)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(current(v1beta1constants.SecretNameCAFrontProxy, secretsmanager.Bundle).Data[secretsutils.DataKeyCertificateBundle])
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil || cert.Subject.CommonName != extension.FrontProxyUser {
		t.Errorf("front-proxy certificate %q: %v", cert.Subject.CommonName, err)
	}
	tm := &model.Termination{
		ServingCert: sec.Data[tendrilv1alpha1.TerminationServingCert], ServingKey: sec.Data[tendrilv1alpha1.TerminationServingKey],
		ClientCA:       sec.Data[tendrilv1alpha1.TerminationClientCA],
		FrontProxyCert: sec.Data[tendrilv1alpha1.TerminationFrontProxyCert], FrontProxyKey: sec.Data[tendrilv1alpha1.TerminationFrontProxyKey],
		APIServerCA: sec.Data[tendrilv1alpha1.TerminationAPIServerCA], APIServerName: route.Spec.Termination.APIServerName,
	}
	if err := tm.Validate(); err != nil {
		t.Errorf("the control plane's model refuses the termination Secret: %v", err)
	}

	// gardenlet issues a new serving certificate (another config: a new Secret beside the
	// old); the next reconcile follows it.
	gsm = gardenletSecrets(t, c, ns, "api.balanced.local.example.org", "api.balanced.local.internal.example.org")
	renewed := current(extension.SecretNameKubeAPIServerServer, secretsmanager.Current)
	if renewed.Name == server.Name {
		t.Fatal("the test's new serving certificate is the old one")
	}
	reconcileAgain(t, c, ext)
	testwait.For(t, "the renewed serving certificate", func() error {
		must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.TerminationSecretName}, sec))
		if !bytes.Equal(sec.Data[tendrilv1alpha1.TerminationServingCert], renewed.Data[secretsutils.DataKeyCertificate]) {
			return fmt.Errorf("the termination Secret still has the old serving certificate")
		}
		return nil
	})

	// Back to per-connection: the Route loses its termination, the Secret goes.
	must(t, c.Get(ctx, client.ObjectKeyFromObject(ext), ext))
	ext.Spec.ProviderConfig.Raw = []byte(`{"kubeAPIServer":{"balancing":"PerConnection"}}`)
	must(t, c.Update(ctx, ext))
	reconcileAgain(t, c, ext) // gardenlet's operation annotation, as after any change of the Extension
	testwait.For(t, "termination withdrawn", func() error {
		must(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.RouteName}, route))
		if route.Spec.Termination != nil {
			return fmt.Errorf("Route still terminates: %+v", route.Spec.Termination)
		}
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: manifest.TerminationSecretName}, &corev1.Secret{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("termination Secret: %v", err)
		}
		return nil
	})
}

// reconcileAgain asks for a reconcile as gardenlet does (its operation annotation) and waits for
// it to succeed.
func reconcileAgain(t *testing.T, c client.Client, ext *extensionsv1alpha1.Extension) {
	t.Helper()
	ctx := context.Background()
	after := afterLastOperation(t, c, client.ObjectKeyFromObject(ext))
	must(t, c.Get(ctx, client.ObjectKeyFromObject(ext), ext))
	patch := client.MergeFrom(ext.DeepCopy())
	metav1.SetMetaDataAnnotation(&ext.ObjectMeta, v1beta1constants.GardenerOperation, v1beta1constants.GardenerOperationReconcile)
	must(t, c.Patch(ctx, ext, patch))
	waitSucceeded(t, c, client.ObjectKeyFromObject(ext), after)
}
