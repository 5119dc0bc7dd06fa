package v1alpha1

// XDSLeaderLabel marks the Pod of the tendril-seed replica that serves xDS (its leader): the xDS
// Service selects it (charts/tendril-seed/templates/services.yaml), the controller sets it, and
// the chart's and the network paths' checks read it. It lives with the API so that none of them
// links the control plane for a string.
const XDSLeaderLabel = "tendril.gardener.cloud/xds-leader"

// TerminationSecretLabel marks the Secrets a Route's termination names (RouteTermination): the
// control plane's cache holds only Secrets with it set to "true", not every Secret of the seed.
const TerminationSecretLabel = "tendril.gardener.cloud/termination"
