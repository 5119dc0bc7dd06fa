package extension

import (
	"context"
	"fmt"
	"strconv"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
)

// The terminating mode (providerConfig kubeAPIServer.balancing: PerRequest) needs what gardenlet
// gives istio for Gardener's own TLS termination (gardener's apiserverexposure, sni.go): the
// current kube-apiserver serving certificate, the client CA bundle, the cluster CA bundle, and
// a client certificate signed by the front-proxy CA, which kube-apiserver trusts for the
// authenticating-proxy headers (its --requestheader-client-ca-file is that CA's bundle, with no
// --requestheader-allowed-names). They are gardenlet's secrets manager's Secrets in the shoot
// namespace; the extension reads them (uncached) and writes them into the one Secret the Route
// names.
const (
	// GardenletIdentity is gardenlet's secrets manager's identity (its manager-identity label).
	GardenletIdentity = v1beta1constants.SecretManagerIdentityGardenlet
	// SecretNameKubeAPIServerServer is gardenlet's kube-apiserver serving certificate.
	SecretNameKubeAPIServerServer = "kube-apiserver"
	// SecretNameFrontProxyClient is the client certificate the ingress presents to
	// kube-apiserver, signed by gardenlet's front-proxy CA.
	SecretNameFrontProxyClient = "tendril-front-proxy-client"
	// FrontProxyUser is its common name: the name kube-apiserver's audit log shows as the proxy.
	FrontProxyUser = "tendril:ingress"
)

// gardenletSecret returns the newest (by the secrets manager's issued-at-time label) of the
// Secrets gardenlet's secrets manager holds in ns with the label key=value: the current one
// during a rotation, when the old one is still there.
func gardenletSecret(ctx context.Context, r client.Reader, ns, key, value string) (*corev1.Secret, error) {
	var list corev1.SecretList
	if err := r.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{
		secretsmanager.LabelKeyManagedBy: secretsmanager.LabelValueSecretsManager, secretsmanager.LabelKeyManagerIdentity: GardenletIdentity,
		key: value,
	}); err != nil {
		return nil, fmt.Errorf("list gardenlet's secret %s=%s: %w", key, value, err)
	}
	var newest *corev1.Secret
	var newestAt int64
	for i := range list.Items {
		s := &list.Items[i]
		at, _ := strconv.ParseInt(s.Labels[secretsmanager.LabelKeyIssuedAtTime], 10, 64)
		if newest == nil || at > newestAt || at == newestAt && s.Name > newest.Name {
			newest, newestAt = s, at
		}
	}
	if newest == nil {
		return nil, fmt.Errorf("gardenlet's secret %s=%s not found in %s", key, value, ns)
	}
	return newest, nil
}

// terminationSecret assembles the Route's termination Secret for ns, generating the front-proxy
// client certificate with sm (renewed when gardenlet's front-proxy CA changes).
func terminationSecret(ctx context.Context, r client.Reader, sm secretsmanager.Interface, ns string) (*corev1.Secret, error) {
	server, err := gardenletSecret(ctx, r, ns, secretsmanager.LabelKeyName, SecretNameKubeAPIServerServer)
	if err != nil {
		return nil, err
	}
	clientCA, err := gardenletSecret(ctx, r, ns, secretsmanager.LabelKeyBundleFor, v1beta1constants.SecretNameCAClient)
	if err != nil {
		return nil, err
	}
	clusterCA, err := gardenletSecret(ctx, r, ns, secretsmanager.LabelKeyBundleFor, v1beta1constants.SecretNameCACluster)
	if err != nil {
		return nil, err
	}
	frontProxyCA, err := gardenletSecret(ctx, r, ns, secretsmanager.LabelKeyName, v1beta1constants.SecretNameCAFrontProxy)
	if err != nil {
		return nil, err
	}
	signer, err := loadSigningCA(frontProxyCA.Data)
	if err != nil {
		return nil, fmt.Errorf("gardenlet's %s: %w", v1beta1constants.SecretNameCAFrontProxy, err)
	}
	front, err := sm.Generate(ctx, signer.certificate(SecretNameFrontProxyClient, FrontProxyUser, nil, secretsutils.ClientCert),
		secretsmanager.Validity(certificateValidity))
	if err != nil {
		return nil, fmt.Errorf("generate secret %s: %w", SecretNameFrontProxyClient, err)
	}
	return &corev1.Secret{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Name: manifest.TerminationSecretName, Namespace: ns,
			Labels: map[string]string{tendrilv1alpha1.TerminationSecretLabel: "true"}},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{
			tendrilv1alpha1.TerminationServingCert:    server.Data[secretsutils.DataKeyCertificate],
			tendrilv1alpha1.TerminationServingKey:     server.Data[secretsutils.DataKeyPrivateKey],
			tendrilv1alpha1.TerminationClientCA:       clientCA.Data[secretsutils.DataKeyCertificateBundle],
			tendrilv1alpha1.TerminationFrontProxyCert: front.Data[secretsutils.DataKeyCertificate],
			tendrilv1alpha1.TerminationFrontProxyKey:  front.Data[secretsutils.DataKeyPrivateKey],
			tendrilv1alpha1.TerminationAPIServerCA:    clusterCA.Data[secretsutils.DataKeyCertificateBundle],
		},
	}, nil
}
