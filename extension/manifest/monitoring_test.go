package manifest

import (
	"regexp"
	"strconv"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
)

// keeps applies a ScrapeConfig's keep relabelings to a target's meta labels as Prometheus
// does: the source labels joined by ";" must match the whole (anchored) regex.
func keeps(t *testing.T, rcs []monitoringv1.RelabelConfig, meta map[string]string) bool {
	t.Helper()
	for _, rc := range rcs {
		if rc.Action != "keep" {
			continue
		}
		var v string
		for i, l := range rc.SourceLabels {
			if i > 0 {
				v += ";"
			}
			v += meta[string(l)]
		}
		if !regexp.MustCompile("^(?:" + rc.Regex + ")$").MatchString(v) {
			return false
		}
	}
	return true
}

// TestScrapeTargets: the ScrapeConfigs' discovery filters select the metrics ports of the
// objects the builders make (and not their other ports), so a renamed port or container
// cannot silently end the scrape.
func TestScrapeTargets(t *testing.T) {
	v := testValues()
	svc := ServerService(v)
	var kept []string
	for _, p := range svc.Spec.Ports {
		if keeps(t, ServerScrapeConfig(v).Spec.RelabelConfigs, map[string]string{
			"__meta_kubernetes_service_name": svc.Name, "__meta_kubernetes_service_port_name": p.Name,
		}) {
			kept = append(kept, p.Name)
		}
	}
	if len(kept) != 1 || kept[0] != "metrics" {
		t.Errorf("tendril-server scrape keeps ports %v, want [metrics]", kept)
	}

	// Both agents of an HA shoot are scraped (AgentObjectName(1) shares the pod name prefix).
	ha := haValues()
	for i := range tendrilv1alpha1.MaxAgents {
		dep := AgentDeployment(ha, i)
		kept = nil
		for _, c := range dep.Spec.Template.Spec.Containers {
			for _, p := range c.Ports {
				if keeps(t, AgentScrapeConfig(v).Spec.RelabelConfigs, map[string]string{
					"__meta_kubernetes_pod_name":                  dep.Name + "-5d8f7c9b4-x2x7q",
					"__meta_kubernetes_pod_container_name":        c.Name,
					"__meta_kubernetes_pod_container_port_name":   p.Name,
					"__meta_kubernetes_pod_container_port_number": strconv.Itoa(int(p.ContainerPort)),
				}) {
					kept = append(kept, c.Name+"/"+p.Name)
				}
			}
		}
		if len(kept) != 1 || kept[0] != AgentName+"/metrics" {
			t.Errorf("agent %d (%s): scrape keeps %v, want [%s/metrics]", i, dep.Name, kept, AgentName)
		}
	}
	if keeps(t, AgentScrapeConfig(v).Spec.RelabelConfigs, map[string]string{
		"__meta_kubernetes_pod_name": "vpn-shoot-0", "__meta_kubernetes_pod_container_name": AgentName,
		"__meta_kubernetes_pod_container_port_name": "metrics",
	}) {
		t.Error("agent scrape keeps another Deployment's pod")
	}
}
