// Package wire spells the names tendril's control plane and data plane both speak on the wire:
// the CONNECT headers that name a request's destination at the ingress, and the destinations
// themselves (which are also the ingress's cluster names). Their form is Gardener's (its istio
// ingress gateway routes by them), so that Gardener's own clients work unchanged; this is the one
// place that spells them. It imports nothing, so that the control plane can name them without
// linking the data plane, and holds no parsing or I/O.
package wire

const (
	// GardenerDestinationHeader names the destination on the unified port (Gardener ≥ 1.130):
	// the in-cluster apiserver-proxy's CONNECTs and, there too, the VPN's.
	GardenerDestinationHeader = "X-Gardener-Destination"
	// ReversedVPNHeader is the reversed VPN's own header on its port (GEP-14).
	ReversedVPNHeader = "Reversed-VPN"
)

// APIServerWireName is the destination, and the ingress's cluster, of shoot ns's kube-apiserver.
func APIServerWireName(ns string) string {
	return "outbound|443||kube-apiserver." + ns + ".svc.cluster.local"
}

// VPNServerWireName is the destination, and the ingress's cluster, of shoot ns's VPN server
// (tendril-server).
func VPNServerWireName(ns string) string {
	return "outbound|1194||vpn-seed-server." + ns + ".svc.cluster.local"
}
