package manifest

import (
	"strconv"

	v1beta1helper "github.com/gardener/gardener/pkg/api/core/v1beta1/helper"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tendril-net/tendril/wire"
)

// HAServers is how many tendril-server replicas a highly available control plane gets: each
// agent keeps a tunnel to both, so any one server and any one agent may be lost at once
// (docs/design-notes/ha.md).
const HAServers = 2

// ServerCount is how many tendril-server replicas shoot runs: HAServers for a highly available
// control plane (any failure tolerance: its kube-apiserver is spread too), else one.
func ServerCount(shoot *gardencorev1beta1.Shoot) int {
	if shoot != nil && v1beta1helper.IsHAControlPlaneConfigured(shoot) {
		return HAServers
	}
	return 1
}

// ha reports whether tendril-server runs as several replicas.
func (v Values) ha() bool { return v.Tunnel.Servers > 1 }

// ServerWorkload is tendril-server as it runs for v: ServerDeployment for one replica,
// ServerStatefulSet for several.
func ServerWorkload(v Values) client.Object {
	if v.ha() {
		return ServerStatefulSet(v)
	}
	return ServerDeployment(v)
}

// ServerStatefulSet is tendril-server as Servers replicas, tendril-server-0 … Its pods are the
// tendril-server Service's (serviceName), so that each replica's endpoint carries its hostname,
// which the control plane turns into a route of its own (xds/kubesource) that the agents dial
// by name (ServerReplicaDestinations). Every replica runs the same key and the same agents.
// Parallel: a replica waits for no other to be Ready, which it becomes only with a tunnel. A
// rolling update replaces one replica at a time while the other carries the tunnels.
func ServerStatefulSet(v Values) *appsv1.StatefulSet {
	replicas := int32(v.Tunnel.Servers)
	if v.Hibernated {
		replicas = 0
	}
	labels := serverLabels()
	return &appsv1.StatefulSet{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "StatefulSet"},
		ObjectMeta: metav1.ObjectMeta{Name: ServerName, Namespace: v.Namespace, Labels: labels},
		Spec: appsv1.StatefulSetSpec{
			Replicas:             &replicas,
			ServiceName:          ServerName,
			PodManagementPolicy:  appsv1.ParallelPodManagement,
			RevisionHistoryLimit: ptr.To[int32](2),
			Selector:             &metav1.LabelSelector{MatchLabels: labels},
			Template:             serverPodTemplate(v, spread(&metav1.LabelSelector{MatchLabels: labels})),
		},
	}
}

// ServerPodDisruptionBudget lets a drain evict one tendril-server replica at a time; only with
// several (one replica's budget would have to allow its eviction anyway). Unhealthy replicas may
// always be evicted: one without a tunnel carries nothing.
func ServerPodDisruptionBudget(v Values) *policyv1.PodDisruptionBudget {
	return &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: metav1.ObjectMeta{Name: ServerName, Namespace: v.Namespace, Labels: serverLabels()},
		Spec: policyv1.PodDisruptionBudgetSpec{
			MaxUnavailable:             ptr.To(intstr.FromInt32(1)),
			Selector:                   &metav1.LabelSelector{MatchLabels: serverLabels()},
			UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
		},
	}
}

// spread prefers the pods selected by sel on different zones, then nodes: preferred, not
// required, so that a one-zone or one-node cluster still runs every replica.
func spread(sel *metav1.LabelSelector) *corev1.Affinity {
	term := func(weight int32, key string) corev1.WeightedPodAffinityTerm {
		return corev1.WeightedPodAffinityTerm{Weight: weight, PodAffinityTerm: corev1.PodAffinityTerm{
			LabelSelector: sel, TopologyKey: key,
		}}
	}
	return &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{
		PreferredDuringSchedulingIgnoredDuringExecution: []corev1.WeightedPodAffinityTerm{
			term(100, corev1.LabelTopologyZone), term(50, corev1.LabelHostname),
		},
	}}
}

// ServerReplicaDestinations are the agents' CONNECT destinations: every replica by its pod's
// name (wire.TendrilServerReplicaWireName) when there are several, else the server as a whole.
func ServerReplicaDestinations(v Values) []string {
	if !v.ha() {
		return []string{TunnelDestination(v.Namespace)}
	}
	out := make([]string, v.Tunnel.Servers)
	for i := range out {
		out[i] = wire.TendrilServerReplicaWireName(v.Namespace, ServerName+"-"+strconv.Itoa(i))
	}
	return out
}

// StaleSeedObjects are the seed objects of the other shape, for the actuator to delete after a
// shoot's control plane changed between one server and several: the Deployment when a
// StatefulSet runs, the StatefulSet and its budget when a Deployment does.
func StaleSeedObjects(v Values) []client.Object {
	if v.ha() {
		return []client.Object{ServerDeployment(v)}
	}
	return []client.Object{ServerStatefulSet(v), ServerPodDisruptionBudget(v)}
}
