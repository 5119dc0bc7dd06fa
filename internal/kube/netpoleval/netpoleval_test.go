package netpoleval

import (
	"net/netip"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

func pod(ns, name, ip string, l map[string]string, ports ...corev1.ContainerPort) Endpoint {
	return Endpoint{
		Name: ns + "/" + name, Namespace: ns, NamespaceLabels: map[string]string{"kubernetes.io/metadata.name": ns, "role": ns + "-role"},
		Labels: l, Ports: ports, IP: netip.MustParseAddr(ip),
	}
}

func np(ns, name string, sel map[string]string, types []networkingv1.PolicyType, in []networkingv1.NetworkPolicyIngressRule, eg []networkingv1.NetworkPolicyEgressRule) networkingv1.NetworkPolicy {
	return networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: sel}, PolicyTypes: types, Ingress: in, Egress: eg},
	}
}

var (
	both    = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}
	ingress = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
	egress  = []networkingv1.PolicyType{networkingv1.PolicyTypeEgress}
)

func tcp(p intstr.IntOrString) networkingv1.NetworkPolicyPort {
	return networkingv1.NetworkPolicyPort{Port: &p} // protocol defaults to TCP
}

func sel(l map[string]string) *metav1.LabelSelector { return &metav1.LabelSelector{MatchLabels: l} }

// TestEvaluate pins the documented semantics on hand-made cases, each with its expected verdict.
func TestEvaluate(t *testing.T) {
	a := pod("a", "client", "10.0.0.1", map[string]string{"app": "client"})
	aOther := pod("a", "other", "10.0.0.3", map[string]string{"app": "other"})
	server := pod("a", "server", "10.0.0.2", map[string]string{"app": "server"},
		corev1.ContainerPort{Name: "https", ContainerPort: 8443}, corev1.ContainerPort{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP})
	b := pod("b", "client", "10.1.0.1", map[string]string{"app": "client"})
	world := External("world", netip.MustParseAddr("203.0.113.7"))
	denyAllA := np("a", "deny-all", nil, both, nil, nil)
	toServer := func(ports ...networkingv1.NetworkPolicyPort) networkingv1.NetworkPolicy {
		return np("a", "egress-to-server", map[string]string{"app": "client"}, egress, nil,
			[]networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{PodSelector: sel(map[string]string{"app": "server"})}}, Ports: ports}})
	}
	fromClients := func(peer networkingv1.NetworkPolicyPeer, ports ...networkingv1.NetworkPolicyPort) networkingv1.NetworkPolicy {
		return np("a", "ingress-to-server", map[string]string{"app": "server"}, ingress,
			[]networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{peer}, Ports: ports}}, nil)
	}
	clientPeer := networkingv1.NetworkPolicyPeer{PodSelector: sel(map[string]string{"app": "client"})}

	cases := []struct {
		name     string
		policies []networkingv1.NetworkPolicy
		src, dst Endpoint
		proto    corev1.Protocol
		port     int32
		want     bool
	}{
		{"no policies: everything", nil, a, server, corev1.ProtocolTCP, 8443, true},
		{"deny-all", []networkingv1.NetworkPolicy{denyAllA}, a, server, corev1.ProtocolTCP, 8443, false},
		{"deny-all elsewhere does not isolate", []networkingv1.NetworkPolicy{np("b", "deny-all", nil, both, nil, nil)}, a, server, corev1.ProtocolTCP, 8443, true},
		{"egress only: ingress still denied", []networkingv1.NetworkPolicy{denyAllA, toServer()}, a, server, corev1.ProtocolTCP, 8443, false},
		{"ingress only: egress still denied", []networkingv1.NetworkPolicy{denyAllA, fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 8443, false},
		{"both sides", []networkingv1.NetworkPolicy{denyAllA, toServer(), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 8443, true},
		{"pod selector does not match", []networkingv1.NetworkPolicy{denyAllA, toServer(), fromClients(clientPeer)}, aOther, server, corev1.ProtocolTCP, 8443, false},
		{"numbered port", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromInt32(8443))), fromClients(clientPeer, tcp(intstr.FromInt32(8443)))}, a, server, corev1.ProtocolTCP, 8443, true},
		{"other port", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromInt32(8443))), fromClients(clientPeer, tcp(intstr.FromInt32(8443)))}, a, server, corev1.ProtocolTCP, 9443, false},
		{"named port resolves on the destination", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromString("https"))), fromClients(clientPeer, tcp(intstr.FromString("https")))}, a, server, corev1.ProtocolTCP, 8443, true},
		{"named port of another number", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromString("https"))), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 9443, false},
		{"named port the pod lacks", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromString("connect"))), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 8443, false},
		{"protocol: UDP rule, TCP traffic", []networkingv1.NetworkPolicy{denyAllA, toServer(networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolUDP), Port: ptr.To(intstr.FromInt32(53))}), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 53, false},
		{"protocol: UDP rule, UDP traffic", []networkingv1.NetworkPolicy{denyAllA, toServer(networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolUDP), Port: ptr.To(intstr.FromString("dns"))}), fromClients(clientPeer)}, a, server, corev1.ProtocolUDP, 53, true},
		{"endPort range", []networkingv1.NetworkPolicy{denyAllA, toServer(networkingv1.NetworkPolicyPort{Port: ptr.To(intstr.FromInt32(8000)), EndPort: ptr.To[int32](9000)}), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 8443, true},
		{"endPort range, above", []networkingv1.NetworkPolicy{denyAllA, toServer(networkingv1.NetworkPolicyPort{Port: ptr.To(intstr.FromInt32(8000)), EndPort: ptr.To[int32](9000)}), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 9443, false},
		{"pod selector alone: own namespace only", []networkingv1.NetworkPolicy{fromClients(clientPeer)}, b, server, corev1.ProtocolTCP, 8443, false},
		{"namespace AND pod selector", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{
			NamespaceSelector: sel(map[string]string{"kubernetes.io/metadata.name": "b"}), PodSelector: sel(map[string]string{"app": "client"}),
		})}, b, server, corev1.ProtocolTCP, 8443, true},
		{"namespace AND pod selector: pod differs", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{
			NamespaceSelector: sel(map[string]string{"kubernetes.io/metadata.name": "b"}), PodSelector: sel(map[string]string{"app": "other"}),
		})}, b, server, corev1.ProtocolTCP, 8443, false},
		{"namespace selector alone: every pod there", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{
			NamespaceSelector: sel(map[string]string{"role": "b-role"}),
		})}, b, server, corev1.ProtocolTCP, 8443, true},
		{"namespace selector excludes", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{
			NamespaceSelector: sel(map[string]string{"role": "b-role"}),
		})}, a, server, corev1.ProtocolTCP, 8443, false},
		{"empty from: all sources incl. world", []networkingv1.NetworkPolicy{denyAllA, np("a", "world", map[string]string{"app": "server"}, ingress,
			[]networkingv1.NetworkPolicyIngressRule{{Ports: []networkingv1.NetworkPolicyPort{tcp(intstr.FromInt32(8443))}}}, nil)}, world, server, corev1.ProtocolTCP, 8443, true},
		{"selectors never match the world", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{}})}, world, server, corev1.ProtocolTCP, 8443, false},
		{"ipBlock", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/24"}})}, world, server, corev1.ProtocolTCP, 8443, true},
		{"ipBlock except", []networkingv1.NetworkPolicy{fromClients(networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/24", Except: []string{"203.0.113.0/29"}}})}, world, server, corev1.ProtocolTCP, 8443, false},
		{"ipBlock matches pod IPs", []networkingv1.NetworkPolicy{denyAllA, np("a", "private", map[string]string{"app": "client"}, egress, nil,
			[]networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "10.0.0.0/8", Except: []string{"10.1.0.0/16"}}}}}}), fromClients(clientPeer)},
			a, server, corev1.ProtocolTCP, 8443, true},
		{"ipBlock except on pod IPs", []networkingv1.NetworkPolicy{denyAllA, np("a", "private", map[string]string{"app": "client"}, egress, nil,
			[]networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "10.0.0.0/8", Except: []string{"10.0.0.0/24"}}}}}}), fromClients(clientPeer)},
			a, server, corev1.ProtocolTCP, 8443, false},
		{"policyTypes default: egress rules make it egress", []networkingv1.NetworkPolicy{np("a", "implicit", map[string]string{"app": "client"}, nil, nil,
			[]networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{PodSelector: sel(map[string]string{"app": "nobody"})}}}})}, a, server, corev1.ProtocolTCP, 8443, false},
		{"policyTypes default: no egress rules, egress open", []networkingv1.NetworkPolicy{np("a", "implicit", map[string]string{"app": "client"}, nil, nil, nil)}, a, server, corev1.ProtocolTCP, 8443, true},
		{"policyTypes default: ingress always", []networkingv1.NetworkPolicy{np("a", "implicit", map[string]string{"app": "server"}, nil, nil, nil)}, a, server, corev1.ProtocolTCP, 8443, false},
		{"rules of several policies add up", []networkingv1.NetworkPolicy{denyAllA, toServer(tcp(intstr.FromInt32(1))), toServerRenamed(tcp(intstr.FromInt32(8443))), fromClients(clientPeer)}, a, server, corev1.ProtocolTCP, 8443, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, err := Evaluate(c.policies, c.src, c.dst, c.proto, c.port)
			if err != nil {
				t.Fatal(err)
			}
			if v.Allowed != c.want {
				t.Errorf("%s → %s %s/%d: %v, want allowed=%v", c.src.Name, c.dst.Name, c.proto, c.port, v, c.want)
			}
		})
	}
}

func toServerRenamed(ports ...networkingv1.NetworkPolicyPort) networkingv1.NetworkPolicy {
	p := np("a", "egress-to-server-2", map[string]string{"app": "client"}, egress, nil,
		[]networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{PodSelector: sel(map[string]string{"app": "server"})}}, Ports: ports}})
	return p
}

func TestEvaluateBadSelector(t *testing.T) {
	p := np("a", "bad", nil, ingress, nil, nil)
	p.Spec.PodSelector.MatchExpressions = []metav1.LabelSelectorRequirement{{Key: "x", Operator: "Bogus"}}
	src := pod("a", "c", "10.0.0.1", nil)
	if _, err := Evaluate([]networkingv1.NetworkPolicy{p}, src, src, corev1.ProtocolTCP, 1); err == nil {
		t.Error("a bad selector was accepted")
	}
}
