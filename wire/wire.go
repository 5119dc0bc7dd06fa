// Package wire spells the names tendril's control plane and data plane both speak on the wire:
// the CONNECT headers that name a request's destination at the ingress, and the destinations
// themselves (which are also the ingress's cluster names). Their form is Gardener's (its istio
// ingress gateway routes by them), so that Gardener's own clients work unchanged; this is the one
// place that spells them. It imports nothing, so that the control plane can name them without
// linking the data plane, and holds no parsing or I/O.
package wire

const (
	// GardenerDestinationHeader names the destination on the unified port (Gardener ≥ 1.130):
	// the in-cluster apiserver-proxy's CONNECTs, Gardener's VPN's and tendril's agents'.
	GardenerDestinationHeader = "X-Gardener-Destination"
	// ReversedVPNHeader is the reversed VPN's own header on the legacy port (GEP-14).
	ReversedVPNHeader = "Reversed-VPN"
)

// APIServerWireName is the destination, and the ingress's cluster, of shoot ns's kube-apiserver.
func APIServerWireName(ns string) string {
	return "outbound|443||kube-apiserver." + ns + ".svc.cluster.local"
}

// TendrilServerWireName is the destination, and the ingress's cluster, of shoot ns's tendril
// tunnel server, which tendril's agents dial. It is a name of its own, in the form of Istio's
// cluster names but outside Gardener's grammar: Gardener's VPN names (GardenerVPNWireName) stay
// Gardener's, so that its vpn-shoot, which gardenlet keeps deploying, reaches its own server.
func TendrilServerWireName(ns string) string {
	return "outbound|1194||tendril-server." + ns + ".svc.cluster.local"
}

// GardenerVPNWireName is the destination Gardener's vpn-shoot names for shoot ns's
// vpn-seed-server: index < 0 for the single server, otherwise the HA server of that index
// (pkg/component/networking/vpn/shoot/shoot.go, indexedReversedHeader).
func GardenerVPNWireName(ns string, index int) string {
	server := "vpn-seed-server"
	if index >= 0 {
		server += "-" + decimal(index)
	}
	return "outbound|1194||" + server + "." + ns + ".svc.cluster.local"
}

// decimal spells n ≥ 0 in base 10 (strconv would be this package's only import).
func decimal(n int) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			return string(b[i:])
		}
	}
}

// TendrilServerReplicaWireName is the destination, and the ingress's cluster, of one replica of
// shoot ns's tendril-server (an HA shoot's StatefulSet pod of that hostname, tendril-server-0):
// the pod's DNS name under the tendril-server Service, so that an agent can keep a tunnel to
// every replica.
func TendrilServerReplicaWireName(ns, hostname string) string {
	return "outbound|1194||" + hostname + ".tendril-server." + ns + ".svc.cluster.local"
}
