// Package netpoleval decides whether Kubernetes NetworkPolicies admit a connection, by the
// semantics the networking.k8s.io/v1 API documents, where no CNI enforces them: envtest stores
// NetworkPolicies but enforces none, so the path tests (extension/networkpaths) and tendril-local's
// own check of a local seed's paths (make run) judge them here. No image binary links it, and it
// opens no connection: the real seed's test checks its verdicts against kube-router.
//
// The rules implemented:
//   - A connection needs both sides: the source pod's egress and the destination pod's
//     ingress. A side outside the cluster (no pod) has no policies.
//   - A pod is isolated for a direction when some policy in its namespace selects it and has
//     that policy type; policyTypes defaults to Ingress, plus Egress when egress rules exist.
//     A pod not isolated for a direction allows everything there.
//   - An isolated pod allows what any rule of any selecting policy allows. A rule with no
//     peers matches every peer; no ports, every port.
//   - A peer with podSelector and namespaceSelector matches pods that satisfy both; with
//     podSelector only, pods of the policy's own namespace; with namespaceSelector only, every
//     pod in those namespaces. An ipBlock matches addresses in cidr and in no except, for
//     external peers and pods alike (CNIs such as Calico match pod IPs too).
//   - A port matches when the protocol matches (default TCP) and the number does, endPort
//     making it a range; a named port resolves against the destination pod's container ports
//     (name and protocol), for ingress and egress rules alike.
package netpoleval

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Endpoint is one end of a connection: a pod (Namespace set) or an address outside the
// cluster (Namespace empty).
type Endpoint struct {
	// Name is for verdicts only.
	Name string
	// Namespace and NamespaceLabels are the pod's namespace; empty for an external address.
	Namespace       string
	NamespaceLabels map[string]string
	// Labels and Ports are the pod's labels and container ports.
	Labels map[string]string
	Ports  []corev1.ContainerPort
	// IP is the pod's or the external address.
	IP netip.Addr
}

// Pod is the Endpoint of pod in namespace ns.
func Pod(pod *corev1.Pod, ns *corev1.Namespace) Endpoint {
	e := Endpoint{
		Name: pod.Namespace + "/" + pod.Name, Namespace: pod.Namespace, NamespaceLabels: ns.Labels,
		Labels: pod.Labels,
	}
	for _, c := range pod.Spec.Containers {
		e.Ports = append(e.Ports, c.Ports...)
	}
	if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
		e.IP = a
	}
	return e
}

// External is an address outside the cluster.
func External(name string, ip netip.Addr) Endpoint { return Endpoint{Name: name, IP: ip} }

func (e Endpoint) isPod() bool { return e.Namespace != "" }

// Verdict says whether a connection is admitted and which policies decided each side.
type Verdict struct {
	Allowed bool
	// Egress and Ingress describe each side: "outside the cluster", "not isolated",
	// "allowed by <policies>" or "denied (…)".
	Egress, Ingress string
}

func (v Verdict) String() string {
	return fmt.Sprintf("allowed=%v egress: %s; ingress: %s", v.Allowed, v.Egress, v.Ingress)
}

// Evaluate decides whether src may open a connection to dst on protocol/port under policies.
func Evaluate(policies []networkingv1.NetworkPolicy, src, dst Endpoint, protocol corev1.Protocol, port int32) (Verdict, error) {
	eg, egOK, err := side(policies, src, dst, protocol, port, networkingv1.PolicyTypeEgress)
	if err != nil {
		return Verdict{}, err
	}
	in, inOK, err := side(policies, dst, src, protocol, port, networkingv1.PolicyTypeIngress)
	if err != nil {
		return Verdict{}, err
	}
	return Verdict{Allowed: egOK && inOK, Egress: eg, Ingress: in}, nil
}

// side judges one direction at pod self, with peer the other end; for either direction the
// port belongs to the destination (dst of the connection).
func side(policies []networkingv1.NetworkPolicy, self, peer Endpoint, protocol corev1.Protocol, port int32, dir networkingv1.PolicyType) (string, bool, error) {
	if !self.isPod() {
		return "outside the cluster", true, nil
	}
	dst := self
	if dir == networkingv1.PolicyTypeEgress {
		dst = peer
	}
	var isolating, allowing []string
	for i := range policies {
		p := &policies[i]
		if p.Namespace != self.Namespace || !hasType(p, dir) {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		if err != nil {
			return "", false, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, err)
		}
		if !sel.Matches(labels.Set(self.Labels)) {
			continue
		}
		isolating = append(isolating, p.Name)
		ok, err := anyRule(p, dir, peer, dst, protocol, port)
		if err != nil {
			return "", false, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, err)
		}
		if ok {
			allowing = append(allowing, p.Name)
		}
	}
	switch {
	case len(isolating) == 0:
		return "not isolated", true, nil
	case len(allowing) > 0:
		slices.Sort(allowing)
		return "allowed by " + strings.Join(allowing, ","), true, nil
	default:
		return fmt.Sprintf("denied (%d policies select it, none admits)", len(isolating)), false, nil
	}
}

func hasType(p *networkingv1.NetworkPolicy, t networkingv1.PolicyType) bool {
	if len(p.Spec.PolicyTypes) > 0 {
		return slices.Contains(p.Spec.PolicyTypes, t)
	}
	// The API server's default: Ingress always, Egress when there are egress rules.
	return t == networkingv1.PolicyTypeIngress || len(p.Spec.Egress) > 0
}

func anyRule(p *networkingv1.NetworkPolicy, dir networkingv1.PolicyType, peer, dst Endpoint, protocol corev1.Protocol, port int32) (bool, error) {
	type rule struct {
		peers []networkingv1.NetworkPolicyPeer
		ports []networkingv1.NetworkPolicyPort
	}
	var rules []rule
	if dir == networkingv1.PolicyTypeIngress {
		for _, r := range p.Spec.Ingress {
			rules = append(rules, rule{r.From, r.Ports})
		}
	} else {
		for _, r := range p.Spec.Egress {
			rules = append(rules, rule{r.To, r.Ports})
		}
	}
	for _, r := range rules {
		peerOK := len(r.peers) == 0
		for _, pp := range r.peers {
			ok, err := peerMatches(pp, p.Namespace, peer)
			if err != nil {
				return false, err
			}
			peerOK = peerOK || ok
		}
		if peerOK && portsMatch(r.ports, dst, protocol, port) {
			return true, nil
		}
	}
	return false, nil
}

func peerMatches(pp networkingv1.NetworkPolicyPeer, policyNamespace string, peer Endpoint) (bool, error) {
	if pp.IPBlock != nil {
		return ipBlockMatches(pp.IPBlock, peer.IP)
	}
	if !peer.isPod() {
		return false, nil // pod and namespace selectors select pods only
	}
	if pp.NamespaceSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(pp.NamespaceSelector)
		if err != nil {
			return false, err
		}
		if !sel.Matches(labels.Set(peer.NamespaceLabels)) {
			return false, nil
		}
	} else if peer.Namespace != policyNamespace {
		return false, nil
	}
	if pp.PodSelector == nil {
		return true, nil
	}
	sel, err := metav1.LabelSelectorAsSelector(pp.PodSelector)
	if err != nil {
		return false, err
	}
	return sel.Matches(labels.Set(peer.Labels)), nil
}

func ipBlockMatches(b *networkingv1.IPBlock, ip netip.Addr) (bool, error) {
	if !ip.IsValid() {
		return false, nil
	}
	cidr, err := netip.ParsePrefix(b.CIDR)
	if err != nil {
		return false, fmt.Errorf("ipBlock cidr: %w", err)
	}
	if !cidr.Contains(ip) {
		return false, nil
	}
	for _, e := range b.Except {
		ex, err := netip.ParsePrefix(e)
		if err != nil {
			return false, fmt.Errorf("ipBlock except: %w", err)
		}
		if ex.Contains(ip) {
			return false, nil
		}
	}
	return true, nil
}

func portsMatch(ports []networkingv1.NetworkPolicyPort, dst Endpoint, protocol corev1.Protocol, port int32) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		proto := cmp.Or(ptrOr(p.Protocol, ""), corev1.ProtocolTCP)
		if proto != protocol {
			continue
		}
		if p.Port == nil {
			return true
		}
		if p.Port.Type == intstr.String {
			// A named port is the destination pod's container port of that name and protocol.
			if slices.ContainsFunc(dst.Ports, func(c corev1.ContainerPort) bool {
				return c.Name == p.Port.StrVal && cmp.Or(c.Protocol, corev1.ProtocolTCP) == protocol && c.ContainerPort == port
			}) {
				return true
			}
			continue
		}
		end := p.Port.IntVal
		if p.EndPort != nil {
			end = *p.EndPort
		}
		if port >= p.Port.IntVal && port <= end {
			return true
		}
	}
	return false
}

func ptrOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}
