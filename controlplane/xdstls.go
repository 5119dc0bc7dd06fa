package controlplane

import (
	"cmp"
	"context"
	"fmt"
	"time"

	secretsutils "github.com/gardener/gardener/pkg/utils/secrets"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/tendril-net/tendril/internal/pki/tlsreload"
)

// xDS over mutual TLS in Kubernetes mode (docs/design-notes/xds-mtls.md): the leader runs
// Gardener's secrets manager in its own namespace for a CA, the xDS server's certificate (held
// in memory, never mounted) and the ingress's client certificate, which it copies with the CA
// bundle into one Secret of a fixed name that the ingress Pods mount.

// Names in the secrets manager; it appends a hash to each Secret's name. A renewed leaf
// replaces its predecessor at once (IgnoreOldSecrets): only the server (in memory) and the
// client Secret below use them, and both switch in the same sync.
const (
	XDSSecretsIdentity = "tendril-xds"
	XDSSecretCA        = "ca-tendril-xds"
	XDSSecretServer    = "tendril-xds-server"
	XDSSecretClient    = "tendril-xds-client"
)

// Validities. The secrets manager renews a certificate once 80 % of its validity has passed or
// less than 10 days are left, on the first Generate after that (every XDSSecrets.Resync).
const (
	// xdsCAValidity: renewed after 292 days.
	xdsCAValidity = 365 * 24 * time.Hour
	// xdsCertValidity: renewed after 20 days (10 days before the end, before 80 % = 24 days).
	xdsCertValidity = 30 * 24 * time.Hour
	// xdsOldCA is how long a renewed CA's predecessor stays in the bundle: the ingress Pods get
	// the new bundle when the kubelet syncs their Secret volume (a minute or so) and re-read it
	// on their next handshake; until then the server's certificate is signed by the old CA
	// (the secrets manager's default for server certificates) and the client's by the new one.
	xdsOldCA = 24 * time.Hour
	// xdsResync is the default XDSSecrets.Resync.
	xdsResync = time.Hour
)

// XDSSecrets configures the secrets manager's xDS certificates. The zero value works.
type XDSSecrets struct {
	// Namespace holds the secrets manager's Secrets (default: the Pod's or the leader election's).
	Namespace string
	// ServiceName is the xDS Service in Namespace: the server certificate carries its names
	// (default tendril-xds).
	ServiceName string
	// ClientSecret is the Secret the ingress mounts, in ClientNamespace (default
	// tendril-xds-client in the ingress namespace): tls.crt, tls.key and ca.crt (the CA bundle).
	ClientSecret, ClientNamespace string
	// ClientName is the client certificate's common name: the node IDs it may use are the name
	// and the name followed by a dash (server.NodeOfCertificate; default tendril-ingress).
	ClientName string
	// Resync is how often the certificates are checked for renewal (default an hour).
	Resync time.Duration
}

// Client Secret data keys (those of a kubernetes.io/tls Secret, plus the CA bundle).
const (
	DataKeyCert = secretsutils.DataKeyCertificate
	DataKeyKey  = secretsutils.DataKeyPrivateKey
	DataKeyCA   = secretsutils.DataKeyCertificateCA
)

func (x XDSSecrets) withDefaults(namespace, ingressNamespace string) XDSSecrets {
	x.Namespace = cmp.Or(x.Namespace, namespace)
	x.ServiceName = cmp.Or(x.ServiceName, "tendril-xds")
	x.ClientSecret = cmp.Or(x.ClientSecret, XDSSecretClient)
	x.ClientNamespace = cmp.Or(x.ClientNamespace, ingressNamespace, x.Namespace)
	x.ClientName = cmp.Or(x.ClientName, "tendril-ingress")
	x.Resync = cmp.Or(x.Resync, xdsResync)
	return x
}

// xdsCerts generates and renews the xDS certificates and holds the server's material.
type xdsCerts struct {
	cfg    XDSSecrets
	client client.Client
	clock  clock.Clock
	log    logr.Logger
	store  tlsreload.Store
}

// sync makes sure the certificates exist and are current, publishes the client's Secret and
// the server's material, and deletes what the secrets manager no longer uses.
func (x *xdsCerts) sync(ctx context.Context) error {
	sm, err := secretsmanager.New(ctx, x.log, x.clock, x.client, XDSSecretsIdentity,
		secretsmanager.WithNamespaces(x.cfg.Namespace), secretsmanager.WithCASecretAutoRotation())
	if err != nil {
		return fmt.Errorf("secrets manager: %w", err)
	}
	caValidity, certValidity := xdsCAValidity, xdsCertValidity
	if _, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{
		Name: XDSSecretCA, CommonName: XDSSecretCA, CertType: secretsutils.CACert, Validity: &caValidity,
	}, secretsmanager.Rotate(secretsmanager.KeepOld), secretsmanager.IgnoreOldSecretsAfter(xdsOldCA)); err != nil {
		return fmt.Errorf("xDS CA: %w", err)
	}
	svc, ns := x.cfg.ServiceName, x.cfg.Namespace
	srv, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{
		Name: XDSSecretServer, CommonName: svc, CertType: secretsutils.ServerCert, Validity: &certValidity,
		DNSNames:                    []string{svc, svc + "." + ns, svc + "." + ns + ".svc", svc + "." + ns + ".svc.cluster.local"},
		SkipPublishingCACertificate: true,
	}, secretsmanager.SignedByCA(XDSSecretCA), secretsmanager.IgnoreOldSecrets())
	if err != nil {
		return fmt.Errorf("xDS server certificate: %w", err)
	}
	cli, err := sm.Generate(ctx, &secretsutils.CertificateSecretConfig{
		Name: XDSSecretClient, CommonName: x.cfg.ClientName, CertType: secretsutils.ClientCert, Validity: &certValidity,
		SkipPublishingCACertificate: true,
	}, secretsmanager.SignedByCA(XDSSecretCA), secretsmanager.IgnoreOldSecrets())
	if err != nil {
		return fmt.Errorf("xDS client certificate: %w", err)
	}
	bundleSecret, ok := sm.Get(XDSSecretCA)
	if !ok {
		return fmt.Errorf("xDS CA bundle %s not generated", XDSSecretCA)
	}
	bundle := bundleSecret.Data[secretsutils.DataKeyCertificateBundle]
	if len(bundle) == 0 { // no bundle Secret: the CA's own
		bundle = bundleSecret.Data[secretsutils.DataKeyCertificateCA]
	}
	m, err := tlsreload.Parse(srv.Data[DataKeyCert], srv.Data[DataKeyKey], bundle)
	if err != nil {
		return fmt.Errorf("xDS server certificate %s: %w", srv.Name, err)
	}
	if _, err := tlsreload.Parse(cli.Data[DataKeyCert], cli.Data[DataKeyKey], bundle); err != nil {
		return fmt.Errorf("xDS client certificate %s: %w", cli.Name, err)
	}
	// The ingress's Secret first: the server then never trusts a CA the client cannot know of
	// for longer than the kubelet takes to sync the volume.
	pub := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: x.cfg.ClientSecret, Namespace: x.cfg.ClientNamespace}}
	res, err := controllerutil.CreateOrUpdate(ctx, x.client, pub, func() error {
		pub.Labels = map[string]string{"app.kubernetes.io/managed-by": "tendril-seed"}
		pub.Type = corev1.SecretTypeTLS
		pub.Data = map[string][]byte{DataKeyCert: cli.Data[DataKeyCert], DataKeyKey: cli.Data[DataKeyKey], DataKeyCA: bundle}
		return nil
	})
	if err != nil {
		return fmt.Errorf("xDS client Secret %s/%s: %w", pub.Namespace, pub.Name, err)
	}
	if prev, _ := x.store.Material(); prev == nil || !prev.Cert.Leaf.Equal(m.Cert.Leaf) {
		x.log.Info("xDS certificates", "server", srv.Name, "client", cli.Name, "clientSecret", res, "serverNotAfter", m.Cert.Leaf.NotAfter)
	}
	x.store.Set(m)
	if err := sm.Cleanup(ctx); err != nil {
		return fmt.Errorf("xDS secrets cleanup: %w", err)
	}
	return nil
}

// syncRetrying syncs until it succeeds or ctx ends. A failed sync is retried after a second,
// growing to Resync; the material last set stays served meanwhile.
func (x *xdsCerts) syncRetrying(ctx context.Context) error {
	wait := time.Second
	for {
		err := x.sync(ctx)
		if err == nil {
			return nil
		}
		x.log.Error(err, "Generating the xDS certificates failed, retrying", "after", wait.String())
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, x.cfg.Resync)
	}
}

// renew syncs every Resync until ctx ends.
func (x *xdsCerts) renew(ctx context.Context) {
	t := time.NewTicker(x.cfg.Resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := x.syncRetrying(ctx); err != nil {
			return
		}
	}
}
