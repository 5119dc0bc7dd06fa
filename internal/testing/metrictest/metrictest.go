// Package metrictest reads metrics back from a Prometheus registry in tests. It is imported by
// tests only and registers nothing.
package metrictest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Sum gathers g and sums the counter and gauge samples of family whose labels include every
// name and value of match (nil matches all). A family without such a sample sums to 0, as a
// labelled counter does before its first increment.
func Sum(t testing.TB, g prometheus.Gatherer, family string, match map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != family {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := match[lp.GetName()]; ok && v != lp.GetValue() {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}
