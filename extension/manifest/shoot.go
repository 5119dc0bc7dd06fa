package manifest

import (
	"net/netip"
	"strconv"
	"strings"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/internal/host/sysctl"
	"github.com/tendril-net/tendril/wire"
)

// Agent metrics ports on the shoot side; the apiserver-proxy uses the host network, so its
// port must not collide with the kubelet's (10250…) or Gardener's node components.
const (
	portAgentMetrics = 16912
	portProxyMetrics = 16911
)

// AgentObjectName names agent i's Deployment and Secret: the first keeps the name the one
// agent always had, so a shoot that becomes highly available keeps its running agent and
// only gains tendril-agent-1.
func AgentObjectName(i int) string {
	if i == 0 {
		return AgentName
	}
	return AgentName + "-" + strconv.Itoa(i)
}

// AgentSecret carries agent i's WireGuard private key into the shoot.
func AgentSecret(v Values, i int) *corev1.Secret {
	return &corev1.Secret{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Name: AgentObjectName(i), Namespace: ShootNamespace, Labels: agentLabels(i)},
		Type:       corev1.SecretTypeOpaque,
		Data:       map[string][]byte{"private-key": []byte(v.Tunnel.Agents[i].PrivateKey)},
	}
}

// agentLabels are agent i's labels; each Deployment selects its own pods only (a Deployment's
// selector is immutable, and overlapping selectors make controllers fight over pods).
func agentLabels(i int) map[string]string {
	return map[string]string{v1beta1constants.LabelApp: AgentObjectName(i)}
}

// agentSelector selects every agent's pods, for the NetworkPolicies, the anti-affinity and the
// PodDisruptionBudget. One agent keeps the plain label selector it always had.
func agentSelector(n int) *metav1.LabelSelector {
	if n <= 1 {
		return &metav1.LabelSelector{MatchLabels: agentLabels(0)}
	}
	names := make([]string, n)
	for i := range names {
		names[i] = AgentObjectName(i)
	}
	return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
		Key: v1beta1constants.LabelApp, Operator: metav1.LabelSelectorOpIn, Values: names,
	}}}
}

// agentAntiAffinity spreads the agents over zones first and nodes second. Preferred, not
// required: a shoot with one node or one zone still runs every agent (two agents on one node
// still survive a crash or a restart of either, not the node's loss).
func agentAntiAffinity(n int) *corev1.Affinity {
	if n <= 1 {
		return nil
	}
	return spread(agentSelector(n))
}

// AgentPodDisruptionBudget lets a drain evict one agent at a time, so the tunnel always has a
// live agent to fail over to. Only with several agents: one agent's budget would have to allow
// its eviction anyway. Unhealthy agents may always be evicted: a crash-looping agent carries no
// tunnel and must not block a node's drain.
func AgentPodDisruptionBudget(v Values) *policyv1.PodDisruptionBudget {
	if len(v.Tunnel.Agents) <= 1 {
		return nil
	}
	return &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: metav1.ObjectMeta{Name: AgentName, Namespace: ShootNamespace, Labels: agentLabels(0)},
		Spec: policyv1.PodDisruptionBudgetSpec{
			MaxUnavailable:             ptr.To(intstr.FromInt32(1)),
			Selector:                   agentSelector(len(v.Tunnel.Agents)),
			UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
		},
	}
}

// AgentDeployment is agent i, `tendril-agent vpn` in the shoot's kube-system. It needs no
// API credentials, and by default no privileges: WireGuard runs in user space and the agent
// only dials out (KernelTunnel: see kernelTunnel). Each agent is its own Deployment of one
// replica, so that each pod mounts its own key.
func AgentDeployment(v Values, i int) *appsv1.Deployment {
	name, labels := AgentObjectName(i), agentLabels(i)
	args := []string{
		"vpn",
		"--private-key-file=" + pathWireGuard + "/private-key",
		"--server-public-key=" + v.Tunnel.ServerPublicKey,
		"--address=" + v.Tunnel.Agents[i].Address.String(),
		"--server-addresses=" + joinAddrs(v.Tunnel.ServerAddresses),
		"--shoot-cidrs=" + joinPrefixes(v.ShootCIDRs),
		"--seed=" + hostPort(v.Ingress, PortIngressProxy),
		"--header=" + wire.GardenerDestinationHeader,
		"--destination=" + strings.Join(ServerReplicaDestinations(v), ","),
		"--metrics-address=:" + strconv.Itoa(portAgentMetrics),
	}
	live, ready := probes("", portAgentMetrics, "/readyz")
	d := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ShootNamespace, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Replicas:             ptr.To[int32](1),
			RevisionHistoryLimit: ptr.To[int32](2),
			Selector:             &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					AutomountServiceAccountToken: ptr.To(false),
					SecurityContext:              podSecurity(),
					PriorityClassName:            v1beta1constants.PriorityClassNameShootSystem900,
					Affinity:                     agentAntiAffinity(len(v.Tunnel.Agents)),
					Containers: []corev1.Container{{
						Name:            AgentName,
						Image:           v.Image,
						Command:         []string{"/tendril-agent"},
						Args:            args,
						Ports:           []corev1.ContainerPort{{Name: "metrics", ContainerPort: portAgentMetrics, Protocol: corev1.ProtocolTCP}},
						LivenessProbe:   live,
						ReadinessProbe:  ready,
						Resources:       requests("20m", "32Mi"),
						SecurityContext: restricted(),
						VolumeMounts:    []corev1.VolumeMount{{Name: "wireguard", MountPath: pathWireGuard, ReadOnly: true}},
					}},
					Volumes: []corev1.Volume{secretVolume("wireguard", name)},
				},
			},
		},
	}
	if v.KernelTunnel {
		spec := &d.Spec.Template.Spec
		kernelTunnel(spec, &spec.Containers[0])
		// DNS into the shoot is forwarded by the kernel, which needs IP forwarding in the pod's
		// namespace; a container's /proc/sys is read-only, so a privileged init container
		// turns it on, as Gardener's vpn-shoot-init does.
		spec.InitContainers = []corev1.Container{{
			Name:            AgentName + "-sysctl",
			Image:           v.Image,
			Command:         []string{"/tendril-agent"},
			Args:            append([]string{"sysctl"}, forwardingSysctls(v.ShootCIDRs)...),
			Resources:       requests("5m", "8Mi"),
			SecurityContext: &corev1.SecurityContext{Privileged: ptr.To(true), RunAsUser: ptr.To[int64](0)},
		}}
	}
	return d
}

// forwardingSysctls are `tendril-agent sysctl`'s arguments that turn on forwarding for the
// families of prefixes.
func forwardingSysctls(prefixes []netip.Prefix) []string {
	var args []string
	for _, name := range sysctl.Forwarding(prefixes) {
		args = append(args, name+"=1")
	}
	return args
}

// APIServerProxyDaemonSet is `tendril-agent apiserver-proxy` on every node: it holds
// kube-apiserver's advertised address on a dummy link and forwards to the ingress's PROXY
// listener, so it needs the host network and NET_ADMIN.
func APIServerProxyDaemonSet(v Values) *appsv1.DaemonSet {
	labels := map[string]string{v1beta1constants.LabelApp: APIServerProxyName}
	sc := restricted()
	sc.RunAsNonRoot, sc.RunAsUser = ptr.To(false), ptr.To[int64](0)
	sc.Capabilities = &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: []corev1.Capability{"NET_ADMIN", "NET_BIND_SERVICE"}}
	// Host network, metrics on loopback: the kubelet probes from the node's own namespace.
	live, ready := probes("127.0.0.1", portProxyMetrics, "/readyz")
	return &appsv1.DaemonSet{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "DaemonSet"},
		ObjectMeta: metav1.ObjectMeta{Name: APIServerProxyName, Namespace: ShootNamespace, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector:       &metav1.LabelSelector{MatchLabels: labels},
			UpdateStrategy: appsv1.DaemonSetUpdateStrategy{Type: appsv1.RollingUpdateDaemonSetStrategyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					AutomountServiceAccountToken: ptr.To(false),
					HostNetwork:                  true,
					PriorityClassName:            "system-node-critical",
					// Every node, whatever its taints: in-cluster API traffic starts everywhere.
					Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{
						Name:    APIServerProxyName,
						Image:   v.Image,
						Command: []string{"/tendril-agent"},
						Args: []string{
							"apiserver-proxy",
							"--advertised-address=" + v.AdvertisedAddress.String(),
							"--port=" + strconv.Itoa(PortKubeAPIServer),
							"--ingress=" + hostPort(v.Ingress, PortIngressProxy),
							// CONNECT with X-Gardener-Destination, as Gardener's own apiserver-proxy
							// announces the destination since v1.123.
							"--mode=connect",
							"--namespace=" + v.Namespace,
							"--interface=tendril-api",
							"--metrics-address=127.0.0.1:" + strconv.Itoa(portProxyMetrics),
						},
						LivenessProbe:   live,
						ReadinessProbe:  ready,
						Resources:       requests("20m", "20Mi"),
						SecurityContext: sc,
					}},
				},
			},
		},
	}
}

// Names of the agent's NetworkPolicies in the shoot's kube-system, beside Gardener's
// gardener.cloud--allow-vpn and gardener.cloud--allow-from-seed of vpn-shoot.
const (
	AgentFromSeedPolicyName = "gardener.cloud--allow-from-tendril-agent"
	AgentPolicyName         = "gardener.cloud--allow-tendril-agent"
)

// AgentFromSeedNetworkPolicy admits the agent wherever Gardener's gardener.cloud--allow-from-seed
// admits vpn-shoot: into every kube-system pod labelled networking.gardener.cloud/from-seed=allowed
// (metrics-server, node-exporter, blackbox-exporter, …), all ports. vpn-shoot masquerades the
// seed's traffic to its own pod IP; the userspace agent dials from its pod IP as well, so
// without this, kubectl top, HPA and seed-side scraping break under any NetworkPolicy CNI.
// (gardener pkg/component/networking/vpn/shoot: the same selector and shape.)
func AgentFromSeedNetworkPolicy(n int) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		TypeMeta: metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: metav1.ObjectMeta{
			Name: AgentFromSeedPolicyName, Namespace: ShootNamespace, Labels: agentLabels(0),
			Annotations: map[string]string{v1beta1constants.GardenerDescription: "Allows ingress from the control plane " +
				"(through tendril-agent) to pods labeled with '" + v1beta1constants.LabelNetworkPolicyShootFromSeed + "=" +
				v1beta1constants.LabelNetworkPolicyAllowed + "'."},
		},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{
				v1beta1constants.LabelNetworkPolicyShootFromSeed: v1beta1constants.LabelNetworkPolicyAllowed,
			}},
			Ingress:     []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{PodSelector: agentSelector(n)}}}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		},
	}
}

// AgentNetworkPolicy lets the agent dial anything: the seed ingress and, for the seed, any
// shoot pod, node or Service (Gardener's gardener.cloud--allow-vpn does the same for
// vpn-shoot). It admits no ingress: the agent only dials out.
func AgentNetworkPolicy(n int) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		TypeMeta: metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: metav1.ObjectMeta{
			Name: AgentPolicyName, Namespace: ShootNamespace, Labels: agentLabels(0),
			Annotations: map[string]string{v1beta1constants.GardenerDescription: "Allows tendril-agent to reach the seed " +
				"ingress and, for the control plane, the shoot's pods, nodes and services."},
		},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: *agentSelector(n),
			Egress:      []networkingv1.NetworkPolicyEgressRule{{}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
		},
	}
}

// ShootObjects are the objects of the shoot's ManagedResource.
func ShootObjects(v Values) []client.Object {
	n := len(v.Tunnel.Agents)
	var objs []client.Object
	for i := range n {
		objs = append(objs, AgentSecret(v, i), AgentDeployment(v, i))
	}
	if pdb := AgentPodDisruptionBudget(v); pdb != nil {
		objs = append(objs, pdb)
	}
	objs = append(objs, AgentFromSeedNetworkPolicy(n), AgentNetworkPolicy(n))
	if v.APIServerProxy {
		objs = append(objs, APIServerProxyDaemonSet(v))
	}
	return objs
}

// SeedObjects are the objects in the shoot namespace of the seed (without the Route, which
// is withdrawn while hibernated). There is no NetworkPolicy: GRM derives tendril-server's from
// its Service (ServerService). The monitoring objects stay while hibernated, as Gardener's
// vpn-seed-server's do: with no server pod there is no series, so no alert fires.
func SeedObjects(v Values) []client.Object {
	objs := []client.Object{ServerWorkload(v), ServerService(v), ServerScrapeConfig(v), AgentScrapeConfig(v), PrometheusRule(v)}
	if v.ha() {
		objs = append(objs, ServerPodDisruptionBudget(v))
	}
	return objs
}

func hostPort(host string, port int) string {
	if a, err := netip.ParseAddr(host); err == nil && a.Is6() {
		return "[" + host + "]:" + strconv.Itoa(port)
	}
	return host + ":" + strconv.Itoa(port)
}
