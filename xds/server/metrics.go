package server

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	shoots        prometheus.Gauge
	resources     *prometheus.GaugeVec
	changes       prometheus.Counter
	applyDuration prometheus.Histogram
	responses     *prometheus.CounterVec
	sent          *prometheus.CounterVec
	acks          *prometheus.CounterVec
	clients       prometheus.Gauge
	unsupported   prometheus.Counter
	refused       *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		shoots: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_xds_shoots", Help: "Shoots in the applied route set.",
		}),
		resources: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_xds_resources", Help: "Resources in the cache, by type.",
		}, []string{"type"}),
		changes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_xds_resource_changes_total", Help: "Resources written to or removed from the caches.",
		}),
		applyDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_xds_apply_seconds", Help: "Time to translate and apply a route set to the caches.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
		responses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_xds_responses_total", Help: "xDS responses sent, by protocol and type.",
		}, []string{"protocol", "type"}),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_xds_resources_sent_total", Help: "Resources sent in xDS responses, by protocol and type.",
		}, []string{"protocol", "type"}),
		acks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_xds_acks_total", Help: "xDS responses answered by clients, by type and outcome (ack, nack).",
		}, []string{"type", "outcome"}),
		clients: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_xds_synced_clients", Help: "Delta clients that answered their first response of every type; the clients a shoot's Programmed status counts.",
		}),
		// No type label: the type is the client's input.
		unsupported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_xds_unsupported_requests_total", Help: "xDS requests for a resource type tendril does not serve, ignored.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_xds_refused_total", Help: "xDS clients refused: TLS handshakes by the client certificate (no_certificate, untrusted_certificate) and streams by their node (no_node, node_mismatch).",
		}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.shoots, m.resources, m.changes, m.applyDuration, m.responses, m.sent, m.acks, m.clients, m.unsupported, m.refused)
	}
	return m
}
