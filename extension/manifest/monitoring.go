package manifest

import (
	shootprometheus "github.com/gardener/gardener/pkg/component/observability/monitoring/prometheus/shoot"
	monitoringutils "github.com/gardener/gardener/pkg/component/observability/monitoring/utils"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	monitoringv1alpha1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1alpha1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// Per-shoot monitoring, the way Gardener monitors vpn-seed-server and vpn-shoot: objects in
// the shoot namespace labelled prometheus=shoot, which the shoot's Prometheus (run by
// prometheus-operator) selects. Names follow Gardener's ConfigObjectMeta ("shoot-<name>").

// Job names: the job label of every series scraped from tendril-server and the agent; the
// rules select on them.
const (
	JobServer = ServerName
	JobAgent  = AgentName
)

// ServerMetrics are the tendril-server series the shoot's Prometheus keeps (Gardener keeps an
// allow list per job). Every rule's metric must be one of them; charts' monitoring test
// checks that the binary exports each.
var ServerMetrics = []string{
	"tendril_server_tunnel_live",
	"tendril_server_tunnel_handshake_age_seconds",
	"tendril_server_tunnel_streams_total",
	"tendril_server_tunnel_streams_active",
	"tendril_server_relay_buffers",
	"tendril_server_grpc_buffers",
	"tendril_server_tunnel_streams_detached_total",
	"tendril_server_tunnel_streams_refused_total",
	"tendril_server_tunnel_send_dropped_total",
	"tendril_server_tunnel_stack_dropped_total",
	"tendril_server_tunnel_bytes_total",
	"tendril_server_agent_live",
	"tendril_server_agent_failovers_total",
	"tendril_server_dials_total",
	"tendril_server_dial_seconds_bucket",
	"tendril_server_dial_seconds_sum",
	"tendril_server_dial_seconds_count",
	"tendril_server_active_connections",
	"tendril_server_bytes_total",
}

// AgentMetrics are the agent's series the shoot's Prometheus keeps.
var AgentMetrics = []string{
	"tendril_agent_vpn_forwarded_total",
	"tendril_agent_vpn_streams_total",
	"tendril_agent_vpn_path_timeouts_total",
	"tendril_agent_vpn_dial_errors_total",
	"tendril_agent_vpn_handshake_age_seconds",
	"tendril_agent_vpn_relay_buffers",
	"tendril_agent_vpn_stack_dropped_total",
	"tendril_agent_vpn_stack_refused_total",
}

func monitoringMeta(name, namespace string) metav1.ObjectMeta {
	return monitoringutils.ConfigObjectMeta(name, namespace, shootprometheus.Label)
}

// ServerScrapeConfig scrapes tendril-server's metrics port through its Service in the shoot
// namespace, as Gardener scrapes vpn-seed-server (kubernetes_sd role service). The Service
// already admits the shoot's Prometheus (GRM's scrape-target policy, ServerService).
func ServerScrapeConfig(v Values) *monitoringv1alpha1.ScrapeConfig {
	return &monitoringv1alpha1.ScrapeConfig{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1alpha1.SchemeGroupVersion.String(), Kind: monitoringv1alpha1.ScrapeConfigsKind},
		ObjectMeta: monitoringMeta(ServerName, v.Namespace),
		Spec: monitoringv1alpha1.ScrapeConfigSpec{
			KubernetesSDConfigs: []monitoringv1alpha1.KubernetesSDConfig{{
				Role:       monitoringv1alpha1.KubernetesRoleService,
				Namespaces: &monitoringv1alpha1.NamespaceDiscovery{Names: []string{v.Namespace}},
			}},
			RelabelConfigs: []monitoringv1.RelabelConfig{
				{Action: "replace", Replacement: ptr.To(JobServer), TargetLabel: "job"},
				{
					SourceLabels: []monitoringv1.LabelName{"__meta_kubernetes_service_name", "__meta_kubernetes_service_port_name"},
					Action:       "keep",
					Regex:        ServerName + ";metrics",
				},
			},
			MetricRelabelConfigs: monitoringutils.StandardMetricRelabelConfig(ServerMetrics...),
		},
	}
}

// AgentScrapeConfig scrapes the agent in the shoot's kube-system through the shoot's
// kube-apiserver pod proxy (/api/v1/namespaces/kube-system/pods/<pod>:<port>/proxy/metrics),
// Gardener's own spec for components inside the shoot (as for vpn-shoot). The proxy request
// reaches the pod over tendril's tunnel, so these series stop when the tunnel is down; the
// tunnel alerts therefore come from tendril-server.
func AgentScrapeConfig(v Values) *monitoringv1alpha1.ScrapeConfig {
	return &monitoringv1alpha1.ScrapeConfig{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1alpha1.SchemeGroupVersion.String(), Kind: monitoringv1alpha1.ScrapeConfigsKind},
		ObjectMeta: monitoringMeta(AgentName, v.Namespace),
		Spec: shootprometheus.ClusterComponentScrapeConfigSpec(JobAgent, shootprometheus.KubernetesServiceDiscoveryConfig{
			Role:              monitoringv1alpha1.KubernetesRolePod,
			PodNamePrefix:     AgentName,
			ContainerName:     AgentName,
			ContainerPortName: "metrics",
		}, AgentMetrics...),
	}
}

// Alert durations: long enough to ride out a tendril-server restart (Recreate: the agent
// reconnects within its backoff, well under a minute) and a kube-apiserver rollout.
const (
	forTunnelDown    = monitoringv1.Duration("5m")
	forDialsFailing  = monitoringv1.Duration("10m")
	dialFailureRatio = "0.1" // a tenth of egress dials failing is no longer a few dead targets
)

func rule(alert, expr string, forDur monitoringv1.Duration, severity, summary, description string) monitoringv1.Rule {
	return monitoringv1.Rule{
		Alert: alert,
		Expr:  intstr.FromString(expr),
		For:   ptr.To(forDur),
		Labels: map[string]string{
			"service":    "tendril",
			"severity":   severity,
			"type":       "seed",
			"visibility": "operator",
		},
		Annotations: map[string]string{"summary": summary, "description": description},
	}
}

// PrometheusRule holds the per-shoot alerts: the tunnel is down, and egress (kube-apiserver
// to the shoot) dials fail in tendril-server or, past the tunnel, in the agent.
func PrometheusRule(v Values) *monitoringv1.PrometheusRule {
	return &monitoringv1.PrometheusRule{
		TypeMeta:   metav1.TypeMeta{APIVersion: monitoringv1.SchemeGroupVersion.String(), Kind: monitoringv1.PrometheusRuleKind},
		ObjectMeta: monitoringMeta("tendril", v.Namespace),
		Spec: monitoringv1.PrometheusRuleSpec{Groups: []monitoringv1.RuleGroup{{
			Name: "tendril.rules",
			Rules: []monitoringv1.Rule{
				rule("TendrilTunnelDown",
					`max(tendril_server_tunnel_live{job="`+JobServer+`"}) == 0`,
					forTunnelDown, "critical", "tendril tunnel down",
					"No agent's tunnel to tendril-server is live: kube-apiserver cannot reach the shoot's nodes, pods and services (logs, exec, port-forward, webhooks)."),
				rule("TendrilEgressDialsFailing",
					`sum(rate(tendril_server_dials_total{job="`+JobServer+`",outcome=~"dial_failed|dial_timeout"}[5m]))`+
						` / sum(rate(tendril_server_dials_total{job="`+JobServer+`"}[5m])) > `+dialFailureRatio,
					forDialsFailing, "warning", "tendril egress dials failing",
					"More than 10% of kube-apiserver's connections into the shoot fail to dial through tendril-server."),
				rule("TendrilAgentForwardsFailing",
					`sum(rate(tendril_agent_vpn_forwarded_total{job="`+JobAgent+`",outcome=~"dial_failed|udp_dial_failed"}[5m]))`+
						` / sum(rate(tendril_agent_vpn_forwarded_total{job="`+JobAgent+`"}[5m])) > `+dialFailureRatio,
					forDialsFailing, "warning", "tendril agent cannot reach shoot targets",
					"More than 10% of the connections the agent forwards into the shoot fail to dial their target."),
			},
		}}},
	}
}
