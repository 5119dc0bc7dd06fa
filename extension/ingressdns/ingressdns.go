// Package ingressdns points DNS names at tendril's shared ingress: the seed-level DNSRecord for
// the name the shoot agents dial (SeedRecord) and a webhook that points the api.* DNSRecords of
// shoots using tendril at the ingress (NewWebhook). Both take the address from the ingress
// Service's load-balancer status. docs/design-notes/dns.md says why it is built this way.
package ingressdns

import (
	"net/netip"
	"slices"

	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
)

// Defaults shared with the seed chart.
const (
	// ServiceName is the shared ingress's LoadBalancer Service (charts/tendril-seed
	// "tendril.ingressName").
	ServiceName = "tendril-ingress"
	// RecordName is the seed-level DNSRecord's object name in GardenNamespace.
	RecordName = "tendril-ingress"
	// GardenNamespace holds DNSRecords that belong to the seed, not to a shoot (GEN-17).
	GardenNamespace = "garden"
	// DefaultTTL is the provider extensions' default (DNS-01), written explicitly so the
	// record's spec says what the provider serves.
	DefaultTTL = 120
)

// Ingress is the address of a LoadBalancer Service: its IPs by family and its host name.
type Ingress struct {
	IPv4, IPv6 []string
	Hostname   string
}

// IngressOf reads the Service's load-balancer status. IPs are sorted, so the same status gives
// the same record; the first host name counts (a CNAME holds one value).
func IngressOf(svc *corev1.Service) Ingress {
	var in Ingress
	for _, i := range svc.Status.LoadBalancer.Ingress {
		if a, err := netip.ParseAddr(i.IP); err == nil {
			if a.Unmap().Is4() {
				in.IPv4 = append(in.IPv4, a.Unmap().String())
			} else {
				in.IPv6 = append(in.IPv6, a.String())
			}
		}
		if i.Hostname != "" && in.Hostname == "" {
			in.Hostname = i.Hostname
		}
	}
	slices.Sort(in.IPv4)
	in.IPv4 = slices.Compact(in.IPv4)
	slices.Sort(in.IPv6)
	in.IPv6 = slices.Compact(in.IPv6)
	return in
}

// Empty reports whether the load balancer has no address yet.
func (in Ingress) Empty() bool {
	return len(in.IPv4) == 0 && len(in.IPv6) == 0 && in.Hostname == ""
}

// Record is the record type and values that name the ingress on its own: IPv4 addresses (A)
// when the load balancer has any, else IPv6 (AAAA), else its host name (CNAME), the order in
// which Gardener's GetDNSRecordType maps an address. ok is false while there is no address.
func (in Ingress) Record() (t extensionsv1alpha1.DNSRecordType, values []string, ok bool) {
	for _, t := range []extensionsv1alpha1.DNSRecordType{extensionsv1alpha1.DNSRecordTypeA, extensionsv1alpha1.DNSRecordTypeAAAA, extensionsv1alpha1.DNSRecordTypeCNAME} {
		if v := in.Values(t); len(v) > 0 {
			return t, v, true
		}
	}
	return "", nil, false
}

// Values are the ingress's values for a record of type t (nil when it has none of that kind).
func (in Ingress) Values(t extensionsv1alpha1.DNSRecordType) []string {
	switch t {
	case extensionsv1alpha1.DNSRecordTypeA:
		return slices.Clone(in.IPv4)
	case extensionsv1alpha1.DNSRecordTypeAAAA:
		return slices.Clone(in.IPv6)
	case extensionsv1alpha1.DNSRecordTypeCNAME:
		if in.Hostname != "" {
			return []string{in.Hostname}
		}
	}
	return nil
}

// Webhook results (label "result" of tendril_dnsrecord_webhook_requests_total).
const (
	// ResultPointed: the record's values are the ingress's (changed or already so).
	ResultPointed = "pointed"
	// ResultNotAPIRecord: not the shoot's internal or external api.* record.
	ResultNotAPIRecord = "not_api_record"
	// ResultNoExtension: the namespace has no tendril Extension, or it is being deleted.
	ResultNoExtension = "no_extension"
	// ResultNotReady: the tendril Extension's first reconcile has not succeeded yet.
	ResultNotReady = "extension_not_ready"
	// ResultNoAddress: the ingress has no address of the record's type (not yet, or the load
	// balancer gives a host name where gardenlet wrote an IP, or the other way round).
	ResultNoAddress = "no_ingress_address"
	// ResultDeleting: the record is being deleted; its spec is immutable.
	ResultDeleting = "record_deleting"
	// ResultError: reading the Extension, Cluster or Service failed; the write is refused.
	ResultError = "error"
)

// Metrics counts the webhook's decisions. The zero value counts nothing.
type Metrics struct {
	requests *prometheus.CounterVec
}

// NewMetrics registers the counters with reg (nil: kept, not registered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{requests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_dnsrecord_webhook_requests_total",
		Help: "DNSRecord admission requests by result: pointed at the ingress, or passed unchanged (or refused: error) and why.",
	}, []string{"result"})}
	if reg != nil {
		if err := reg.Register(m.requests); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) count(result string) {
	if m != nil && m.requests != nil {
		m.requests.WithLabelValues(result).Inc()
	}
}
