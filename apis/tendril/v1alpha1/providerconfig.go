package v1alpha1

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// ProviderConfigKind is the kind of the Extension's providerConfig.
const ProviderConfigKind = "ProviderConfig"

// EgressMode is how kube-apiserver sends its EgressSelector `cluster` traffic to tendril-server.
type EgressMode string

const (
	// EgressHTTPConnect is HTTP CONNECT over mutual TLS (tendril-server port 9443): a TCP
	// connection and a TLS handshake per dial, no sidecar.
	EgressHTTPConnect EgressMode = "httpConnect"
	// EgressHTTPConnectRelay is HTTP CONNECT over a Unix socket to the tendril-egress-relay
	// sidecar in kube-apiserver's pod, which makes each CONNECT a stream of its one long-lived
	// mutual-TLS gRPC connection to tendril-server (port 8090): a dial costs no TCP or TLS
	// handshake (2.2–3× the dials per second of httpConnect on two cores, docs/performance.md).
	// The sidecar is a native sidecar (an init container with restartPolicy Always), which the
	// seed's Kubernetes must support (1.29 and later).
	EgressHTTPConnectRelay EgressMode = "httpConnectRelay"
	// EgressGRPC is the konnectivity gRPC ProxyService (tendril-server port 8090). kube-apiserver
	// dials gRPC egress only over a Unix socket, so the control-plane webhook adds the
	// tendril-egress-relay sidecar to its pod, which carries the socket's connections as
	// streams of one mutual-TLS connection to tendril-server.
	EgressGRPC EgressMode = "grpc"
)

// EgressModes are the supported egress modes.
var EgressModes = []EgressMode{EgressHTTPConnect, EgressHTTPConnectRelay, EgressGRPC}

// Relayed reports whether the mode goes through the tendril-egress-relay sidecar (and so to
// tendril-server's gRPC port).
func (m EgressMode) Relayed() bool {
	return m == EgressGRPC || m == EgressHTTPConnectRelay
}

// ProviderConfig is the shoot owner's configuration of the tendril Extension
// (Extension.spec.providerConfig). Its zero value is the default: HTTP CONNECT egress and no
// apiserver-proxy agent.
//
// +kubebuilder:object:root=true
// +kubebuilder:skipversion
type ProviderConfig struct {
	metav1.TypeMeta `json:",inline"`

	// APIServerProxy deploys the apiserver-proxy agent (a DaemonSet on every node) that sends
	// in-cluster API traffic to the ingress's PROXY-protocol listener.
	//
	// +optional
	APIServerProxy *APIServerProxy `json:"apiserverProxy,omitempty"`

	// Egress selects kube-apiserver's egress front-end: httpConnect (the default), httpConnectRelay
	// (the default of a highly available control plane, whose tendril-server runs two replicas)
	// or grpc.
	//
	// +optional
	Egress EgressMode `json:"egress,omitempty"`

	// HighAvailability overrides how many tunnel agents run in the shoot. Without it, a shoot
	// whose control plane is highly available (spec.controlPlane.highAvailability) gets
	// MaxAgents, any other one agent.
	//
	// +optional
	HighAvailability *HighAvailability `json:"highAvailability,omitempty"`

	// Tunnel configures the reversed tunnel between tendril-server and the agents.
	//
	// +optional
	Tunnel *Tunnel `json:"tunnel,omitempty"`

	// KubeAPIServer configures how the shoot's kube-apiserver replicas share their clients.
	//
	// +optional
	KubeAPIServer *KubeAPIServer `json:"kubeAPIServer,omitempty"`
}

// MaxGoAwayChance is the largest --goaway-chance kube-apiserver accepts (it refuses to start
// above it).
const MaxGoAwayChance = 0.02

// KubeAPIServer configures the shoot's kube-apiserver replicas.
type KubeAPIServer struct {
	// GoAwayChance is kube-apiserver's --goaway-chance, a decimal above 0 and at most 0.02: the
	// probability that a replica ends an HTTP/2 client's connection after answering a request
	// (a GOAWAY; watches and other long-running requests in flight go on). The client sends
	// its next requests over a new connection, which the ingress gives to the next replica.
	// SNI passthrough balances connections, not requests: without it a client-go client, whose
	// requests share one HTTP/2 connection, sends every request to the replica that connection
	// reached. Kubernetes suggests 0.001 to start with. Unset: the seed's default (tendril-seed
	// --goaway-chance, for shoots balanced per connection), else kube-apiserver's (none); "0":
	// none, whatever the seed's default.
	//
	// +optional
	GoAwayChance string `json:"goAwayChance,omitempty"`
	// Balancing is how the ingress spreads the shoot's API traffic over the kube-apiserver
	// replicas: PerConnection (the default) passes TLS through and balances connections;
	// PerRequest terminates TLS at the ingress with kube-apiserver's serving certificate and
	// sends each request to the replica with the fewest in flight, over HTTP/2 with a
	// front-proxy client certificate (what Gardener's IstioTLSTermination does at its gateway).
	//
	// +optional
	Balancing Balancing `json:"balancing,omitempty"`
}

// Balancing is a KubeAPIServer.Balancing mode.
type Balancing string

const (
	BalancingPerConnection Balancing = "PerConnection"
	BalancingPerRequest    Balancing = "PerRequest"
)

// PerRequest reports whether the shoot's API traffic is balanced per request.
func (c *ProviderConfig) PerRequest() bool {
	return c != nil && c.KubeAPIServer != nil && c.KubeAPIServer.Balancing == BalancingPerRequest
}

// GoAwayChance is the configured --goaway-chance in kube-apiserver's flag syntax, "" when
// unset or "0". It is only meaningful for a validated ProviderConfig.
func (c *ProviderConfig) GoAwayChance() string {
	return c.GoAwayChanceWith("")
}

// GoAwayChanceWith is the --goaway-chance the shoot's kube-apiserver gets when the seed's
// default is seedDefault (a value ValidGoAwayChance accepts, or ""): the providerConfig's own,
// none for "0", and seedDefault when it sets none and the shoot is balanced per connection (a
// shoot balanced per request is spread by the ingress; a GOAWAY would only cost it
// reconnections). It is only meaningful for a validated ProviderConfig.
func (c *ProviderConfig) GoAwayChanceWith(seedDefault string) string {
	own := ""
	if c != nil && c.KubeAPIServer != nil {
		own = c.KubeAPIServer.GoAwayChance
	}
	if own == "" {
		if c.PerRequest() {
			return ""
		}
		own = seedDefault
	}
	v, err := strconv.ParseFloat(own, 64)
	if err != nil || v == 0 {
		return ""
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// ValidGoAwayChance reports whether s is a --goaway-chance kube-apiserver accepts and that
// asks for one: a decimal above 0 and at most MaxGoAwayChance (NaN and ±Inf parse, and fail
// the range).
func ValidGoAwayChance(s string) bool {
	v, err := strconv.ParseFloat(s, 64)
	return err == nil && v > 0 && v <= MaxGoAwayChance
}

// TunnelStack is the TCP/IP stack the tunnel's two ends run on.
type TunnelStack string

const (
	// TunnelStackUserspace is gVisor's TCP/IP stack inside tendril-server and the agents: no
	// privileges (the default).
	TunnelStackUserspace TunnelStack = "userspace"
	// TunnelStackKernel is a TUN device and the kernel's TCP/IP stack at both ends, as
	// Gardener's vpn-seed-server and vpn-shoot run: both containers run as root with NET_ADMIN
	// and the node's /dev/net/tun, and the agent's pod gets a privileged init container that
	// turns on IP forwarding (DNS into the shoot is forwarded by the kernel). Bulk transfers
	// gain 5–30 % on a two-core machine (docs/performance.md).
	TunnelStackKernel TunnelStack = "kernel"
)

// Tunnel configures the reversed tunnel.
type Tunnel struct {
	// Stack is userspace (default) or kernel.
	//
	// +optional
	Stack TunnelStack `json:"stack,omitempty"`
}

// MaxAgents is the most tunnel agents a shoot runs: one per failure domain of a highly
// available control plane is two (Gardener's HA control planes tolerate the loss of one zone
// or node), and each agent costs tendril-server a WireGuard peer and a keepalive per second.
const MaxAgents = 2

// HighAvailability configures the shoot-side tunnel agents.
type HighAvailability struct {
	// Agents is the number of tunnel agents, each with its own WireGuard key and address:
	// 1 or MaxAgents.
	Agents int32 `json:"agents"`
}

// APIServerProxy configures the shoot-side apiserver-proxy agent.
type APIServerProxy struct {
	// Enabled deploys the agent.
	Enabled bool `json:"enabled"`
}

// APIServerProxyEnabled reports whether the apiserver-proxy agent is wanted.
func (c *ProviderConfig) APIServerProxyEnabled() bool {
	return c != nil && c.APIServerProxy != nil && c.APIServerProxy.Enabled
}

// EgressOrDefault is the configured egress mode, httpConnect when unset.
func (c *ProviderConfig) EgressOrDefault() EgressMode {
	if c == nil || c.Egress == "" {
		return EgressHTTPConnect
	}
	return c.Egress
}

// EgressFor is the configured egress mode; when unset, httpConnectRelay for a shoot whose
// tendril-server runs several replicas (its relay sidecar dials each replica by name and uses a
// live one, where kube-apiserver dialling the Service itself would wait on a lost node's pod
// until the node is marked unreachable), else httpConnect.
func (c *ProviderConfig) EgressFor(severalServers bool) EgressMode {
	if (c == nil || c.Egress == "") && severalServers {
		return EgressHTTPConnectRelay
	}
	return c.EgressOrDefault()
}

// AgentsOr is the configured number of agents, or def when the config does not say.
func (c *ProviderConfig) AgentsOr(def int) int {
	if c == nil || c.HighAvailability == nil {
		return def
	}
	return int(c.HighAvailability.Agents)
}

// TunnelStackOrDefault is the configured tunnel stack, userspace when unset.
func (c *ProviderConfig) TunnelStackOrDefault() TunnelStack {
	if c == nil || c.Tunnel == nil || c.Tunnel.Stack == "" {
		return TunnelStackUserspace
	}
	return c.Tunnel.Stack
}

// DecodeProviderConfig decodes raw strictly (unknown fields are errors, so a typo does not
// silently fall back to a default) and validates it. Empty raw is the default config.
// Errors are field errors so the reconciler can report ERR_CONFIGURATION_PROBLEM.
func DecodeProviderConfig(raw []byte) (*ProviderConfig, field.ErrorList) {
	root := field.NewPath("spec", "providerConfig")
	cfg := &ProviderConfig{}
	if len(bytes.TrimSpace(raw)) == 0 {
		return cfg, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cfg); err != nil {
		return nil, field.ErrorList{field.Invalid(root, string(raw), fmt.Sprintf("cannot decode: %v", err))}
	}
	if dec.More() {
		return nil, field.ErrorList{field.Invalid(root, string(raw), "trailing data after the object")}
	}
	return cfg, ValidateProviderConfig(cfg, root)
}

// ValidateProviderConfig checks a decoded ProviderConfig.
func ValidateProviderConfig(c *ProviderConfig, root *field.Path) field.ErrorList {
	var errs field.ErrorList
	if c.APIVersion != "" && c.APIVersion != SchemeGroupVersion.String() {
		errs = append(errs, field.NotSupported(root.Child("apiVersion"), c.APIVersion, []string{SchemeGroupVersion.String()}))
	}
	if c.Kind != "" && c.Kind != ProviderConfigKind {
		errs = append(errs, field.NotSupported(root.Child("kind"), c.Kind, []string{ProviderConfigKind}))
	}
	if c.Egress != "" && !slices.Contains(EgressModes, c.Egress) {
		errs = append(errs, field.NotSupported(root.Child("egress"), c.Egress, EgressModes))
	}
	if t := c.Tunnel; t != nil {
		switch t.Stack {
		case "", TunnelStackUserspace, TunnelStackKernel:
		default:
			errs = append(errs, field.NotSupported(root.Child("tunnel", "stack"), t.Stack, []TunnelStack{TunnelStackUserspace, TunnelStackKernel}))
		}
	}
	if k := c.KubeAPIServer; k != nil && k.GoAwayChance != "" && k.GoAwayChance != "0" && !ValidGoAwayChance(k.GoAwayChance) {
		errs = append(errs, field.Invalid(root.Child("kubeAPIServer", "goAwayChance"), k.GoAwayChance,
			fmt.Sprintf(`must be a decimal above 0 and at most %g, or "0" for none`, MaxGoAwayChance)))
	}
	if k := c.KubeAPIServer; k != nil {
		switch k.Balancing {
		case "", BalancingPerConnection, BalancingPerRequest:
		default:
			errs = append(errs, field.NotSupported(root.Child("kubeAPIServer", "balancing"), k.Balancing, []Balancing{BalancingPerConnection, BalancingPerRequest}))
		}
	}
	if ha := c.HighAvailability; ha != nil && (ha.Agents < 1 || ha.Agents > MaxAgents) {
		errs = append(errs, field.Invalid(root.Child("highAvailability", "agents"), ha.Agents, fmt.Sprintf("must be between 1 and %d", MaxAgents)))
	}
	return errs
}
