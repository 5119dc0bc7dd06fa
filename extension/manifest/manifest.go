// Package manifest builds the Kubernetes objects tendril deploys for one shoot: the seed-side
// tendril-server Deployment and Service, the shoot-side agents (delivered in a
// ManagedResource), and the Route the xDS control plane reads. The builders are pure functions
// of Values — the extension's actuator and the charts' tests use the same ones, so there is one
// source of truth for what a shoot gets. It reads no cluster and writes nothing.
package manifest

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	resourcesv1alpha1 "github.com/gardener/gardener/pkg/apis/resources/v1alpha1"
	gardenerutils "github.com/gardener/gardener/pkg/utils/gardener"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/utils/ptr"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/wire"
)

// Names of the objects, fixed so that operators and the other controllers find them; never
// Gardener's own names (vpn-seed-server, vpn-shoot, apiserver-proxy), so that two controllers
// never fight over one object.
const (
	ServerName         = "tendril-server"
	AgentName          = "tendril-agent"
	APIServerProxyName = "tendril-apiserver-proxy"
	RouteName          = "tendril"
	// ManagedResourceName is the ManagedResource carrying the shoot-side objects.
	ManagedResourceName = "extension-tendril-shoot"
	// KubeAPIServerName is Gardener's kube-apiserver Deployment and Service in the shoot namespace.
	KubeAPIServerName = "kube-apiserver"
	// ShootNamespace is where the shoot-side agents run.
	ShootNamespace = metav1.NamespaceSystem
)

// tendril-server ports (design.md, "tendril-server ports").
const (
	PortTunnel  = 1194 // the agent's framed WireGuard stream, forwarded by the ingress
	PortConnect = 9443 // egress HTTP CONNECT over mutual TLS
	PortGRPC    = 8090 // egress konnectivity gRPC over mutual TLS
	PortMetrics = 9090 // metrics, /healthz, /readyz
	// PortIngressProxy is the ingress's unified port (Gardener's since GEP-30): the agents dial
	// it with X-Gardener-Destination, and so do the apiserver-proxies.
	PortIngressProxy = 8443
	// PortKubeAPIServer is the kube-apiserver Service port.
	PortKubeAPIServer = 443
)

// Mount paths inside tendril-server and the agents.
const (
	pathWireGuard = "/etc/tendril/wireguard"
	pathTLS       = "/etc/tendril/tls"
	pathCA        = "/etc/tendril/ca"
)

// Values is everything the builders need to know about one shoot.
type Values struct {
	// Namespace is the shoot's namespace in the seed (its technical ID).
	Namespace string
	// Image is the tendril image holding every binary.
	Image string
	// Hibernated scales the seed side to zero and withdraws the route.
	Hibernated bool
	// ShootCIDRs are the shoot's node, pod and service networks: the only egress targets.
	ShootCIDRs []netip.Prefix
	// Hostnames are the TLS server names of the shoot's kube-apiserver.
	Hostnames []string
	// AdvertisedAddress is kube-apiserver's advertised address (the apiserver-proxy binds it).
	AdvertisedAddress netip.Addr
	// Ingress is the seed ingress's host name or address the agents dial.
	Ingress string
	// APIServerProxy deploys the apiserver-proxy DaemonSet.
	APIServerProxy bool
	// Egress is kube-apiserver's egress front-end (used by the webhook, which labels
	// kube-apiserver for that port only).
	Egress tendrilv1alpha1.EgressMode
	// Tunnel holds the WireGuard identities and inner addresses.
	Tunnel Tunnel
	// KernelTunnel runs both tunnel ends on TUN devices with the kernel's TCP/IP stack
	// (tendrilv1alpha1.TunnelStackKernel): privileged, see kernelTunnel.
	KernelTunnel bool
	// Secrets names the secrets-manager Secrets in the shoot namespace.
	Secrets SecretNames
	// IngressNamespace is where the seed ingress runs (default garden); tendril-server's
	// Service selects it for GRM's cross-namespace policies.
	IngressNamespace string
	// PerRequest has the Route terminate the shoot's TLS at the ingress and balance each request
	// (TerminationSecretName holds what that needs).
	PerRequest bool
}

// TerminationSecretName is the Secret a per-request Route's termination names; the extension
// writes it from gardenlet's secrets.
const TerminationSecretName = "tendril-termination"

// TerminationAPIServerName is the name the ingress verifies kube-apiserver's serving
// certificate for: gardenlet's certificate carries the Service's short name.
const TerminationAPIServerName = KubeAPIServerName

// Tunnel is the non-secret tunnel state (kept in the Extension's status.state) plus the keys.
type Tunnel struct {
	ServerAddresses []netip.Addr
	// ServerPublicKey is the server's base64 WireGuard public key.
	ServerPublicKey string
	// Agents are the shoot's tunnel agents, each its own WireGuard peer of tendril-server and
	// its own Deployment in the shoot; more than one for a highly available control plane.
	Agents []Agent
	// Servers is how many tendril-server replicas run: 0 or 1, one Deployment; more, a
	// StatefulSet whose pods each agent keeps a tunnel to (ServerWorkload).
	Servers int
}

// Agent is one shoot agent's tunnel identity.
type Agent struct {
	// Address is the agent's inner tunnel address.
	Address netip.Addr
	// PublicKey is its base64 WireGuard public key.
	PublicKey string
	// PrivateKey is its private key, delivered to the shoot in the agent's own Secret.
	PrivateKey string
}

// SecretNames are the Secrets tendril-server mounts (names carry the secrets manager's hashes).
type SecretNames struct {
	// ServerTLS holds tls.crt/tls.key of the egress front-ends.
	ServerTLS string
	// ClientCA holds bundle.crt, the CA that signs kube-apiserver's client certificate.
	ClientCA string
	// ServerWireGuard holds the server's private-key.
	ServerWireGuard string
}

// Validate reports the first missing input.
func (v Values) Validate() error {
	switch {
	case v.Namespace == "":
		return fmt.Errorf("namespace is empty")
	case v.Image == "":
		return fmt.Errorf("image is empty")
	case len(v.ShootCIDRs) == 0:
		return fmt.Errorf("no shoot CIDRs")
	case len(v.Hostnames) == 0:
		return fmt.Errorf("no hostnames")
	case v.Ingress == "":
		return fmt.Errorf("ingress address is empty")
	case len(v.Tunnel.ServerAddresses) == 0:
		return fmt.Errorf("tunnel addresses missing")
	case v.Tunnel.ServerPublicKey == "":
		return fmt.Errorf("tunnel keys missing")
	case len(v.Tunnel.Agents) == 0:
		return fmt.Errorf("no tunnel agents")
	}
	seen := map[netip.Addr]bool{}
	for i, a := range v.Tunnel.Agents {
		switch {
		case !a.Address.IsValid():
			return fmt.Errorf("agent %d: tunnel address missing", i)
		case seen[a.Address]:
			return fmt.Errorf("agent %d: tunnel address %s used twice", i, a.Address)
		case a.PublicKey == "" || a.PrivateKey == "":
			return fmt.Errorf("agent %d: tunnel keys missing", i)
		}
		seen[a.Address] = true
	}
	switch {
	case v.Secrets.ServerTLS == "" || v.Secrets.ClientCA == "" || v.Secrets.ServerWireGuard == "":
		return fmt.Errorf("secret names missing")
	case v.APIServerProxy && !v.AdvertisedAddress.IsValid():
		return fmt.Errorf("apiserver-proxy needs kube-apiserver's advertised address")
	}
	return nil
}

// TunnelDestination is the wire name of the shoot's tunnel cluster at the ingress; it keeps
// Gardener's format so Gardener-style clients work too (design.md, "Relation to Gardener's
// own components").
func TunnelDestination(namespace string) string { return wire.TendrilServerWireName(namespace) }

func serverLabels() map[string]string {
	return map[string]string{v1beta1constants.LabelApp: ServerName}
}

// agentPublicKeys and agentAddresses are tendril-server's comma-separated lists, in agent order.
func agentPublicKeys(as []Agent) string {
	ks := make([]string, len(as))
	for i, a := range as {
		ks[i] = a.PublicKey
	}
	return strings.Join(ks, ",")
}

func agentAddresses(as []Agent) string {
	addrs := make([]netip.Addr, len(as))
	for i, a := range as {
		addrs[i] = a.Address
	}
	return joinAddrs(addrs)
}

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

// requests is a container's resources: the CPU and memory it requests, no limits.
func requests(cpu, memory string) corev1.ResourceRequirements {
	return corev1.ResourceRequirements{Requests: corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse(cpu),
		corev1.ResourceMemory: resource.MustParse(memory),
	}}
}

// restricted is the container security context every tendril container gets unless it needs
// more (the apiserver-proxy needs NET_ADMIN for its dummy link).
func restricted() *corev1.SecurityContext {
	return &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		RunAsNonRoot:             ptr.To(true),
		RunAsUser:                ptr.To[int64](nonRootUID),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

// TUNDevice is the TUN device tendril-server and the agents create with KernelTunnel, each in
// its own pod's network namespace.
const TUNDevice = "tendril0"

// kernelTunnel turns container c of pod spec p into a tunnel end on a TUN device (--tun), as
// Gardener runs vpn-seed-server and vpn-shoot: root with NET_ADMIN (a non-root user gets no
// effective capability from the container's set) and the node's /dev/net/tun. The rest of the
// restricted context stays: no privilege escalation, a read-only root, the runtime's seccomp
// profile, every other capability dropped.
func kernelTunnel(p *corev1.PodSpec, c *corev1.Container) {
	c.Args = append(c.Args, "--tun="+TUNDevice)
	c.SecurityContext.RunAsNonRoot = ptr.To(false)
	c.SecurityContext.RunAsUser = ptr.To[int64](0)
	c.SecurityContext.Capabilities.Add = []corev1.Capability{"NET_ADMIN"}
	c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "dev-net-tun", MountPath: "/dev/net/tun"})
	p.Volumes = append(p.Volumes, corev1.Volume{Name: "dev-net-tun", VolumeSource: corev1.VolumeSource{
		HostPath: &corev1.HostPathVolumeSource{Path: "/dev/net/tun", Type: ptr.To(corev1.HostPathCharDev)},
	}})
}

// secretVolume mounts Secret secret with files only their owner may read. They belong to root;
// the pod's fsGroup (podSecurity) makes them readable by the non-root user the containers run as.
func secretVolume(name, secret string) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
		SecretName: secret, DefaultMode: ptr.To[int32](0o400),
	}}}
}

// nonRootUID is the user tendril's containers run as (distroless's nonroot, as Gardener's).
const nonRootUID = 65532

// podSecurity is the pod security context of tendril's pods: kubelet gives the files of Secret
// volumes the fsGroup as their group and group read, without which the non-root user could not
// read its keys (found on a real kubelet: "open …/private-key: permission denied").
func podSecurity() *corev1.PodSecurityContext {
	return &corev1.PodSecurityContext{FSGroup: ptr.To[int64](nonRootUID)}
}

// probes are the liveness and readiness probes of a tendril process serving /healthz and
// /readyz on port (host "" is the pod IP).
func probes(host string, port int32, readyPath string) (live, ready *corev1.Probe) {
	get := func(path string) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Host: host, Path: path, Port: intstr.FromInt32(port)}},
			PeriodSeconds: 10, FailureThreshold: 3,
		}
	}
	return get("/healthz"), get(readyPath)
}

// ServerDeployment is tendril-server in the shoot namespace, one replica.
func ServerDeployment(v Values) *appsv1.Deployment {
	replicas := int32(1)
	if v.Hibernated {
		replicas = 0
	}
	labels := serverLabels()
	return &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: metav1.ObjectMeta{Name: ServerName, Namespace: v.Namespace, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Replicas:             &replicas,
			RevisionHistoryLimit: ptr.To[int32](2),
			// Recreate: the new pod becomes Ready only once the one agent's tunnel moves to it,
			// which happens when the old pod is gone; a rolling update with maxUnavailable 0
			// would wait for that readiness forever. One server at a time also keeps
			// kube-apiserver's egress (which reaches not-ready pods too, see the Service) off a
			// pod that has no tunnel.
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType},
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: serverPodTemplate(v, nil),
		},
	}
}

// serverPodTemplate is tendril-server's pod, with affinity (nil: none).
func serverPodTemplate(v Values, affinity *corev1.Affinity) corev1.PodTemplateSpec {
	args := []string{
		"--private-key-file=" + pathWireGuard + "/private-key",
		"--agent-public-key=" + agentPublicKeys(v.Tunnel.Agents),
		"--addresses=" + joinAddrs(v.Tunnel.ServerAddresses),
		"--agent-address=" + agentAddresses(v.Tunnel.Agents),
		"--shoot-cidrs=" + joinPrefixes(v.ShootCIDRs),
		"--tunnel-address=:" + strconv.Itoa(PortTunnel),
		"--connect-address=:" + strconv.Itoa(PortConnect),
		"--grpc-address=:" + strconv.Itoa(PortGRPC),
		"--tls-cert-file=" + pathTLS + "/tls.crt",
		"--tls-key-file=" + pathTLS + "/tls.key",
		"--client-ca-file=" + pathCA + "/bundle.crt",
		"--metrics-address=:" + strconv.Itoa(PortMetrics),
	}
	// Readiness is /readyz, "an agent's tunnel is up": kubelet carries the tunnel's state to
	// the pod's Ready condition, which the extension's health check reads. The Service
	// publishes not-ready addresses, so a server without a tunnel stays reachable for the
	// agent that brings it up.
	live, ready := probes("", PortMetrics, "/readyz")
	podLabels := map[string]string{
		v1beta1constants.LabelApp:                   ServerName,
		v1beta1constants.GardenRole:                 v1beta1constants.GardenRoleControlPlane,
		v1beta1constants.LabelPodMaintenanceRestart: "true",
	}
	t := corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{
			Labels: podLabels,
			Annotations: map[string]string{
				"prometheus.io/scrape": "true",
				"prometheus.io/port":   strconv.Itoa(PortMetrics),
			},
		},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr.To(false),
			SecurityContext:              podSecurity(),
			Affinity:                     affinity,
			PriorityClassName:            v1beta1constants.PriorityClassNameShootControlPlane500,
			Containers: []corev1.Container{{
				Name:  ServerName,
				Image: v.Image,
				// The image holds every binary; the entry point is the binary's name.
				Command: []string{"/tendril-server"},
				Args:    args,
				Ports: []corev1.ContainerPort{
					{Name: "tunnel", ContainerPort: PortTunnel, Protocol: corev1.ProtocolTCP},
					{Name: "connect", ContainerPort: PortConnect, Protocol: corev1.ProtocolTCP},
					{Name: "grpc", ContainerPort: PortGRPC, Protocol: corev1.ProtocolTCP},
					{Name: "metrics", ContainerPort: PortMetrics, Protocol: corev1.ProtocolTCP},
				},
				LivenessProbe:   live,
				ReadinessProbe:  ready,
				Resources:       requests("20m", "32Mi"),
				SecurityContext: restricted(),
				VolumeMounts: []corev1.VolumeMount{
					{Name: "wireguard", MountPath: pathWireGuard, ReadOnly: true},
					{Name: "tls", MountPath: pathTLS, ReadOnly: true},
					{Name: "ca", MountPath: pathCA, ReadOnly: true},
				},
			}},
			Volumes: []corev1.Volume{
				secretVolume("wireguard", v.Secrets.ServerWireGuard),
				secretVolume("tls", v.Secrets.ServerTLS),
				secretVolume("ca", v.Secrets.ClientCA),
			},
		},
	}
	if v.KernelTunnel {
		kernelTunnel(&t.Spec, &t.Spec.Containers[0])
	}
	return t
}

// ServerService exposes tendril-server's ports inside the seed and tells Gardener's
// resource manager (GRM) which NetworkPolicies to derive (Gardener's model: gardenlet puts
// deny-all into every shoot and extension namespace; GRM turns Service ports and the
// networking.resources.gardener.cloud annotations into allowing policies):
//   - same namespace, port p: pods labelled networking.resources.gardener.cloud/to-tendril-server-tcp-<p>
//     (the egress webhook labels kube-apiserver for the one egress port of its mode). GRM names
//     the label after the *target* port, so target ports are numbers, never names;
//   - the ingress namespace (namespace-selectors), port p: pods there labelled
//     …/to-all-shoots-tendril-server-tcp-<p> (alias all-shoots, as Gardener's kube-apiserver
//     Service); the chart gives the ingress pods only the tunnel port's label. Only the one
//     namespace is selected, not every extension namespace;
//   - metrics: the shoot's Prometheus (…/to-all-scrape-targets), Gardener's scrape-target
//     annotation, as for its own control-plane components.
//
// Shoot namespaces are never selected, so one shoot's kube-apiserver has no path to another
// shoot's tendril-server.
func ServerService(v Values) *corev1.Service {
	port := func(name string, p int32) corev1.ServicePort {
		return corev1.ServicePort{Name: name, Port: p, TargetPort: intstr.FromInt32(p), Protocol: corev1.ProtocolTCP}
	}
	svc := &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: metav1.ObjectMeta{Name: ServerName, Namespace: v.Namespace, Labels: serverLabels()},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeClusterIP,
			Selector: serverLabels(),
			// The pod is Ready only with a tunnel (/readyz); its endpoints must be published
			// before that, or the agent could never reach it to bring the tunnel up.
			PublishNotReadyAddresses: true,
			Ports: []corev1.ServicePort{
				port("tunnel", PortTunnel), port("connect", PortConnect),
				port("grpc", PortGRPC), port("metrics", PortMetrics),
			},
		},
	}
	ingressNS := v.IngressNamespace
	if ingressNS == "" {
		ingressNS = v1beta1constants.GardenNamespace
	}
	metrics := networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To(intstr.FromInt32(PortMetrics))}
	// Both only marshal fixed values; an error would be a programming error.
	utilruntime.Must(gardenerutils.InjectNetworkPolicyAnnotationsForScrapeTargets(svc, metrics))
	utilruntime.Must(gardenerutils.InjectNetworkPolicyNamespaceSelectors(svc, metav1.LabelSelector{
		MatchLabels: map[string]string{corev1.LabelMetadataName: ingressNS},
	}))
	metav1.SetMetaDataAnnotation(&svc.ObjectMeta, resourcesv1alpha1.NetworkingPodLabelSelectorNamespaceAlias, v1beta1constants.LabelNetworkPolicyShootNamespaceAlias)
	return svc
}

// IngressLabelToServerTunnel is the pod label the seed ingress needs to reach every shoot's
// tendril-server tunnel port (GRM's key for ServerService's namespace selector and alias).
func IngressLabelToServerTunnel() string {
	return resourcesv1alpha1.NetworkPolicyLabelKeyPrefix + "to-" + v1beta1constants.LabelNetworkPolicyShootNamespaceAlias + "-" + ServerName + "-tcp-" + strconv.Itoa(PortTunnel)
}

// Route is the shoot's ingress route.
func Route(v Values) *tendrilv1alpha1.Route {
	r := &tendrilv1alpha1.Route{
		TypeMeta:   metav1.TypeMeta{APIVersion: tendrilv1alpha1.SchemeGroupVersion.String(), Kind: "Route"},
		ObjectMeta: metav1.ObjectMeta{Name: RouteName, Namespace: v.Namespace},
		Spec: tendrilv1alpha1.RouteSpec{
			Hostnames:    v.Hostnames,
			APIServer:    tendrilv1alpha1.ServiceReference{Name: KubeAPIServerName, Port: PortKubeAPIServer},
			TunnelServer: &tendrilv1alpha1.ServiceReference{Name: ServerName, Port: PortTunnel},
		},
	}
	if v.AdvertisedAddress.IsValid() {
		r.Spec.AdvertisedAddress = v.AdvertisedAddress.String()
	}
	if v.PerRequest {
		r.Spec.Termination = &tendrilv1alpha1.RouteTermination{SecretName: TerminationSecretName, APIServerName: TerminationAPIServerName}
	}
	return r
}
