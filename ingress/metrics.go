package ingress

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	connections  *prometheus.CounterVec
	active       *prometheus.GaugeVec
	bytes        *prometheus.CounterVec
	retries      *prometheus.CounterVec
	xdsUpdates   *prometheus.CounterVec
	xdsResources *prometheus.GaugeVec
	xdsVersion   *prometheus.GaugeVec
	drainClosed  *prometheus.CounterVec
	// memoryReleases counts the process's returns of free heap to the system (MemoryReleased).
	memoryReleases prometheus.Counter
	// procsChanges counts the binary's changes of GOMAXPROCS (ProcsChanged).
	procsChanges prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		connections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_ingress_connections_total",
			Help: "Connections by listener, cluster and outcome. The cluster is empty when none was chosen (the client's input never becomes a label).",
		}, []string{"listener", "cluster", "outcome"}),
		active: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_ingress_active_connections", Help: "Connections being proxied, by listener.",
		}, []string{"listener"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_ingress_bytes_total", Help: "Bytes proxied, by listener and direction (upstream, downstream), counted when a connection ends.",
		}, []string{"listener", "direction"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_ingress_connect_retries_total", Help: "Upstream dials retried on the next endpoint (tcp_proxy max_connect_attempts), by listener, cluster and the failed attempt's outcome.",
		}, []string{"listener", "cluster", "outcome"}),
		xdsUpdates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_ingress_xds_updates_total", Help: "xDS responses applied (ack) or rejected (nack), by type.",
		}, []string{"type", "outcome"}),
		xdsResources: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_ingress_xds_resources", Help: "Resources in the applied configuration, by type.",
		}, []string{"type"}),
		xdsVersion: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_ingress_xds_version_info", Help: "The server's version of each type as last applied (value always 1).",
		}, []string{"type", "version"}),
		drainClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_ingress_drain_closed_connections_total",
			Help: "Client connections still open at the end of the shutdown drain (--drain-timeout) and closed then, by listener.",
		}, []string{"listener"}),
		memoryReleases: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_ingress_memory_releases_total",
			Help: "Times the free heap was returned to the system after a load or a peak of connections.",
		}),
		procsChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_ingress_procs_changes_total",
			Help: "Changes of GOMAXPROCS by --adaptive-procs (the count itself: go_sched_gomaxprocs_threads).",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.connections, m.active, m.bytes, m.retries, m.xdsUpdates, m.xdsResources, m.xdsVersion, m.drainClosed, m.memoryReleases, m.procsChanges)
	}
	return m
}

func (m *metrics) conn(listener, cluster, outcome string) {
	m.connections.WithLabelValues(listener, cluster, outcome).Inc()
}
