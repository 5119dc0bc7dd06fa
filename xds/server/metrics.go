package server

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are Apply's; the store (xds/store) and the ADS server (xds/ads) register their own.
type metrics struct {
	shoots        prometheus.Gauge
	changes       prometheus.Counter
	applyDuration prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		shoots: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_xds_shoots", Help: "Shoots in the applied route set.",
		}),
		changes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tendril_xds_resource_changes_total", Help: "Resources written to or removed from the caches.",
		}),
		applyDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_xds_apply_seconds", Help: "Time to translate and apply a route set to the caches.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
	}
	if reg != nil {
		reg.MustRegister(m.shoots, m.changes, m.applyDuration)
	}
	return m
}
