{{/* Names. The webhook Service's name is fixed by the egress webhook (Gardener's extensions
webhook library: gardener-extension-<name>); cluster-scoped objects follow CONV-03. */}}
{{- define "tendril.seedName" -}}gardener-extension-tendril{{- end -}}
{{- define "tendril.xdsService" -}}tendril-xds{{- end -}}
{{- /* The ingress's xDS client certificate, key and CA bundle: tendril-seed's leader writes the
Secret (--xds-client-secret), the ingress mounts it at tendril.xdsCertDir. */ -}}
{{- define "tendril.xdsClientSecret" -}}tendril-xds-client{{- end -}}
{{- define "tendril.xdsCertDir" -}}/etc/tendril/xds{{- end -}}
{{- define "tendril.ingressName" -}}tendril-ingress{{- end -}}
{{- define "tendril.clusterRoleName" -}}extensions.gardener.cloud:extension-tendril:tendril-seed{{- end -}}

{{- define "tendril.seedLabels" -}}
app: tendril-seed
app.kubernetes.io/name: tendril-seed
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tendril.ingressLabels" -}}
app: tendril-ingress
app.kubernetes.io/name: tendril-ingress
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tendril.commonLabels" -}}
app.kubernetes.io/part-of: tendril
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{/* The xDS server address the ingress dials. */}}
{{- define "tendril.xdsAddress" -}}
{{ include "tendril.xdsService" . }}.{{ .Release.Namespace }}.svc:{{ .Values.ports.xds }}
{{- end -}}

{{/* The DNS provider type of the seed-level DNSRecord: dns.provider.type, else the seed's
spec.dns.provider.type; empty when dns is disabled or no provider is known. */}}
{{- define "tendril.dnsProviderType" -}}
{{- if .Values.dns.enabled -}}
{{ .Values.dns.provider.type | default (dig "spec" "dns" "provider" "type" "" .Values.gardener.seed) }}
{{- end -}}
{{- end -}}

{{/* The seed-level DNSRecord's name, when the record is enabled: dns.name, else
tendril.<ingress domain without its first label> (outside the seed's wildcard record). */}}
{{- define "tendril.dnsRecordName" -}}
{{- if include "tendril.dnsProviderType" . -}}
{{- if .Values.dns.name -}}
{{ .Values.dns.name }}
{{- else -}}
{{- $labels := splitList "." (.Values.gardener.seed.ingressDomain | default "") -}}
{{- if lt (len $labels) 3 -}}
{{ fail (printf "tendril-seed: set dns.name: no default from gardener.seed.ingressDomain %q (want at least three labels, the first dropped)" (.Values.gardener.seed.ingressDomain | default "")) }}
{{- end -}}
tendril.{{ rest $labels | join "." }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* tendril-seed's flags for the seed-level DNSRecord; without a name and type it deletes the
record it wrote earlier. */}}
{{- define "tendril.dnsArgs" -}}
- --dns-record-name={{ include "tendril.dnsRecordName" . }}
- --dns-provider-type={{ include "tendril.dnsProviderType" . }}
- --dns-secret-name={{ .Values.dns.provider.secretName }}
- --dns-secret-namespace={{ .Values.dns.provider.secretNamespace }}
- --dns-zone={{ .Values.dns.zone }}
- --dns-ttl={{ .Values.dns.ttl }}
- --ingress-service={{ include "tendril.ingressName" . }}
{{- end -}}

{{/* The address the shoot agents dial: ingress.address, else the seed-level DNSRecord's name,
else tendril.<seed ingress domain>. */}}
{{- define "tendril.ingressAddress" -}}
{{- if .Values.ingress.address -}}
{{ .Values.ingress.address }}
{{- else if include "tendril.dnsRecordName" . -}}
{{ include "tendril.dnsRecordName" . }}
{{- else if .Values.gardener.seed.ingressDomain -}}
tendril.{{ .Values.gardener.seed.ingressDomain }}
{{- else -}}
{{ fail "tendril-seed: set ingress.address, or let gardenlet inject gardener.seed.ingressDomain" }}
{{- end -}}
{{- end -}}

{{/* The tendril image: image pinned to imageDigest when that is set (repository@sha256:…, the
tag dropped: the digest alone names the manifest, and a tag beside it would only mislead). */}}
{{- define "tendril.image" -}}
{{- with .Values.imageDigest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .) -}}
{{ fail (printf "tendril-seed: imageDigest %q: want sha256:<64 hex digits>" .) }}
{{- end -}}
{{ regexReplaceAll ":[^:/@]+$" $.Values.image "" }}@{{ . }}
{{- else -}}
{{ .Values.image }}
{{- end -}}
{{- end -}}

{{- define "tendril.engine" -}}
{{- $e := .Values.ingress.engine -}}
{{- if not (has $e (list "tendril" "envoy")) -}}
{{ fail (printf "tendril-seed: ingress.engine %q: want tendril or envoy" $e) }}
{{- end -}}
{{ $e }}
{{- end -}}

{{/* Restricted Pod Security Standard (the ControllerRegistration enforces restricted). */}}
{{- define "tendril.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop:
  - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The ingress pods' labels for Gardener's NetworkPolicies (gardenlet's deny-all, GRM's policies
derived from Services): DNS; tendril-xds's port in this namespace; in every shoot namespace
(alias all-shoots) kube-apiserver's 443 (its Service selects extension namespaces) and
tendril-server's tunnel port 1194 (its Service selects this namespace, extension/manifest
ServerService). Nothing else: no other tendril-server port. */}}
{{- define "tendril.ingressNetworkLabels" -}}
networking.gardener.cloud/to-dns: allowed
networking.resources.gardener.cloud/to-{{ include "tendril.xdsService" . }}-tcp-{{ .Values.ports.xds }}: allowed
networking.resources.gardener.cloud/to-all-shoots-kube-apiserver-tcp-443: allowed
networking.resources.gardener.cloud/to-all-shoots-tendril-server-tcp-1194: allowed
{{- if .Values.gardenerGateway }}
{{- /* Gardener's istio ingress gateway admits the extension namespaces (its Service's namespace
selectors, alias all-istio-ingresses): the relay of Gardener's CONNECTs to its unified port. */}}
networking.resources.gardener.cloud/to-all-istio-ingresses-istio-ingressgateway-tcp-8443: allowed
{{- end }}
{{- end -}}

{{/* The ingress's metrics port: Envoy's stats listener or tendril-ingress's. */}}
{{- define "tendril.ingressMetricsPort" -}}
{{- if eq (include "tendril.engine" .) "envoy" -}}{{ .Values.ingress.envoy.statsPort }}{{- else -}}{{ .Values.ingress.metricsPort }}{{- end -}}
{{- end -}}

{{/* Labels gardenlet's seed NetworkPolicies look for: DNS and the seed's API server. */}}
{{- define "tendril.networkLabels" -}}
networking.gardener.cloud/to-dns: allowed
networking.gardener.cloud/to-runtime-apiserver: allowed
{{- end -}}
