// Package extension is tendril's Gardener extension controller for Extension resources of
// type "tendril": per shoot it generates the CA, certificates and WireGuard keys (secrets
// manager, persisted), deploys tendril-server in the shoot namespace, delivers the shoot-side
// agents in a ManagedResource, and writes the Route the xDS control plane programs the
// ingress from. It implements Gardener's generic Extension actuator; the generic reconciler
// owns finalizers, operation annotations and lastOperation. It does not program the ingress
// itself (xds/kubesource does, from the Route) and touches no object of Gardener's own.
package extension

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	genericextension "github.com/gardener/gardener/extensions/pkg/controller/extension"
	extensionssecretsmanager "github.com/gardener/gardener/extensions/pkg/util/secret/manager"
	v1beta1helper "github.com/gardener/gardener/pkg/api/core/v1beta1/helper"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	secretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	jsonserializer "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension/manifest"
)

// Type is the Extension type this controller serves.
const Type = "tendril"

// managedResourceOrigin marks tendril's ManagedResources; never "gardener" (that label value
// belongs to gardenlet's own).
const managedResourceOrigin = "tendril"

// Default inner tunnel addresses: Gardener's VPN range fd8f:6d53:b97a:1::/96 for IPv6 and
// RFC 2544's benchmarking range 198.18.0.0/15 (unlikely in a shoot) as the IPv4 source.
var (
	defaultServerAddresses = []netip.Addr{netip.MustParseAddr("fd8f:6d53:b97a:1::1"), netip.MustParseAddr("198.18.0.1")}
	defaultAgentAddress    = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
)

// Config is the actuator's configuration; a zero value needs only Image and Ingress.
type Config struct {
	// Image is the tendril image with every binary.
	Image string
	// Ingress is the seed ingress's address (host name or IP) the shoot agents dial.
	Ingress string
	// IngressNamespace is where the seed ingress runs: tendril-server's Service admits its pods
	// (GRM's cross-namespace policies, by the ingress pods' to-… label).
	IngressNamespace string
	// Clock is used by the secrets manager; nil means the real clock.
	Clock clock.Clock
}

// State is the non-secret state kept in the Extension's status.state, which gardenlet
// persists in the ShootState and hands back on restore. Keys stay in persisted Secrets.
type State struct {
	ServerAddresses []netip.Addr `json:"serverAddresses"`
	// AgentAddress is the first agent's address, the only one before agents became several;
	// an older extension restoring this state still finds it.
	AgentAddress netip.Addr `json:"agentAddress"`
	// AgentAddresses is every agent address ever given to this shoot, in agent order: n
	// agents use the first n, so a shoot that goes from two agents to one and back (or moves
	// to another seed) gives each agent the address it had.
	AgentAddresses []netip.Addr `json:"agentAddresses,omitempty"`
}

// deleteWait bounds how long one Delete waits for the shoot's objects to go.
const deleteWait = 20 * time.Second

type actuator struct {
	client client.Client
	reader client.Reader
	scheme *runtime.Scheme
	cfg    Config
}

// NewActuator returns the Extension actuator. reader should be an uncached reader (the API
// reader) for objects the manager's cache does not watch.
func NewActuator(c client.Client, reader client.Reader, scheme *runtime.Scheme, cfg Config) genericextension.Actuator {
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &actuator{client: c, reader: reader, scheme: scheme, cfg: cfg}
}

// configurationProblem marks err so the generic reconciler reports ERR_CONFIGURATION_PROBLEM.
func configurationProblem(err error) error {
	return v1beta1helper.NewErrorWithCodes(err, gardencorev1beta1.ErrorConfigurationProblem)
}

func (a *actuator) Reconcile(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension) error {
	var raw []byte
	if ext.Spec.ProviderConfig != nil {
		raw = ext.Spec.ProviderConfig.Raw
	}
	pc, errs := tendrilv1alpha1.DecodeProviderConfig(raw)
	if len(errs) > 0 {
		return configurationProblem(errs.ToAggregate())
	}
	cluster, err := extensionscontroller.GetCluster(ctx, a.client, ext.Namespace)
	if err != nil {
		return fmt.Errorf("read cluster: %w", err)
	}
	if note := istioTerminationNote(cluster); note != "" {
		log.Info(note)
	}
	v, st, sm, err := a.values(ctx, log, ext, cluster, pc)
	if err != nil {
		return err
	}
	if err := v.Validate(); err != nil {
		return configurationProblem(fmt.Errorf("shoot %s: %w", ext.Namespace, err))
	}
	for _, obj := range manifest.SeedObjects(v) {
		if err := a.apply(ctx, obj); err != nil {
			return err
		}
	}
	// The other shape's objects, after the control plane changed between one server and
	// several: the new workload is applied first, so the shoot keeps a server meanwhile.
	for _, obj := range manifest.StaleSeedObjects(v) {
		if err := a.client.Delete(ctx, obj); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("delete %T %s: %w", obj, client.ObjectKeyFromObject(obj), err)
		}
	}
	if err := a.deleteLegacyServerPolicy(ctx, v.Namespace); err != nil {
		return err
	}
	if err := a.deployShoot(ctx, v); err != nil {
		return err
	}
	if v.Hibernated {
		// Hibernated: no kube-apiserver to route to; the route comes back on wake-up.
		if err := client.IgnoreNotFound(a.client.Delete(ctx, manifest.Route(v))); err != nil {
			return fmt.Errorf("withdraw route: %w", err)
		}
	} else {
		// The termination Secret before the Route that names it; without per-request
		// balancing, the Route first and then its Secret goes.
		if v.PerRequest {
			ts, err := terminationSecret(ctx, a.client, sm, v.Namespace)
			if err != nil {
				return fmt.Errorf("termination secret: %w", err)
			}
			if err := a.apply(ctx, ts); err != nil {
				return err
			}
		}
		if err := a.apply(ctx, manifest.Route(v)); err != nil {
			return err
		}
		if !v.PerRequest {
			if err := a.deleteTerminationSecret(ctx, v.Namespace); err != nil {
				return err
			}
		}
	}
	if err := sm.Cleanup(ctx); err != nil {
		return fmt.Errorf("clean up old secrets: %w", err)
	}
	return a.saveState(ctx, ext, st)
}

// DisableIstioTLSTermination is the Shoot annotation that keeps a shoot's kube-apiserver traffic
// passthrough at Gardener's gateway (Gardener's IstioTLSTermination, on by default since
// v1.144, terminates TLS there). A tendril shoot carries it: then Gardener's apiserver-proxy
// names the kube-apiserver, which tendril routes itself, instead of the gateway's socket
// (docs/design-notes/gardener-coexistence.md).
const DisableIstioTLSTermination = "shoot.gardener.cloud/disable-istio-tls-termination"

// istioTerminationNote says, for a shoot whose kube-apiserver TLS Gardener's gateway would
// terminate, what that means through tendril; "" for a shoot that carries
// DisableIstioTLSTermination. The decision is Gardener's own helper's, on the Cluster's Shoot.
func istioTerminationNote(cluster *extensionscontroller.Cluster) string {
	if cluster == nil || cluster.Shoot == nil || !v1beta1helper.IsShootIstioTLSTerminationEnabled(cluster.Shoot) {
		return ""
	}
	return "Gardener's gateway terminates TLS for this shoot (IstioTLSTermination): through tendril's ingress its API traffic stays passthrough, " +
		"balanced per connection, and its apiserver-proxy's kube-apiserver-socket CONNECTs are relayed to Gardener's gateway; annotate the Shoot " +
		DisableIstioTLSTermination + "=true for tendril to route all of it"
}

// values gathers everything the builders need, generating secrets on the way.
// agentCount is how many tunnel agents the shoot runs: what the providerConfig says, else
// MaxAgents for a highly available control plane (any failure tolerance), else one.
func agentCount(cluster *extensionscontroller.Cluster, pc *tendrilv1alpha1.ProviderConfig) int {
	def := 1
	if cluster.Shoot != nil && v1beta1helper.IsHAControlPlaneConfigured(cluster.Shoot) {
		def = tendrilv1alpha1.MaxAgents
	}
	return pc.AgentsOr(def)
}

// values gathers everything the builders need, generating secrets on the way; the state it
// returns is what status.state must hold afterwards.
func (a *actuator) values(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension, cluster *extensionscontroller.Cluster, pc *tendrilv1alpha1.ProviderConfig) (manifest.Values, State, secretsmanager.Interface, error) {
	cidrs, err := shootCIDRs(cluster)
	if err != nil {
		return manifest.Values{}, State{}, nil, configurationProblem(err)
	}
	n := agentCount(cluster, pc)
	st, err := loadState(ext, n)
	if err != nil {
		return manifest.Values{}, State{}, nil, err
	}
	adv, err := advertisedAddress(ctx, a.reader, ext.Namespace)
	if err != nil {
		return manifest.Values{}, State{}, nil, err
	}
	sm, err := extensionssecretsmanager.SecretsManagerForCluster(ctx, log.WithName("secretsmanager"), a.cfg.Clock, a.client, cluster, SecretsManagerIdentity, caConfigs())
	if err != nil {
		return manifest.Values{}, State{}, nil, fmt.Errorf("secrets manager: %w", err)
	}
	secrets := map[string]map[string][]byte{}
	names := map[string]string{}
	generate := func(cfgs []extensionssecretsmanager.SecretConfigWithOptions) error {
		for _, sc := range cfgs {
			s, err := sm.Generate(ctx, sc.Config, sc.Options...)
			if err != nil {
				return fmt.Errorf("generate secret %s: %w", sc.Config.GetName(), err)
			}
			secrets[sc.Config.GetName()], names[sc.Config.GetName()] = s.Data, s.Name
		}
		return nil
	}
	if err := generate(caConfigs()); err != nil {
		return manifest.Values{}, State{}, nil, err
	}
	// The certificates are signed by the current CA (the CA config's Secret).
	leaves, err := leafConfigs(ext.Namespace, n, secrets[SecretNameCA])
	if err != nil {
		return manifest.Values{}, State{}, nil, err
	}
	if err := generate(leaves); err != nil {
		return manifest.Values{}, State{}, nil, err
	}
	caBundle, ok := sm.Get(SecretNameCA, secretsmanager.Bundle)
	if !ok {
		return manifest.Values{}, State{}, nil, errors.New("CA bundle secret not found in the secrets manager")
	}
	server := secrets[SecretNameServerWireGuard]
	servers := manifest.ServerCount(cluster.Shoot)
	agents := make([]manifest.Agent, n)
	for i := range agents {
		key := secrets[AgentWireGuardSecretName(i)]
		agents[i] = manifest.Agent{Address: st.AgentAddresses[i], PublicKey: string(key[DataKeyPublicKey]), PrivateKey: string(key[DataKeyPrivateKey])}
	}
	v := manifest.Values{
		Namespace:         ext.Namespace,
		Image:             a.cfg.Image,
		Hibernated:        extensionscontroller.IsHibernated(cluster),
		ShootCIDRs:        cidrs,
		Hostnames:         hostnames(cluster),
		AdvertisedAddress: adv,
		Ingress:           a.cfg.Ingress,
		APIServerProxy:    pc.APIServerProxyEnabled(),
		Egress:            pc.EgressFor(servers > 1),
		KernelTunnel:      pc.TunnelStackOrDefault() == tendrilv1alpha1.TunnelStackKernel,
		Tunnel: manifest.Tunnel{
			ServerAddresses: st.ServerAddresses,
			ServerPublicKey: string(server[DataKeyPublicKey]),
			Agents:          agents,
			Servers:         servers,
		},
		Secrets: manifest.SecretNames{
			ServerTLS:       names[SecretNameServerTLS],
			ClientCA:        caBundle.Name,
			ServerWireGuard: names[SecretNameServerWireGuard],
		},
		IngressNamespace: a.cfg.IngressNamespace,
		PerRequest:       pc.PerRequest(),
	}
	return v, st, sm, nil
}

// deleteTerminationSecret deletes the Route's termination Secret, if there is one.
func (a *actuator) deleteTerminationSecret(ctx context.Context, ns string) error {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: manifest.TerminationSecretName, Namespace: ns}}
	if err := a.client.Delete(ctx, s); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete the termination Secret: %w", err)
	}
	return nil
}

func (a *actuator) deployShoot(ctx context.Context, v manifest.Values) error {
	codec := serializer.NewCodecFactory(a.scheme)
	ser := jsonserializer.NewSerializerWithOptions(jsonserializer.DefaultMetaFactory, a.scheme, a.scheme, jsonserializer.SerializerOptions{Yaml: true})
	data, err := managedresources.NewRegistry(a.scheme, codec, ser).AddAllAndSerialize(manifest.ShootObjects(v)...)
	if err != nil {
		return fmt.Errorf("serialize shoot objects: %w", err)
	}
	if err := managedresources.CreateForShoot(ctx, a.client, v.Namespace, manifest.ManagedResourceName, managedResourceOrigin, false, data); err != nil {
		return fmt.Errorf("managed resource: %w", err)
	}
	return nil
}

// loadState reads status.state and gives it at least n agent addresses: an agent without a
// recorded address gets the lowest one after defaultAgentAddress that no agent and no server
// address holds.
func loadState(ext *extensionsv1alpha1.Extension, n int) (State, error) {
	st := State{ServerAddresses: defaultServerAddresses}
	if ext.Status.State != nil && len(ext.Status.State.Raw) > 0 {
		var saved State
		if err := json.Unmarshal(ext.Status.State.Raw, &saved); err != nil {
			return State{}, fmt.Errorf("decode status.state: %w", err)
		}
		if len(saved.ServerAddresses) > 0 {
			st.ServerAddresses = saved.ServerAddresses
		}
		st.AgentAddresses = saved.AgentAddresses
		// State written before agents became several holds the one agent's address only.
		if len(st.AgentAddresses) == 0 && saved.AgentAddress.IsValid() {
			st.AgentAddresses = []netip.Addr{saved.AgentAddress}
		}
	}
	taken := func(a netip.Addr) bool {
		return slices.Contains(st.AgentAddresses, a) || slices.Contains(st.ServerAddresses, a)
	}
	next := defaultAgentAddress
	for len(st.AgentAddresses) < n {
		for taken(next) {
			next = next.Next()
		}
		st.AgentAddresses = append(st.AgentAddresses, next)
	}
	st.AgentAddress = st.AgentAddresses[0]
	return st, nil
}

// saveState writes status.state only when it changed.
func (a *actuator) saveState(ctx context.Context, ext *extensionsv1alpha1.Extension, st State) error {
	raw, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if ext.Status.State != nil && string(ext.Status.State.Raw) == string(raw) {
		return nil
	}
	patch := client.MergeFrom(ext.DeepCopy())
	ext.Status.State = &runtime.RawExtension{Raw: raw}
	if err := a.client.Status().Patch(ctx, ext, patch); err != nil {
		return fmt.Errorf("save status.state: %w", err)
	}
	return nil
}

func (a *actuator) Delete(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension) error {
	return a.delete(ctx, log, ext, true)
}

// ForceDelete does what Delete does without waiting for the shoot-side objects: the shoot's
// API server may be gone, and gardenlet force-deletes ManagedResources itself.
func (a *actuator) ForceDelete(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension) error {
	return a.delete(ctx, log, ext, false)
}

func (a *actuator) delete(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension, wait bool) error {
	ns := ext.Namespace
	// The route first: the ingress stops sending new connections before the server goes.
	if err := a.deleteSeedObjects(ctx, ns, true); err != nil {
		return err
	}
	if err := managedresources.DeleteForShoot(ctx, a.client, ns, manifest.ManagedResourceName); err != nil {
		return fmt.Errorf("delete managed resource: %w", err)
	}
	if wait {
		// Bounded, so that a retry re-reads the Cluster: if the shoot meanwhile gets the
		// force-deletion annotation, the retry takes ForceDelete instead of waiting forever.
		wctx, cancel := context.WithTimeout(ctx, deleteWait)
		defer cancel()
		if err := managedresources.WaitUntilDeleted(wctx, a.client, ns, manifest.ManagedResourceName); err != nil {
			return fmt.Errorf("wait for managed resource deletion: %w", err)
		}
	}
	cluster, err := extensionscontroller.GetCluster(ctx, a.client, ns)
	if err != nil {
		return fmt.Errorf("read cluster: %w", err)
	}
	// A secrets manager that generated nothing removes every secret of its identity.
	sm, err := extensionssecretsmanager.SecretsManagerForCluster(ctx, log.WithName("secretsmanager"), a.cfg.Clock, a.client, cluster, SecretsManagerIdentity, nil)
	if err != nil {
		return fmt.Errorf("secrets manager: %w", err)
	}
	return sm.Cleanup(ctx)
}

// legacyServerPolicyName is the NetworkPolicy extension/manifest used to write for
// tendril-server (ingress pods to the tunnel port); Gardener's resource manager now derives
// tendril-server's policies from its Service, and seeds upgraded from then still carry it.
const legacyServerPolicyName = manifest.ServerName

// deleteLegacyServerPolicy deletes the old hand-written tendril-server NetworkPolicy in ns, if
// it is there and carries tendril-server's labels (a policy of that name written by someone
// else stays). The resource manager's policies have other names (ingress-to-tendril-server-…).
func (a *actuator) deleteLegacyServerPolicy(ctx context.Context, ns string) error {
	// The uncached reader: the cache watches no NetworkPolicies, and one read per reconcile does
	// not justify watching every policy of the seed.
	np := &networkingv1.NetworkPolicy{}
	if err := a.reader.Get(ctx, client.ObjectKey{Namespace: ns, Name: legacyServerPolicyName}, np); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("read the old %s NetworkPolicy: %w", legacyServerPolicyName, err)
	}
	if np.Labels[v1beta1constants.LabelApp] != manifest.ServerName {
		return nil
	}
	// The UID precondition: delete only the policy just read.
	if err := a.client.Delete(ctx, np, client.Preconditions{UID: &np.UID}); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete the old %s NetworkPolicy: %w", legacyServerPolicyName, err)
	}
	return nil
}

func (a *actuator) deleteSeedObjects(ctx context.Context, ns string, withRoute bool) error {
	v := manifest.Values{Namespace: ns}
	objs := append(manifest.SeedObjects(v), manifest.StaleSeedObjects(v)...)
	if withRoute {
		objs = append([]client.Object{manifest.Route(v), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: manifest.TerminationSecretName, Namespace: ns}}}, objs...)
	}
	for _, obj := range objs {
		if err := a.client.Delete(ctx, obj); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete %T %s: %w", obj, client.ObjectKeyFromObject(obj), err)
		}
	}
	return nil
}

// Migrate leaves the shoot's objects in place (keepObjects) and removes everything tendril
// runs in this seed. The persisted secrets stay for gardenlet to carry to the new seed.
func (a *actuator) Migrate(ctx context.Context, _ logr.Logger, ext *extensionsv1alpha1.Extension) error {
	ns := ext.Namespace
	if err := managedresources.SetKeepObjects(ctx, a.client, ns, manifest.ManagedResourceName, true); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("keep shoot objects: %w", err)
	}
	if err := managedresources.DeleteForShoot(ctx, a.client, ns, manifest.ManagedResourceName); err != nil {
		return fmt.Errorf("delete managed resource: %w", err)
	}
	if err := managedresources.WaitUntilDeleted(ctx, a.client, ns, manifest.ManagedResourceName); err != nil {
		return fmt.Errorf("wait for managed resource deletion: %w", err)
	}
	return a.deleteSeedObjects(ctx, ns, true)
}

// Restore reconciles from the restored state: status.state carries the tunnel addresses and
// the persisted secrets carry the keys, so the shoot's agent reconnects unchanged.
func (a *actuator) Restore(ctx context.Context, log logr.Logger, ext *extensionsv1alpha1.Extension) error {
	return a.Reconcile(ctx, log, ext)
}
