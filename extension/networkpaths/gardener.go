package networkpaths

import (
	"context"
	"fmt"
	"net"

	"github.com/Masterminds/semver/v3"
	gardenletconfigv1alpha1 "github.com/gardener/gardener/pkg/apis/config/gardenlet/v1alpha1"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	"github.com/gardener/gardener/pkg/chartrenderer"
	"github.com/gardener/gardener/pkg/client/kubernetes"
	"github.com/gardener/gardener/pkg/component/networking/istio"
	vpnseedserver "github.com/gardener/gardener/pkg/component/networking/vpn/seedserver"
	sharedcomponent "github.com/gardener/gardener/pkg/component/shared"
	"github.com/gardener/gardener/pkg/features"
	"github.com/gardener/gardener/pkg/utils/managedresources"
	fakesecretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager/fake"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/version"
	"sigs.k8s.io/controller-runtime/pkg/client"
	fakeclient "sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// Gardener's own reversed VPN beside tendril's: the seed's istio ingress gateway and a shoot's
// vpn-seed-server, each produced by Gardener's component (the istio component as gardenlet's
// seed reconciler configures it, pkg/gardenlet/controller/seed/seed components.go newIstio; the
// vpn seed server component as the botanist deploys it). The components write into a fake
// client, the only thing they are given: the objects are read back from it and created in the
// World as they are, so the policies Gardener's controllers derive are those of a real seed.

// IstioIngressNamespace is where a World puts Gardener's istio ingress gateway unless
// WorldOptions.IstioNamespace says otherwise: gardenlet's default (SNI.Ingress.Namespace).
const IstioIngressNamespace = v1beta1constants.DefaultSNIIngressNamespace

// The ports of Gardener's VPN: the gateway's unified port and vpn-seed-server's OpenVPN port.
const (
	vpnGatewayPort = vpnseedserver.HTTPProxyGatewayPort
	vpnPort        = vpnseedserver.OpenVPNPort
)

// componentClient is the fake client Gardener's components deploy into, with gardenlet's scheme.
func componentClient() client.Client {
	return fakeclient.NewClientBuilder().WithScheme(kubernetes.SeedScheme).Build()
}

// IstioIngressGateway makes Gardener's istio ingress gateway in namespace ns: the namespace with
// the labels the istio component gives it, the istio-ingressgateway Service (its GRM annotations
// admit the extension namespaces: tendril-ingress relays Gardener's CONNECTs there) and a pod from
// the gateway Deployment's template.
func (w *World) IstioIngressGateway(ctx context.Context, ns string) error {
	objs, err := istioGatewayObjects(ctx, ns)
	if err != nil {
		return err
	}
	var (
		svc  *corev1.Service
		tmpl *corev1.PodTemplateSpec
	)
	for _, obj := range objs {
		switch o := obj.(type) {
		case *corev1.Namespace:
			if o.Name == ns {
				if err := w.Namespace(ctx, ns, o.Labels); err != nil {
					return err
				}
			}
		case *corev1.Service:
			if o.Name == v1beta1constants.DefaultSNIIngressServiceName {
				svc = o
			}
		case *appsv1.Deployment:
			if o.Name == v1beta1constants.DefaultSNIIngressServiceName {
				tmpl = &o.Spec.Template
			}
		}
	}
	if svc == nil || tmpl == nil {
		return fmt.Errorf("gardener's istio component rendered no %s Service and Deployment in %s", v1beta1constants.DefaultSNIIngressServiceName, ns)
	}
	if _, ok := w.namespaces[ns]; !ok {
		return fmt.Errorf("gardener's istio component rendered no namespace %s", ns)
	}
	if err := w.Create(ctx, svc); err != nil {
		return err
	}
	return w.Pod(ctx, istioGateway, ns, v1beta1constants.DefaultSNIIngressServiceName+"-0", *tmpl)
}

// istioGatewayObjects are the objects of the istio component's ingress ManagedResource for a seed
// with gardenlet's default SNI ingress, the HTTP proxy legacy port as the feature gate
// RemoveHTTPProxyLegacyPort leaves it by default, no istiod (the World needs only the gateway).
func istioGatewayObjects(ctx context.Context, ns string) ([]client.Object, error) {
	// The component asks the feature gate (IstioTLSTermination); gardenlet registers its gates at
	// start, a test binary has not.
	if err := features.DefaultFeatureGate.Add(features.GetFeatures(features.IstioTLSTermination, features.RemoveHTTPProxyLegacyPort)); err != nil {
		return nil, fmt.Errorf("gardener feature gates: %w", err)
	}
	sni := &gardenletconfigv1alpha1.SNIIngress{}
	gardenletconfigv1alpha1.SetDefaults_SNIIngress(sni)
	legacy := !features.DefaultFeatureGate.Enabled(features.RemoveHTTPProxyLegacyPort)
	ports := []corev1.ServicePort{
		{Name: "tcp", Port: 443, TargetPort: intstr.FromInt32(9443)},
		{Name: "http-proxy", Port: vpnseedserver.HTTPProxyGatewayPort, TargetPort: intstr.FromInt32(vpnseedserver.HTTPProxyGatewayPort)},
	}
	if legacy {
		ports = append(ports, corev1.ServicePort{Name: "tls-tunnel", Port: vpnseedserver.GatewayPort, TargetPort: intstr.FromInt32(vpnseedserver.GatewayPort)})
	}
	fc := componentClient()
	renderer := chartrenderer.NewWithServerVersion(&version.Info{GitVersion: "v1.37.1", Major: "1", Minor: "37"})
	deployer, err := sharedcomponent.NewIstio(ctx, fc, renderer, "", ns, v1beta1constants.PriorityClassNameSeedSystemCritical,
		false, sharedcomponent.GetIstioZoneLabels(sni.Labels, nil), nil, nil, nil, nil, nil, ports, nil,
		true, legacy, nil, false, semver.MustParse("1.37.1"))
	if err != nil {
		return nil, fmt.Errorf("gardener's istio component: %w", err)
	}
	if err := deployer.Deploy(ctx); err != nil {
		return nil, fmt.Errorf("gardener's istio component: %w", err)
	}
	var objs []client.Object
	for _, name := range istio.ManagedResourceNames(false, "") {
		o, err := managedresources.GetObjects(ctx, fc, v1beta1constants.IstioSystemNamespace, name)
		if err != nil {
			return nil, fmt.Errorf("gardener's istio component: %w", err)
		}
		objs = append(objs, o...)
	}
	return objs, nil
}

// VPNSeedServer makes shoot s's vpn-seed-server as Gardener's component deploys it into the
// shoot's namespace (made by Namespace): its Service (HA: vpn-seed-server-0, the first of the
// pair) and a pod from its Deployment's (HA: StatefulSet's) template.
func (w *World) VPNSeedServer(ctx context.Context, s Shoot, istioNS string) error {
	fc := componentClient()
	// The component signs its server certificate with the shoot's VPN CA, which the botanist
	// made before.
	if err := fc.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: v1beta1constants.SecretNameCAVPN, Namespace: s.Namespace}}); err != nil {
		return err
	}
	values := vpnseedserver.Values{
		ImageAPIServerProxy: "envoy:test", ImageVPNSeedServer: "vpn-server:test",
		Network: vpnseedserver.NetworkValues{
			PodCIDRs:     cidr("100.64.0.0/12"),
			ServiceCIDRs: cidr("100.104.0.0/13"),
			NodeCIDRs:    cidr("10.1.0.0/16"),
			IPFamilies:   []gardencorev1beta1.IPFamily{gardencorev1beta1.IPFamilyIPv4},
		},
		SeedPodNetwork: RuntimeNetworks.Pods[0],
		Replicas:       1,
	}
	if s.VPNHighAvailability {
		values.Replicas = vpnseedserver.HighAvailabilityReplicaCount
		values.HighAvailabilityEnabled = true
		values.HighAvailabilityNumberOfSeedServers = vpnseedserver.HighAvailabilityReplicaCount
		values.HighAvailabilityNumberOfShootClients = 1
	}
	if err := vpnseedserver.New(fc, s.Namespace, fakesecretsmanager.New(fc, s.Namespace), func() string { return istioNS }, values).Deploy(ctx); err != nil {
		return fmt.Errorf("gardener's vpn seed server component in %s: %w", s.Namespace, err)
	}
	svc := &corev1.Service{}
	name := s.VPNServiceName()
	if err := fc.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: name}, svc); err != nil {
		return fmt.Errorf("gardener's vpn seed server component in %s: %w", s.Namespace, err)
	}
	var tmpl corev1.PodTemplateSpec
	if s.VPNHighAvailability {
		sts := &appsv1.StatefulSet{}
		if err := fc.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: vpnseedserver.ServiceName}, sts); err != nil {
			return fmt.Errorf("gardener's vpn seed server component in %s: %w", s.Namespace, err)
		}
		tmpl = *sts.Spec.Template.DeepCopy()
		// The StatefulSet controller gives each pod its name as a label; the per-replica Service
		// selects it.
		tmpl.Labels[appsv1.StatefulSetPodNameLabel] = name
	} else {
		dep := &appsv1.Deployment{}
		if err := fc.Get(ctx, client.ObjectKey{Namespace: s.Namespace, Name: vpnseedserver.ServiceName}, dep); err != nil {
			return fmt.Errorf("gardener's vpn seed server component in %s: %w", s.Namespace, err)
		}
		tmpl = dep.Spec.Template
	}
	if err := w.Create(ctx, svc); err != nil {
		return err
	}
	return w.Pod(ctx, s.VPNSeedServer(), s.Namespace, name, tmpl)
}

// cidr is the constant network s as the one network Gardener's components take (it panics on a
// malformed constant).
func cidr(s string) []net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return []net.IPNet{*n}
}

// VPNServiceName is the name of the shoot's vpn-seed-server Service the World builds: Gardener's
// single one, or the first of the HA pair.
func (s Shoot) VPNServiceName() string {
	if s.VPNHighAvailability {
		return vpnseedserver.ServiceName + "-0"
	}
	return vpnseedserver.ServiceName
}
