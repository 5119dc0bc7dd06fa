package realseed

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/utils/clock"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/manifest"
)

// The shoot owner's client certificate: what the owner's kubeconfig (UserKubeconfig) presents,
// signed by gardenlet's client CA as Gardener's admin kubeconfigs are.
const (
	ShootOwnerUser       = "shoot-owner"
	secretNameShootOwner = "realseed-shoot-owner"
	shootPKIFrontProxyCA = "front-proxy-ca.crt"
	shootPKIClientCA     = "client-ca.crt"
	shootPKIOwnerCert    = "owner.crt"
	shootPKIOwnerKey     = "owner.key"
	shootInternalDomain  = "internal." + ShootDomain
)

// shootPKIFiles are the files of the shoot's PKI kube-apiserver mounts (Secret
// kube-apiserver-local).
var shootPKIFiles = []string{"ca.crt", "tls.crt", "tls.key", shootPKIClientCA, shootPKIFrontProxyCA, "sa.key", "sa.pub", "tokens.csv"}

// shootPKI makes the shoot's certificates as gardenlet does, with Gardener's own secrets manager
// under gardenlet's identity in the shoot namespace: the cluster CA (ca), the client CA
// (ca-client), the front-proxy CA (ca-front-proxy), kube-apiserver's serving certificate
// (kube-apiserver, signed by ca), and the owner's client certificate (signed by ca-client). So
// tendril's extension finds the Secrets it reads for the terminating mode where and as
// gardenlet keeps them. It writes the files kube-apiserver mounts and the admin kubeconfig
// through the ingress (a token: the node's kubelet uses it too) into the shoot's directory.
func (c *Cluster) shootPKI(ctx context.Context, s *Shoot, lb netip.Addr) error {
	sm, err := secretsmanager.New(ctx, logr.Discard(), clock.RealClock{}, c.Client, v1beta1constants.SecretManagerIdentityGardenlet, secretsmanager.WithNamespaces(s.Namespace))
	if err != nil {
		return err
	}
	for _, ca := range []string{v1beta1constants.SecretNameCACluster, v1beta1constants.SecretNameCAClient, v1beta1constants.SecretNameCAFrontProxy} {
		if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: ca, CommonName: ca, CertType: secretsutils.CACert},
			secretsmanager.Rotate(secretsmanager.KeepOld)); err != nil {
			return fmt.Errorf("gardenlet's %s: %w", ca, err)
		}
	}
	serving, err := sm.Generate(ctx, s.servingConfig(), secretsmanager.SignedByCA(v1beta1constants.SecretNameCACluster))
	if err != nil {
		return fmt.Errorf("gardenlet's %s: %w", extension.SecretNameKubeAPIServerServer, err)
	}
	owner, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: secretNameShootOwner, CommonName: ShootOwnerUser,
		Organization: []string{user.SystemPrivilegedGroup}, CertType: secretsutils.ClientCert}, secretsmanager.SignedByCA(v1beta1constants.SecretNameCAClient))
	if err != nil {
		return fmt.Errorf("the owner's client certificate: %w", err)
	}
	files := map[string][]byte{
		"tls.crt": serving.Data[secretsutils.DataKeyCertificate], "tls.key": serving.Data[secretsutils.DataKeyPrivateKey],
		shootPKIOwnerCert: owner.Data[secretsutils.DataKeyCertificate], shootPKIOwnerKey: owner.Data[secretsutils.DataKeyPrivateKey],
	}
	for file, ca := range map[string]string{"ca.crt": v1beta1constants.SecretNameCACluster, shootPKIClientCA: v1beta1constants.SecretNameCAClient,
		shootPKIFrontProxyCA: v1beta1constants.SecretNameCAFrontProxy} {
		bundle, ok := sm.Get(ca, secretsmanager.Bundle)
		if !ok {
			return fmt.Errorf("gardenlet's %s has no bundle", ca)
		}
		files[file] = bundle.Data[secretsutils.DataKeyCertificateBundle]
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(s.dir, name), data, 0o600); err != nil {
			return err
		}
	}
	if err := serviceAccountKeys(s.dir); err != nil {
		return err
	}
	if s.token, err = adminToken(s.dir); err != nil {
		return err
	}
	// The ingress's SNI listener on the load balancer's address: the user's way in, and the
	// shoot node's kubelet's too.
	s.Kubeconfig = filepath.Join(s.dir, "kubeconfig")
	s.REST, s.kube, s.Client, err = adminKubeconfig(s.Kubeconfig, s.Namespace, net.JoinHostPort(lb.String(), strconv.Itoa(manifest.PortKubeAPIServer)),
		s.Host, filepath.Join(s.dir, "ca.crt"), s.token, 50)
	return err
}

// servingConfig is kube-apiserver's serving certificate as gardenlet configures it: its API
// name (and, once RotateServingCertificate ran, its internal one), its Service's names in the
// seed, and the names and first address of Service kubernetes in the shoot.
func (s *Shoot) servingConfig() *secretsutils.CertificateSecretConfig {
	svc := manifest.KubeAPIServerName + "." + s.Namespace
	names := []string{s.Host, manifest.KubeAPIServerName, svc, svc + ".svc", svc + ".svc.cluster.local",
		"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	if s.servingRotations > 0 {
		names = append(names, fmt.Sprintf("api-%d.%s.%s", s.servingRotations, s.cfg.Name, shootInternalDomain))
	}
	return &secretsutils.CertificateSecretConfig{Name: extension.SecretNameKubeAPIServerServer, CommonName: manifest.KubeAPIServerName,
		DNSNames: names, IPAddresses: []net.IP{net.IP(s.Services.Addr().Next().AsSlice())}, CertType: secretsutils.ServerCert,
		SkipPublishingCACertificate: true}
}

// RotateServingCertificate has gardenlet issue kube-apiserver a new serving certificate (another
// configuration: one more name, so its secrets manager writes a new Secret beside the old, as
// for any change of the certificate's names) and returns it (PEM). kube-apiserver's pods keep
// the one they mounted; a terminating ingress serves the new one once the extension followed.
func (c *Cluster) RotateServingCertificate(ctx context.Context, s *Shoot) ([]byte, error) {
	sm, err := secretsmanager.New(ctx, logr.Discard(), clock.RealClock{}, c.Client, v1beta1constants.SecretManagerIdentityGardenlet, secretsmanager.WithNamespaces(s.Namespace))
	if err != nil {
		return nil, err
	}
	if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{Name: v1beta1constants.SecretNameCACluster,
		CommonName: v1beta1constants.SecretNameCACluster, CertType: secretsutils.CACert}, secretsmanager.Rotate(secretsmanager.KeepOld)); err != nil {
		return nil, err
	}
	s.servingRotations++
	serving, err := sm.Generate(ctx, s.servingConfig(), secretsmanager.SignedByCA(v1beta1constants.SecretNameCACluster))
	if err != nil {
		return nil, fmt.Errorf("gardenlet's %s: %w", extension.SecretNameKubeAPIServerServer, err)
	}
	return serving.Data[secretsutils.DataKeyCertificate], nil
}
