package ads

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	responses   *prometheus.CounterVec
	sent        *prometheus.CounterVec
	acks        *prometheus.CounterVec
	clients     prometheus.Gauge
	unsupported prometheus.Counter
	refused     *prometheus.CounterVec
	isolated    *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
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
		isolated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_xds_isolated_responses_total", Help: "Refused delta responses of several resources, sent again in halves so that only the resources refused on their own stay refused, by type.",
		}, []string{"type"}),
	}
	if reg != nil {
		reg.MustRegister(m.responses, m.sent, m.acks, m.clients, m.unsupported, m.refused, m.isolated)
	}
	return m
}

// observeRequest counts ACKs and NACKs. A NACK is logged: it means a data plane rejected what
// tendril generated and keeps serving its previous configuration.
func (s *Server) observeRequest(typeURL, nonce, detail string, nack bool, node string) {
	switch {
	case nonce == "":
		return // a subscription, not an answer
	case nack:
		s.metrics.acks.WithLabelValues(typeURL, "nack").Inc()
		s.log.Info("xDS client rejected a configuration", "node", node, "type", typeURL, "nonce", nonce, "detail", detail)
	default:
		s.metrics.acks.WithLabelValues(typeURL, "ack").Inc()
	}
}
