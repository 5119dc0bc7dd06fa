package egressrelay

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	connections *prometheus.CounterVec
	active      prometheus.Gauge
	bytes       *prometheus.CounterVec
	dialSeconds prometheus.Histogram
	certLoads   *prometheus.CounterVec
	attempts    *prometheus.CounterVec
	failovers   prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, r *Relay) *metrics {
	m := &metrics{
		connections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_egress_relay_connections_total",
			Help: "Connections (konnectivity tunnels and CONNECTs) from kube-apiserver, by outcome (relayed, too_many, no_certs, unavailable, timeout, not_proxy, shutdown; CONNECT: bad_request, request_timeout, request_headers_too_large, not_connect, dial_failed).",
		}, []string{"outcome"}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_egress_relay_active_connections", Help: "Tunnels being relayed.",
		}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_egress_relay_bytes_total", Help: "Bytes of gRPC messages relayed, by direction (to_server, from_server), counted when a tunnel ends.",
		}, []string{"direction"}),
		dialSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_egress_relay_dial_seconds", Help: "Time to open a stream to a tendril-server, per attempt (with a new connection: its dial and TLS handshake).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		certLoads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_egress_relay_certificate_loads_total", Help: "Loads of the client certificate and CA bundle files, by outcome (ok, failed).",
		}, []string{"outcome"}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_egress_relay_server_attempts_total",
			Help: "With several tendril-servers, attempts to carry a tunnel on one, by server and outcome (answered, refused: answered with an error; unavailable, timeout: no answer; cancelled: another server answered first or the tunnel ended).",
		}, []string{"server", "outcome"}),
		failovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_egress_relay_server_failovers_total",
			Help: "With several tendril-servers, tunnels carried by another one than the first tried (it failed, refused or did not answer in time).",
		}),
	}
	if reg != nil {
		limit := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_egress_relay_max_connections", Help: "The cap on connections relayed at once.",
		}, func() float64 { return float64(r.cfg.MaxConnections) })
		upstream := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_egress_relay_server_connections", Help: "Connections to tendril-servers that carry the tunnels (1 per server; one more while a rotated certificate's tunnels finish).",
		}, func() float64 { return float64(r.up.connections()) })
		reg.MustRegister(m.connections, m.active, m.bytes, m.dialSeconds, m.certLoads, m.attempts, m.failovers, limit, upstream)
	}
	return m
}
