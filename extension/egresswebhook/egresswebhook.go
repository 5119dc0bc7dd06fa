// Package egresswebhook is tendril's control-plane webhook: it mutates the kube-apiserver
// Deployment of every shoot that uses tendril so that kube-apiserver's EgressSelector sends
// `cluster` traffic (logs, exec, port-forward, webhooks, proxy) to tendril-server instead of
// Gardener's VPN.
//
// # What it changes
//
// On CREATE and UPDATE of Deployment kube-apiserver in a shoot namespace labelled
// extensions.gardener.cloud/tendril=true (gardenlet's label for shoots with the Extension
// type; Gardener's BuildExtensionTypeNamespaceSelector), carrying gardenlet's object label
// provider.extensions.gardener.cloud/mutated-by-controlplane-webhook=true, and only while the
// namespace's Extension of type tendril exists and is not being deleted:
//   - --egress-selector-config-file gets /etc/kubernetes/tendril/egress/… : Gardener's value
//     (its VPN configuration) is replaced in place, a second occurrence removed, a missing
//     flag added; kube-apiserver never sees two;
//   - volumes tendril-egress-selector (ConfigMap tendril-egress-selector),
//     tendril-egress-client (the secrets manager's tendril-kube-apiserver-client: tls.crt,
//     tls.key) and tendril-egress-ca (ca-tendril-bundle: bundle.crt);
//   - with the providerConfig's kubeAPIServer.goAwayChance, or else the seed's default
//     (Options.GoAwayChance) for a shoot balanced per connection, exactly one --goaway-chance of
//     that value (without either, or with "0", the flag stays as Gardener set it, which is
//     none): replicas behind SNI passthrough then make HTTP/2 clients reconnect now and then,
//     and so rebalance them;
//   - a checksum annotation of the configuration and the pod label
//     networking.resources.gardener.cloud/to-tendril-server-tcp-<port>=allowed, so Gardener's
//     NetworkPolicies let the pod reach tendril-server's egress port.
//
// The providerConfig's egress mode decides the rest:
//   - httpConnect (default): `cluster` → HTTPConnect over TCP to
//     https://tendril-server.<ns>.svc:9443 with client certificate and CA bundle, which
//     kube-apiserver mounts read-only; port 9443.
//   - grpc: kube-apiserver's gRPC egress dials only a Unix socket (k8s.io/apiserver
//     egressselector: "UDS transport must be specified for GRPC"), so `cluster` → GRPC over UDS
//     /var/run/tendril-egress/tendril-server.sock, and the webhook adds the native sidecar
//     tendril-egress-relay (an init container with restartPolicy Always, from the tendril
//     image, Options.Image), which listens on that socket in the emptyDir
//     tendril-egress-socket shared with kube-apiserver and carries each connection as a stream
//     of one connection to tendril-server.<ns>.svc:8090 over mutual TLS with the client
//     certificate and CA bundle, now mounted by the relay only; port 8090. Without an image
//     such Deployments are refused.
//   - httpConnectRelay: as grpc, but `cluster` → HTTPConnect over UDS
//     /var/run/tendril-egress/tendril-server-connect.sock, the relay's CONNECT socket (it
//     serves that one only); each CONNECT is a stream of the relay's connection to
//     tendril-server, no TLS handshake per dial.
//
// Whatever another mode added is removed, so a shoot can switch. `controlplane` and `etcd`
// stay Direct. Every other flag (--advertise-address, --endpoint-reconciler-type, …), volume and
// container stays as Gardener set it, and applying the result again changes nothing. When the
// Extension is being deleted the Deployment passes unchanged, so gardenlet's next apply
// restores its own VPN configuration.
//
// The configuration depends only on the namespace and the mode; the webhook creates or corrects
// the ConfigMap itself before it admits the Deployment (skipped for dry-run requests), so it
// exists whenever a pod could mount it. [ConfigMap] builds the same object for the actuator.
// Secret names carry the secrets manager's hashes; the webhook finds the current ones by the
// manager's labels and refuses the Deployment while they do not exist yet (gardenlet retries).
//
// # Serving
//
// [AddToManager] registers the webhook with the manager's webhook server and uses Gardener's
// extensions webhook library for the rest: the MutatingWebhookConfiguration
// gardener-extension-tendril (failurePolicy Fail) and, with a namespace, a CA and server
// certificate generated and rotated by the secrets manager in that namespace, injected into
// the configuration and written to the server's CertDir on every replica.
package egresswebhook

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	extensionswebhook "github.com/gardener/gardener/extensions/pkg/webhook"
	"github.com/gardener/gardener/extensions/pkg/webhook/certificates"
	extensionscontextwebhook "github.com/gardener/gardener/extensions/pkg/webhook/context"
	"github.com/gardener/gardener/extensions/pkg/webhook/controlplane"
	"github.com/gardener/gardener/extensions/pkg/webhook/controlplane/genericmutator"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
)

// These must match extension/secrets.go and extension.Type (this package cannot import
// extension: the actuator may import it). The package's tests check that they do.
const (
	ExtensionType          = "tendril"
	SecretsManagerIdentity = "extension-tendril"
	SecretNameClient       = "tendril-kube-apiserver-client"
	SecretNameCABundle     = "ca-tendril-bundle"
)

// Name is the webhook's name and the base of its MutatingWebhookConfiguration
// (gardener-extension-tendril), its Service and its certificates.
const Name = "tendril"

// Path is where the webhook server serves the webhook.
const Path = "/tendril-egress"

// Defaults of the webhook server (Gardener's extensions use the same).
const (
	DefaultPort    = 10250
	DefaultCertDir = "/tmp/tendril-webhook-certs"
)

// Webhook client-config modes (Gardener's extensions webhook library).
const (
	// ModeService: the API server calls Service gardener-extension-tendril in Namespace.
	ModeService = extensionswebhook.ModeService
	// ModeURL: the API server calls https://URL/… (tendril-seed outside the cluster, tests).
	ModeURL = extensionswebhook.ModeURL
)

// ObjectSelector is gardenlet's label on objects a control-plane webhook may mutate.
var ObjectSelector = &metav1.LabelSelector{MatchLabels: map[string]string{
	v1beta1constants.LabelExtensionProviderMutatedByControlplaneWebhook: "true",
}}

// NamespaceSelector selects shoot namespaces with the tendril Extension.
var NamespaceSelector = extensionswebhook.BuildExtensionTypeNamespaceSelector(ExtensionType, nil)

// ServerOptions are the webhook server's options for manager.Options.WebhookServer:
// webhook.NewServer(egresswebhook.ServerOptions(0, "")). Zero values are the defaults.
func ServerOptions(port int, certDir string) webhook.Options {
	port = cmp.Or(port, DefaultPort)
	certDir = cmp.Or(certDir, DefaultCertDir)
	return webhook.Options{Port: port, CertDir: certDir}
}

// Options configure AddToManager.
type Options struct {
	// Namespace is tendril-seed's own namespace: the webhook CA and server certificate live
	// there (secrets manager, rotated), the Service of ModeService too, and the
	// MutatingWebhookConfiguration is owned by it. Empty: a one-off self-signed certificate
	// (10 years, no rotation) written to the server's CertDir, for development only.
	Namespace string
	// Mode is ModeService (default) or ModeURL.
	Mode string
	// URL is host:port the API server dials in ModeURL (an IP gets an IP SAN).
	URL string
	// ServicePort is the Service's port in ModeService (0: the webhook server's port).
	ServicePort int
	// Image is the tendril image (the one tendril-server runs); the egress relay sidecar of
	// shoots with egress grpc runs /tendril-egress-relay from it. Empty: such shoots'
	// kube-apiserver Deployments are refused with the reason (HTTP CONNECT needs no image).
	Image string
	// GoAwayChance is the seed's default --goaway-chance (above 0, at most 0.02): every
	// kube-apiserver of a shoot balanced per connection whose providerConfig sets no chance gets
	// it ("0" there opts out). Empty: none.
	GoAwayChance string
	// Webhooks are tendril's other seed webhooks (e.g. ingressdns's): served by the same
	// server and registered in the same MutatingWebhookConfiguration with the same
	// certificates, which one registration owns (two would overwrite each other's).
	Webhooks []*extensionswebhook.Webhook
}

// AddToManager registers the webhook with mgr's webhook server (which must be a
// *webhook.DefaultServer, see ServerOptions) and sets up its registration and certificates,
// as Gardener's extensions webhook library does for provider extensions (webhook/cmd's
// AddToManager, which this follows without its flag plumbing): the MutatingWebhookConfiguration
// is written once the replica leads; with a Namespace the certificates are reconciled by the
// leader and reloaded into CertDir on every replica.
func AddToManager(ctx context.Context, mgr manager.Manager, opts Options) error {
	opts.Mode = cmp.Or(opts.Mode, ModeService)
	if opts.Mode != ModeService && opts.Mode != ModeURL {
		return fmt.Errorf("egress webhook: mode %q: want %q or %q", opts.Mode, ModeService, ModeURL)
	}
	if opts.Mode == ModeURL && opts.URL == "" {
		return errors.New("egress webhook: mode url needs a URL")
	}
	if opts.GoAwayChance != "" && !tendrilv1alpha1.ValidGoAwayChance(opts.GoAwayChance) {
		return fmt.Errorf("egress webhook: goaway chance %q: want a decimal above 0 and at most %g", opts.GoAwayChance, tendrilv1alpha1.MaxGoAwayChance)
	}
	srv, ok := mgr.GetWebhookServer().(*webhook.DefaultServer)
	if !ok {
		return fmt.Errorf("egress webhook: want a *webhook.DefaultServer, got %T", mgr.GetWebhookServer())
	}
	wh, err := New(mgr, opts.Image, opts.GoAwayChance)
	if err != nil {
		return fmt.Errorf("egress webhook: %w", err)
	}
	webhooks := append([]*extensionswebhook.Webhook{wh}, opts.Webhooks...)
	for _, w := range webhooks {
		srv.Register(w.Path, w.Webhook)
	}
	port := srv.Options.Port
	if opts.Mode == ModeService && opts.ServicePort > 0 {
		port = opts.ServicePort
	}
	seed, _, err := extensionswebhook.BuildWebhookConfigs(webhooks, mgr.GetClient(),
		opts.Namespace, Name, false, port, opts.Mode, opts.URL, nil, false)
	if err != nil {
		return fmt.Errorf("egress webhook configuration: %w", err)
	}
	if opts.Namespace == "" {
		mgr.GetLogger().Info("Egress webhook with an unmanaged certificate (no rotation): development only; set a namespace in production")
		ca, err := certificates.GenerateUnmanagedCertificates(Name, false, srv.Options.CertDir, opts.Mode, opts.URL)
		if err != nil {
			return fmt.Errorf("egress webhook certificate: %w", err)
		}
		return mgr.Add(registration{client: mgr.GetClient(), configs: seed, caBundle: ca})
	}
	// Without a CA bundle: the certificate reconciler injects it (and keeps it on rotation).
	if err := mgr.Add(registration{client: mgr.GetClient(), configs: seed, owner: opts.Namespace}); err != nil {
		return err
	}
	if err := certificates.AddCertificateManagementToManager(ctx, mgr, nil, clock.RealClock{}, seed, nil, nil, nil, "",
		Name, false, opts.Namespace, opts.Mode, opts.URL); err != nil {
		return fmt.Errorf("egress webhook certificates: %w", err)
	}
	return nil
}

// registration writes the webhook configuration once, when the replica leads.
type registration struct {
	client   client.Client
	configs  extensionswebhook.Configs
	owner    string // namespace owning the configuration; empty: none
	caBundle []byte // nil: keep the one in the cluster
}

func (r registration) NeedLeaderElection() bool { return true }

func (r registration) Start(ctx context.Context) error {
	for _, shared := range r.configs.GetWebhookConfigs() {
		// A copy: the certificate reconciler reads (and logs) the same object concurrently,
		// while the Get below overwrites it in place.
		cfg := shared.DeepCopyObject().(client.Object)
		// The API server may still be settling (owner namespace, REST mapping): retry a while.
		err := wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
			if err := extensionswebhook.ReconcileSeedWebhookConfig(ctx, r.client, cfg, r.owner, r.caBundle); err != nil {
				log.FromContext(ctx).Info("Registering the egress webhook failed, retrying", "error", err.Error())
				return false, nil
			}
			return true, nil
		})
		if err != nil {
			return fmt.Errorf("register egress webhook %s: %w", cfg.GetName(), err)
		}
	}
	return nil
}

// New builds the webhook (Gardener's control-plane webhook with tendril's selectors).
// relayImage is the tendril image the egress relay sidecar runs (Options.Image), goAwayChance
// the seed's default --goaway-chance (Options.GoAwayChance).
func New(mgr manager.Manager, relayImage, goAwayChance string) (*extensionswebhook.Webhook, error) {
	log := mgr.GetLogger().WithName("egress-webhook")
	e := &ensurer{client: mgr.GetClient(), reader: mgr.GetAPIReader(), log: log, relayImage: relayImage, goAwayChance: goAwayChance}
	wh, err := controlplane.New(mgr, controlplane.Args{
		Kind:           controlplane.KindShoot,
		Provider:       ExtensionType,
		Types:          []extensionswebhook.Type{{Obj: &appsv1.Deployment{}}},
		Mutator:        genericmutator.NewMutator(mgr, e, nil, nil, nil, log),
		ObjectSelector: ObjectSelector,
	})
	if err != nil {
		return nil, err
	}
	// controlplane.New selects on shoot.gardener.cloud/provider (the cloud provider); tendril
	// is an Extension type, so select on gardenlet's extensions.gardener.cloud/tendril label.
	wh.Name, wh.Path = Name+"-egress", Path
	wh.NamespaceSelector = NamespaceSelector
	wh.Webhook.Handler = withRequest{wh.Webhook.Handler}
	return wh, nil
}

// withRequest puts the admission request into the context, so the ensurer can tell a dry run.
type withRequest struct{ admission.Handler }

func (h withRequest) Handle(ctx context.Context, req admission.Request) admission.Response {
	return h.Handler.Handle(admission.NewContextWithRequest(ctx, req), req)
}

// ensurer implements the kube-apiserver part of Gardener's control-plane Ensurer.
type ensurer struct {
	genericmutator.NoopEnsurer
	client client.Client
	// reader reads uncached: an Extension or Secret created a moment ago must count.
	reader client.Reader
	log    logr.Logger
	// relayImage is the tendril image of the egress relay sidecar (egress: grpc).
	relayImage string
	// goAwayChance is the seed's default --goaway-chance ("": none).
	goAwayChance string
}

var _ genericmutator.Ensurer = (*ensurer)(nil)

func (e *ensurer) EnsureKubeAPIServerDeployment(ctx context.Context, _ extensionscontextwebhook.GardenContext, dep, _ *appsv1.Deployment) error {
	ns := dep.Namespace
	ext, err := e.extension(ctx, ns)
	if err != nil {
		return err
	}
	if ext == nil || ext.DeletionTimestamp != nil {
		return nil // not (or no longer) using tendril: Gardener's egress stays
	}
	var raw []byte
	if ext.Spec.ProviderConfig != nil {
		raw = ext.Spec.ProviderConfig.Raw
	}
	pc, errs := tendrilv1alpha1.DecodeProviderConfig(raw)
	if len(errs) > 0 {
		return fmt.Errorf("extension %s/%s: %w", ns, ext.Name, errs.ToAggregate())
	}
	// The Cluster says whether the control plane is HA, and so how many servers the actuator
	// runs and the default mode; a namespace without one (no gardenlet) has one server.
	servers := 1
	switch cluster, err := extensionscontroller.GetCluster(ctx, e.reader, ns); {
	case err == nil:
		servers = manifest.ServerCount(cluster.Shoot)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("cluster %s: %w", ns, err)
	}
	mode := pc.EgressFor(servers > 1)
	if mode.Relayed() && e.relayImage == "" {
		// Refused (gardenlet retries) rather than left to Gardener's VPN, which the shoot's
		// owner switched away from.
		return fmt.Errorf("extension %s/%s asks for egress %s, which needs the %s sidecar, but the webhook has no tendril image (tendril-seed --image)",
			ns, ext.Name, mode, ContainerNameRelay)
	}
	var s Secrets
	if s.Client, err = e.currentSecret(ctx, ns, SecretNameClient); err != nil {
		return err
	}
	if s.CABundle, err = e.currentSecret(ctx, ns, SecretNameCABundle); err != nil {
		return err
	}
	cm, err := ConfigMap(ns, mode)
	if err != nil {
		return err
	}
	if err := e.ensureConfigMap(ctx, cm); err != nil {
		return err
	}
	return MutateDeployment(dep, Mutation{Egress: mode, Secrets: s, Config: cm.Data[ConfigMapDataKey], RelayImage: e.relayImage, Servers: servers,
		GoAwayChance: pc.GoAwayChanceWith(e.goAwayChance)})
}

// extension returns the namespace's Extension of type tendril, or nil.
func (e *ensurer) extension(ctx context.Context, ns string) (*extensionsv1alpha1.Extension, error) {
	var list extensionsv1alpha1.ExtensionList
	if err := e.reader.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return nil, fmt.Errorf("list extensions in %s: %w", ns, err)
	}
	for i := range list.Items {
		if list.Items[i].Spec.Type == ExtensionType {
			return &list.Items[i], nil
		}
	}
	return nil, nil
}

// currentSecret is the newest secrets-manager Secret with config name name (during a
// rotation the old and the new one exist for a moment; the reconcile's cleanup drops the old).
func (e *ensurer) currentSecret(ctx context.Context, ns, name string) (string, error) {
	var list corev1.SecretList
	if err := e.reader.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{
		secretsmanager.LabelKeyName:            name,
		secretsmanager.LabelKeyManagedBy:       secretsmanager.LabelValueSecretsManager,
		secretsmanager.LabelKeyManagerIdentity: SecretsManagerIdentity,
	}); err != nil {
		return "", fmt.Errorf("list secrets %s in %s: %w", name, ns, err)
	}
	if len(list.Items) == 0 {
		return "", fmt.Errorf("secret %s of %s not generated yet in %s (the tendril Extension has not been reconciled)", name, SecretsManagerIdentity, ns)
	}
	newest := slices.MaxFunc(list.Items, func(a, b corev1.Secret) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name) // same second: any stable choice
	})
	return newest.Name, nil
}

// ensureConfigMap creates cm or corrects its data; a dry-run request writes nothing.
func (e *ensurer) ensureConfigMap(ctx context.Context, cm *corev1.ConfigMap) error {
	if req, err := admission.RequestFromContext(ctx); err == nil && req.DryRun != nil && *req.DryRun {
		return nil
	}
	var cur corev1.ConfigMap
	err := e.reader.Get(ctx, client.ObjectKeyFromObject(cm), &cur)
	switch {
	case apierrors.IsNotFound(err):
		if err := e.client.Create(ctx, cm); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create configmap %s/%s: %w", cm.Namespace, cm.Name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("read configmap %s/%s: %w", cm.Namespace, cm.Name, err)
	case cur.Data[ConfigMapDataKey] == cm.Data[ConfigMapDataKey]:
		return nil
	}
	patch := client.MergeFrom(cur.DeepCopy())
	cur.Data = cm.Data
	if err := e.client.Patch(ctx, &cur, patch); err != nil {
		return fmt.Errorf("update configmap %s/%s: %w", cm.Namespace, cm.Name, err)
	}
	return nil
}
