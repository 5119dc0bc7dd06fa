package networkpaths

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"strings"

	"github.com/Masterminds/semver/v3"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	"github.com/gardener/gardener/pkg/chartrenderer"
	kubeapiserver "github.com/gardener/gardener/pkg/component/kubernetes/apiserver"
	"github.com/gardener/gardener/pkg/component/kubernetes/apiserverexposure"
	gardenletnetworkpolicy "github.com/gardener/gardener/pkg/controller/networkpolicy"
	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/version"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/charts"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/kube/netpoleval"
)

// RuntimeNetworks are the seed's networks (gardenlet excludes them from
// allow-to-private-networks); World's pods get addresses from Pods.
var RuntimeNetworks = gardenletnetworkpolicy.RuntimeNetworkConfig{
	IPFamilies: []gardencorev1beta1.IPFamily{gardencorev1beta1.IPFamilyIPv4},
	Nodes:      []string{"10.250.0.0/16"},
	Pods:       []string{"10.244.0.0/16"},
	Services:   []string{"10.96.0.0/12"},
}

// ShootNamespaceLabels are a shoot control-plane namespace's labels as gardenlet sets them
// (botanist DeployControlPlaneNamespace).
func ShootNamespaceLabels() map[string]string {
	return map[string]string{
		v1beta1constants.GardenRole:                       v1beta1constants.GardenRoleShoot,
		v1beta1constants.LabelSeedProvider:                "local",
		v1beta1constants.LabelShootProvider:               "local",
		v1beta1constants.LabelNetworkingProvider:          "calico",
		v1beta1constants.LabelBackupProvider:              "local",
		v1beta1constants.LabelExtensionPrefix + "tendril": "true",
		"pod-security.kubernetes.io/enforce":              "privileged",
		resourcesv1alpha1.HighAvailabilityConfigConsider:  "true",
	}
}

// ExtensionNamespaceLabels are the extension namespace's labels as gardenlet's
// ControllerInstallation reconciler sets them.
func ExtensionNamespaceLabels() map[string]string {
	return map[string]string{
		v1beta1constants.GardenRole:                      v1beta1constants.GardenRoleExtension,
		v1beta1constants.LabelControllerRegistrationName: "tendril",
		resourcesv1alpha1.HighAvailabilityConfigConsider: "true",
	}
}

// RenderChart renders the tendril-seed chart into namespace with Gardener's chart renderer, as
// gardenlet does, and decodes every object.
func RenderChart(scheme *runtime.Scheme, namespace string) ([]client.Object, error) {
	values := map[string]any{"gardener": map[string]any{
		"version": "v1.150.0",
		"garden":  map[string]any{"clusterIdentity": "garden"},
		"seed": map[string]any{
			"name": "local", "clusterIdentity": "seed-local", "provider": "local", "region": "local",
			"ingressDomain": "ingress.local.seed.example.org",
		},
	}}
	rc, err := chartrenderer.NewWithServerVersion(&version.Info{GitVersion: "v1.37.1", Major: "1", Minor: "37"}).
		RenderEmbeddedFS(charts.FS, charts.SeedChart, "tendril", namespace, values)
	if err != nil {
		return nil, fmt.Errorf("render tendril-seed: %w", err)
	}
	decoder := serializer.NewCodecFactory(scheme).UniversalDeserializer()
	var objs []client.Object
	for _, m := range rc.Manifests {
		for doc := range strings.SplitSeq(m.Content, "\n---\n") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			obj, _, err := decoder.Decode([]byte(doc), nil, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", m.Name, err)
			}
			objs = append(objs, obj.(client.Object))
		}
	}
	return objs, nil
}

// KubeAPIServerPodLabels are the pod labels of Gardener's kube-apiserver Deployment
// (pkg/component/kubernetes/apiserver deployment.go) that its NetworkPolicies read, without
// those for etcd, which a World does not have.
func KubeAPIServerPodLabels() map[string]string {
	podLabels := kubeapiserver.GetLabels()
	for _, k := range []string{
		v1beta1constants.LabelNetworkPolicyToDNS,
		v1beta1constants.LabelNetworkPolicyToPublicNetworks,
		v1beta1constants.LabelNetworkPolicyToPrivateNetworks,
		resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyWebhookTargets,
		resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyExtensionsNamespaceAlias + "-" + v1beta1constants.LabelNetworkPolicyWebhookTargets,
	} {
		podLabels[k] = v1beta1constants.LabelNetworkPolicyAllowed
	}
	return podLabels
}

// KubeAPIServerDeployment is the shoot's kube-apiserver as the egress webhook receives it: the
// pod labels of Gardener's kube-apiserver Deployment (pkg/component/kubernetes/apiserver
// deployment.go), then MutateDeployment for the shoot's egress mode.
func KubeAPIServerDeployment(ns string, mode tendrilv1alpha1.EgressMode) (*appsv1.Deployment, error) {
	podLabels := KubeAPIServerPodLabels()
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: manifest.KubeAPIServerName, Namespace: ns, Labels: kubeapiserver.GetLabels()},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: kubeapiserver.GetLabels()},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name: "kube-apiserver", Image: "registry.k8s.io/kube-apiserver:v1.37.1",
					Args:  []string{"--secure-port=443"},
					Ports: []corev1.ContainerPort{{Name: "https", ContainerPort: manifest.PortKubeAPIServer, Protocol: corev1.ProtocolTCP}},
				}}},
			},
		},
	}
	cfg, err := egresswebhook.EgressSelectorConfig(ns, mode)
	if err != nil {
		return nil, err
	}
	if err := egresswebhook.MutateDeployment(dep, egresswebhook.Mutation{
		Egress: mode, Config: string(cfg), RelayImage: "tendril:test",
		Secrets: egresswebhook.Secrets{Client: "tendril-kube-apiserver-client-0", CABundle: "ca-tendril-bundle-0"},
	}); err != nil {
		return nil, fmt.Errorf("egress webhook on %s: %w", ns, err)
	}
	return dep, nil
}

// DeployKubeAPIServerService creates or updates the shoot's kube-apiserver Service with
// Gardener's own component (apiserverexposure), annotations for GRM included.
func DeployKubeAPIServerService(ctx context.Context, c client.Client, ns string) error {
	if err := apiserverexposure.NewService(logr.Discard(), c, ns,
		&apiserverexposure.ServiceValues{RuntimeKubernetesVersion: semver.MustParse("1.37.1")},
		nil, nil, nil, nil, func() []string { return []string{"istio-ingress"} },
	).Deploy(ctx); err != nil {
		return fmt.Errorf("gardener's kube-apiserver Service in %s: %w", ns, err)
	}
	return nil
}

// prometheusPod is the shoot's Prometheus as far as GRM cares: Gardener's scrape-target label.
func prometheusPod() corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{
			"app": "prometheus", "role": "monitoring", "name": "shoot",
			resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyScrapeTargets: v1beta1constants.LabelNetworkPolicyAllowed,
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "prometheus", Image: "prometheus:test"}}},
	}
}

// seedPrometheusPod is the seed's Prometheus in garden with the pod labels gardenlet gives it
// (pkg/gardenlet/controller/seed/seed components.go, newSeedPrometheus AdditionalPodLabels).
func seedPrometheusPod() corev1.PodTemplateSpec {
	prefix := resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-"
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{
			"app": "prometheus", "role": "monitoring", "name": "seed",
			prefix + v1beta1constants.LabelNetworkPolicySeedScrapeTargets:                                                                     v1beta1constants.LabelNetworkPolicyAllowed,
			prefix + v1beta1constants.LabelNetworkPolicyExtensionsNamespaceAlias + "-" + v1beta1constants.LabelNetworkPolicySeedScrapeTargets: v1beta1constants.LabelNetworkPolicyAllowed,
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "prometheus", Image: "prometheus:test"}}},
	}
}

// World creates the objects the controllers and the judgement need in one API server and
// records every actor's endpoint.
type World struct {
	c          client.Client
	nextIP     int
	actors     map[string]netpoleval.Endpoint
	namespaces map[string]*corev1.Namespace
	pods       map[string]*corev1.Pod
	opts       WorldOptions
}

// PodMaker creates the pod named name in namespace ns from a Deployment's template and returns it
// as stored, with its address.
type PodMaker func(ctx context.Context, ns, name string, tmpl corev1.PodTemplateSpec) (*corev1.Pod, error)

// WorldOptions change how a World is built; the zero value builds it in envtest.
type WorldOptions struct {
	// MakePod creates each pod (nil: the pod as the template has it, with the next address of
	// 10.244.0.0/16 written into its status, for an API server without a kubelet).
	MakePod PodMaker
	// SeedAPIServer is the seed API server's address on the node network (default 10.250.0.10,
	// with Endpoints written for it where there are none).
	SeedAPIServer netip.Addr
	// Mutate changes each object before it is created (nil: none).
	Mutate func(client.Object)
	// IstioNamespace is the namespace of Gardener's istio ingress gateway (default
	// IstioIngressNamespace).
	IstioNamespace string
}

// NewWorld builds in the API server c talks to.
func NewWorld(c client.Client) *World { return NewWorldWith(c, WorldOptions{}) }

// NewWorldWith builds in the API server c talks to as opts say.
func NewWorldWith(c client.Client, opts WorldOptions) *World {
	if !opts.SeedAPIServer.IsValid() {
		opts.SeedAPIServer = netip.MustParseAddr("10.250.0.10")
	}
	if opts.IstioNamespace == "" {
		opts.IstioNamespace = IstioIngressNamespace
	}
	return &World{c: c, actors: map[string]netpoleval.Endpoint{}, namespaces: map[string]*corev1.Namespace{}, pods: map[string]*corev1.Pod{}, opts: opts}
}

// Pods are the actors' pods by actor name (the outside actors have none).
func (w *World) Pods() map[string]*corev1.Pod { return w.pods }

// Actors are the endpoints by actor name.
func (w *World) Actors() map[string]netpoleval.Endpoint { return w.actors }

// Namespace creates namespace name or adds labels to it.
func (w *World) Namespace(ctx context.Context, name string, labels map[string]string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	if err := w.c.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("namespace %s: %w", name, err)
	}
	stored := &corev1.Namespace{}
	if err := w.c.Get(ctx, client.ObjectKeyFromObject(ns), stored); err != nil {
		return err
	}
	if len(labels) > 0 {
		if stored.Labels == nil {
			stored.Labels = map[string]string{}
		}
		maps.Copy(stored.Labels, labels)
		if err := w.c.Update(ctx, stored); err != nil {
			return fmt.Errorf("label namespace %s: %w", name, err)
		}
	}
	w.namespaces[name] = stored
	return nil
}

// Create creates obj (a Service, ServiceAccount, …) as it is (after WorldOptions.Mutate).
func (w *World) Create(ctx context.Context, obj client.Object) error {
	obj.SetResourceVersion("")
	if w.opts.Mutate != nil {
		w.opts.Mutate(obj)
	}
	if err := w.c.Create(ctx, obj); err != nil {
		return fmt.Errorf("create %T %s/%s: %w", obj, obj.GetNamespace(), obj.GetName(), err)
	}
	return nil
}

// Pod creates the pod a Deployment's template would (envtest runs no controller-manager) with
// the next pod IP in namespace ns (made by Namespace), and records it as actor.
func (w *World) Pod(ctx context.Context, actor, ns, name string, tmpl corev1.PodTemplateSpec) error {
	nsObj, ok := w.namespaces[ns]
	if !ok {
		return fmt.Errorf("pod %s/%s: namespace not made by the world", ns, name)
	}
	mk := w.opts.MakePod
	if mk == nil {
		mk = w.envtestPod
	}
	stored, err := mk(ctx, ns, name, tmpl)
	if err != nil {
		return err
	}
	w.pods[actor] = stored
	w.actors[actor] = netpoleval.Pod(stored, nsObj)
	return nil
}

// envtestPod is the default PodMaker: the pod as its template has it, with the next pod address
// written into its status (envtest runs no kubelet).
func (w *World) envtestPod(ctx context.Context, ns, name string, tmpl corev1.PodTemplateSpec) (*corev1.Pod, error) {
	w.nextIP++
	// 10.244.0.0/16 (RuntimeNetworks.Pods), 250 addresses per /24.
	ip := netip.AddrFrom4([4]byte{10, 244, byte(w.nextIP / 250), byte(w.nextIP%250 + 1)})
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: tmpl.Labels, Annotations: tmpl.Annotations}, Spec: *tmpl.Spec.DeepCopy()}
	// Admission of what envtest lacks (Gardener's PriorityClasses, ServiceAccounts and the
	// token volumes that need one) is no concern of NetworkPolicies.
	p.Spec.ServiceAccountName, p.Spec.PriorityClassName, p.Spec.Volumes = "", "", nil
	for _, cs := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
		for i := range cs {
			cs[i].VolumeMounts = nil
		}
	}
	if err := w.Create(ctx, p); err != nil {
		return nil, err
	}
	p.Status.PodIP, p.Status.PodIPs = ip.String(), []corev1.PodIP{{IP: ip.String()}}
	if err := w.c.Status().Update(ctx, p); err != nil {
		return nil, fmt.Errorf("pod %s/%s status: %w", ns, name, err)
	}
	stored := &corev1.Pod{}
	if err := w.c.Get(ctx, client.ObjectKeyFromObject(p), stored); err != nil {
		return nil, err
	}
	return stored, nil
}

// Seed makes the seed's side: garden, the extension namespace extNS with the tendril-seed
// chart's Services and a pod per Deployment, the seed's Prometheus, Gardener's istio ingress
// gateway (IstioIngressGateway), the outside actors (the
// internet, the seed API server on the node network) and the seed API server's endpoints
// gardenlet's allow-to-runtime-apiserver reads.
func (w *World) Seed(ctx context.Context, scheme *runtime.Scheme, extNS string) error {
	if err := w.Namespace(ctx, v1beta1constants.GardenNamespace, nil); err != nil {
		return err
	}
	if err := w.Namespace(ctx, extNS, ExtensionNamespaceLabels()); err != nil {
		return err
	}
	err := w.c.Get(ctx, client.ObjectKey{Namespace: corev1.NamespaceDefault, Name: "kubernetes"}, &corev1.Endpoints{}) //nolint:staticcheck // gardenlet reads Endpoints
	if apierrors.IsNotFound(err) {
		err = w.Create(ctx, &corev1.Endpoints{ //nolint:staticcheck // gardenlet reads Endpoints
			ObjectMeta: metav1.ObjectMeta{Namespace: corev1.NamespaceDefault, Name: "kubernetes"},
			Subsets:    []corev1.EndpointSubset{{Addresses: []corev1.EndpointAddress{{IP: w.opts.SeedAPIServer.String()}}, Ports: []corev1.EndpointPort{{Name: "https", Port: 443, Protocol: corev1.ProtocolTCP}}}},
		})
	}
	if err != nil {
		return fmt.Errorf("seed API server endpoints: %w", err)
	}
	objs, err := RenderChart(scheme, extNS)
	if err != nil {
		return err
	}
	for _, obj := range objs {
		switch o := obj.(type) {
		case *corev1.Service:
			if err := w.Create(ctx, o); err != nil {
				return err
			}
		case *appsv1.Deployment:
			actor := map[string]string{"tendril-ingress": ingress, "gardener-extension-tendril": seed}[o.Name]
			if actor == "" {
				return fmt.Errorf("chart Deployment %s: which actor?", o.Name)
			}
			tmpl := *o.Spec.Template.DeepCopy()
			if actor == seed {
				// The replica that serves xDS carries the leader label (tendrilv1alpha1.XDSLeaderLabel),
				// which tendril-xds selects.
				tmpl.Labels[tendrilv1alpha1.XDSLeaderLabel] = "true"
			}
			if err := w.Pod(ctx, actor, extNS, o.Name+"-0", tmpl); err != nil {
				return err
			}
		}
	}
	if err := w.Pod(ctx, promSeed, v1beta1constants.GardenNamespace, "prometheus-seed-0", seedPrometheusPod()); err != nil {
		return err
	}
	if err := w.IstioIngressGateway(ctx, w.opts.IstioNamespace); err != nil {
		return err
	}
	w.actors[world] = netpoleval.External(world, netip.MustParseAddr("203.0.113.10"))
	w.actors[seedAPI] = netpoleval.External(seedAPI, w.opts.SeedAPIServer)
	return nil
}

// Shoot makes a shoot's side, in a namespace labelled as gardenlet labels it: tendril-server's
// pod from its Deployment's template (its Service is the caller's: extension/manifest's, as the
// actuator creates it), a kube-apiserver pod as the egress webhook mutates it, a Prometheus,
// Gardener's vpn-seed-server (VPNSeedServer).
// Gardener's kube-apiserver Service is DeployKubeAPIServerService's.
func (w *World) Shoot(ctx context.Context, s Shoot, server corev1.PodTemplateSpec) error {
	if err := w.Namespace(ctx, s.Namespace, ShootNamespaceLabels()); err != nil {
		return err
	}
	if err := w.Pod(ctx, s.Server(), s.Namespace, manifest.ServerName+"-0", server); err != nil {
		return err
	}
	kas, err := KubeAPIServerDeployment(s.Namespace, s.Egress)
	if err != nil {
		return err
	}
	if err := w.Pod(ctx, s.KubeAPIServer(), s.Namespace, "kube-apiserver-0", kas.Spec.Template); err != nil {
		return err
	}
	if err := w.Pod(ctx, s.Prometheus(), s.Namespace, "prometheus-shoot-0", prometheusPod()); err != nil {
		return err
	}
	return w.VPNSeedServer(ctx, s, w.opts.IstioNamespace)
}

// ShootValues are extension/manifest's values for a shoot's seed objects in a World: only what
// the NetworkPolicies see matters (the Services, the pod template's labels and ports).
func ShootValues(ns string, mode tendrilv1alpha1.EgressMode, extNS string) manifest.Values {
	return manifest.Values{
		Namespace: ns, Image: "tendril:test", Egress: mode, IngressNamespace: extNS,
		Secrets: manifest.SecretNames{ServerTLS: "tls", ClientCA: "ca", ServerWireGuard: "wg"},
		Tunnel:  manifest.Tunnel{Agents: []manifest.Agent{{}}}, // one agent (its keys do not matter here)
	}
}

// ShootControlPlane makes shoot s as the extension and Gardener would for the extension in
// namespace extNS: the namespace as gardenlet labels it, tendril-server's Service and pod
// (extension/manifest), Gardener's kube-apiserver Service (apiserverexposure, Gardener's own
// code) and pods (Shoot).
func (w *World) ShootControlPlane(ctx context.Context, s Shoot, extNS string) error {
	if err := w.Namespace(ctx, s.Namespace, ShootNamespaceLabels()); err != nil {
		return err
	}
	var server corev1.PodTemplateSpec
	for _, obj := range manifest.SeedObjects(ShootValues(s.Namespace, s.Egress, extNS)) {
		if d, ok := obj.(*appsv1.Deployment); ok {
			server = d.Spec.Template
			continue
		}
		if err := w.Create(ctx, obj); err != nil {
			return err
		}
	}
	if err := DeployKubeAPIServerService(ctx, w.c, s.Namespace); err != nil {
		return err
	}
	return w.Shoot(ctx, s, server)
}
