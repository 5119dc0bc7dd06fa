package ingress

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	setfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/common/set_filter_state/v3"
	tlsinspectorv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/tls_inspector/v3"
	netsetfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/set_filter_state/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
)

// config is one immutable view of everything the ingress serves. A change builds a new config
// (copying only the changed type's map) and swaps it in whole, so a connection sees one
// consistent set while it picks its upstream.
type config struct {
	listeners map[string]*listenerConfig
	clusters  map[string]*clusterConfig
	// endpoints are the addresses of each EDS service name.
	endpoints map[string][]netip.AddrPort
}

// listenerConfig is the subset of an Envoy listener tendril-ingress serves: optional TLS
// inspection, then one chain that renders a cluster name and proxies to it.
type listenerConfig struct {
	name         string
	tlsInspector bool
	// helloTimeout bounds the listener filters (the ClientHello read).
	helloTimeout time.Duration
	// clusterFormat renders the tcp_proxy cluster override; nil means the default cluster.
	clusterFormat *format
	// defaultCluster is tcp_proxy's own cluster, used when no override is set.
	defaultCluster string
	idleTimeout    time.Duration
}

// clusterConfig is one upstream cluster: an EDS service name or static endpoints.
type clusterConfig struct {
	name           string
	service        string // EDS service name; "" for a static cluster
	static         []netip.AddrPort
	connectTimeout time.Duration
	maxConnections int64
	// next picks endpoints round robin. It lives in the cluster, so a cluster update restarts
	// the rotation, which costs nothing.
	next atomic.Uint64
}

func (c *config) upstreams(cl *clusterConfig) []netip.AddrPort {
	if cl.service == "" {
		return cl.static
	}
	return c.endpoints[cl.service]
}

// Defaults Envoy applies when a field is unset.
const (
	defaultHelloTimeout   = 15 * time.Second // listener_filters_timeout
	defaultConnectTimeout = 5 * time.Second  // cluster connect_timeout
	defaultMaxConnections = 1024             // circuit breaker max_connections
)

// Operators set_filter_state formats may use; anything else is refused.
const (
	opServerName   = "%REQUESTED_SERVER_NAME%"
	opDownstreamIP = "%DOWNSTREAM_LOCAL_ADDRESS%"
)

// format is a parsed substitution format: literal text and operators in order.
type format struct {
	parts []formatPart
}

type formatPart struct {
	literal string
	op      string // one of the operators, or "" for a literal
}

// connInfo is what a format can render for one connection.
type connInfo struct {
	serverName string
	localAddr  string
}

func (f *format) render(ci connInfo) string {
	var b strings.Builder
	for _, p := range f.parts {
		switch p.op {
		case "":
			b.WriteString(p.literal)
		case opServerName:
			// Envoy renders a missing value as "-", which names no cluster.
			b.WriteString(orDash(ci.serverName))
		case opDownstreamIP:
			b.WriteString(orDash(ci.localAddr))
		}
	}
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func parseFormat(s string) (*format, error) {
	f := &format{}
	for s != "" {
		i := strings.IndexByte(s, '%')
		if i < 0 {
			f.parts = append(f.parts, formatPart{literal: s})
			break
		}
		if i > 0 {
			f.parts = append(f.parts, formatPart{literal: s[:i]})
		}
		j := strings.IndexByte(s[i+1:], '%')
		if j < 0 {
			return nil, fmt.Errorf("unterminated operator in %q", s)
		}
		op := s[i : i+j+2]
		if op != opServerName && op != opDownstreamIP {
			return nil, fmt.Errorf("unsupported format operator %s", op)
		}
		f.parts = append(f.parts, formatPart{op: op})
		s = s[i+j+2:]
	}
	return f, nil
}

// checkOnly refuses m if any field other than the named ones is set: the ingress serves exactly
// the subset tendril generates, and silently ignoring a field (say, upstream TLS or access
// logs) would serve something other than what the control plane asked for.
func checkOnly(m proto.Message, fields ...string) error {
	var extra []string
	m.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		if !slices.Contains(fields, string(fd.Name())) {
			extra = append(extra, string(fd.Name()))
		}
		return true
	})
	if len(extra) > 0 {
		return fmt.Errorf("%s: unsupported fields %s", proto.MessageName(m), strings.Join(extra, ", "))
	}
	return nil
}

func unpack[T proto.Message](a *anypb.Any, m T) (T, error) {
	if a == nil {
		return m, errors.New("missing typed_config")
	}
	if err := a.UnmarshalTo(m); err != nil {
		return m, fmt.Errorf("typed_config %s: %w", a.GetTypeUrl(), err)
	}
	return m, nil
}

func parseListener(l *listenerv3.Listener) (*listenerConfig, error) {
	if err := checkOnly(l, "name", "address", "listener_filters", "listener_filters_timeout",
		"continue_on_listener_filters_timeout", "filter_chains", "per_connection_buffer_limit_bytes", "stat_prefix"); err != nil {
		return nil, err
	}
	if l.GetContinueOnListenerFiltersTimeout() {
		return nil, errors.New("continue_on_listener_filters_timeout is not supported: a connection without its ClientHello has no route")
	}
	lc := &listenerConfig{name: l.GetName(), helloTimeout: defaultHelloTimeout}
	if d := l.GetListenerFiltersTimeout(); d != nil {
		lc.helloTimeout = d.AsDuration()
	}
	for _, f := range l.GetListenerFilters() {
		if err := checkOnly(f, "name", "typed_config"); err != nil {
			return nil, err
		}
		switch f.GetTypedConfig().GetTypeUrl() {
		case "type.googleapis.com/" + string(proto.MessageName(&tlsinspectorv3.TlsInspector{})):
			ti, err := unpack(f.GetTypedConfig(), &tlsinspectorv3.TlsInspector{})
			if err != nil {
				return nil, err
			}
			if err := checkOnly(ti); err != nil {
				return nil, err
			}
			lc.tlsInspector = true
		default:
			return nil, fmt.Errorf("listener filter %s (%s) is not supported", f.GetName(), f.GetTypedConfig().GetTypeUrl())
		}
	}
	if len(l.GetFilterChains()) != 1 {
		return nil, fmt.Errorf("exactly one filter chain is supported, got %d", len(l.GetFilterChains()))
	}
	fc := l.GetFilterChains()[0]
	if err := checkOnly(fc, "name", "filters"); err != nil {
		return nil, err
	}
	filters := fc.GetFilters()
	if len(filters) == 0 {
		return nil, errors.New("filter chain has no filters")
	}
	for i, f := range filters {
		if err := checkOnly(f, "name", "typed_config"); err != nil {
			return nil, err
		}
		last := i == len(filters)-1
		switch cfg := f.GetTypedConfig(); cfg.GetTypeUrl() {
		case "type.googleapis.com/" + string(proto.MessageName(&netsetfilterstatev3.Config{})):
			if last {
				return nil, errors.New("set_filter_state must be followed by tcp_proxy")
			}
			sfs, err := unpack(cfg, &netsetfilterstatev3.Config{})
			if err != nil {
				return nil, err
			}
			if err := parseSetFilterState(sfs, lc); err != nil {
				return nil, err
			}
		case "type.googleapis.com/" + string(proto.MessageName(&tcpproxyv3.TcpProxy{})):
			if !last {
				return nil, errors.New("tcp_proxy must be the last filter")
			}
			tp, err := unpack(cfg, &tcpproxyv3.TcpProxy{})
			if err != nil {
				return nil, err
			}
			if err := checkOnly(tp, "stat_prefix", "cluster", "idle_timeout", "max_connect_attempts"); err != nil {
				return nil, err
			}
			if n := tp.GetMaxConnectAttempts(); n != nil && n.GetValue() != 1 {
				return nil, fmt.Errorf("tcp_proxy max_connect_attempts %d: only 1 is supported", n.GetValue())
			}
			lc.defaultCluster = tp.GetCluster()
			lc.idleTimeout = time.Hour // Envoy's default
			if d := tp.GetIdleTimeout(); d != nil {
				lc.idleTimeout = d.AsDuration() // 0 disables it, as in Envoy
			}
		default:
			return nil, fmt.Errorf("network filter %s (%s) is not supported", f.GetName(), cfg.GetTypeUrl())
		}
	}
	if lc.clusterFormat != nil && slices.ContainsFunc(lc.clusterFormat.parts, func(p formatPart) bool { return p.op == opServerName }) && !lc.tlsInspector {
		return nil, errors.New("%REQUESTED_SERVER_NAME% needs the tls_inspector listener filter")
	}
	return lc, nil
}

func parseSetFilterState(c *netsetfilterstatev3.Config, lc *listenerConfig) error {
	if err := checkOnly(c, "on_new_connection"); err != nil {
		return err
	}
	for _, v := range c.GetOnNewConnection() {
		if err := checkOnly(v, "object_key", "format_string", "read_only", "shared_with_upstream"); err != nil {
			return err
		}
		if k := v.GetObjectKey(); k != "envoy.tcp_proxy.cluster" {
			return fmt.Errorf("set_filter_state object key %q is not supported", k)
		}
		if v.GetSharedWithUpstream() != setfilterstatev3.FilterStateValue_NONE {
			return errors.New("set_filter_state shared_with_upstream is not supported")
		}
		fs := v.GetFormatString()
		if err := checkOnly(fs, "text_format_source"); err != nil {
			return err
		}
		src := fs.GetTextFormatSource()
		if _, ok := src.GetSpecifier().(*corev3.DataSource_InlineString); !ok {
			return errors.New("set_filter_state format: only inline_string is supported")
		}
		f, err := parseFormat(src.GetInlineString())
		if err != nil {
			return err
		}
		lc.clusterFormat = f
	}
	return nil
}

func parseCluster(c *clusterv3.Cluster) (*clusterConfig, error) {
	if err := checkOnly(c, "name", "type", "eds_cluster_config", "connect_timeout", "load_assignment", "circuit_breakers", "lb_policy"); err != nil {
		return nil, err
	}
	if c.GetLbPolicy() != clusterv3.Cluster_ROUND_ROBIN {
		return nil, fmt.Errorf("cluster %s: lb_policy %s is not supported", c.GetName(), c.GetLbPolicy())
	}
	cc := &clusterConfig{name: c.GetName(), connectTimeout: defaultConnectTimeout, maxConnections: defaultMaxConnections}
	if d := c.GetConnectTimeout(); d != nil {
		cc.connectTimeout = d.AsDuration()
	}
	if cb := c.GetCircuitBreakers(); cb != nil {
		for _, th := range cb.GetThresholds() {
			if err := checkOnly(th, "priority", "max_connections"); err != nil {
				return nil, err
			}
			if th.GetPriority() == corev3.RoutingPriority_DEFAULT && th.GetMaxConnections() != nil {
				cc.maxConnections = int64(th.GetMaxConnections().GetValue())
			}
		}
	}
	switch c.GetType() {
	case clusterv3.Cluster_EDS:
		eds := c.GetEdsClusterConfig()
		if _, ok := eds.GetEdsConfig().GetConfigSourceSpecifier().(*corev3.ConfigSource_Ads); !ok {
			return nil, fmt.Errorf("cluster %s: EDS config source must be ADS", c.GetName())
		}
		if c.GetLoadAssignment() != nil {
			return nil, fmt.Errorf("cluster %s: an EDS cluster carries no load_assignment", c.GetName())
		}
		cc.service = eds.GetServiceName()
		if cc.service == "" {
			cc.service = c.GetName() // Envoy's default
		}
	case clusterv3.Cluster_STATIC:
		la := c.GetLoadAssignment()
		eps, err := parseAssignment(la)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
		cc.static = eps
	default:
		return nil, fmt.Errorf("cluster %s: discovery type %s is not supported", c.GetName(), c.GetType())
	}
	return cc, nil
}

// parseAssignment returns the addresses of the usable endpoints: those not marked unhealthy,
// draining or timed out.
func parseAssignment(la *endpointv3.ClusterLoadAssignment) ([]netip.AddrPort, error) {
	if err := checkOnly(la, "cluster_name", "endpoints"); err != nil {
		return nil, err
	}
	var out []netip.AddrPort
	for _, lle := range la.GetEndpoints() {
		if err := checkOnly(lle, "lb_endpoints", "locality"); err != nil {
			return nil, err
		}
		for _, le := range lle.GetLbEndpoints() {
			if err := checkOnly(le, "endpoint", "health_status"); err != nil {
				return nil, err
			}
			ep := le.GetEndpoint()
			if err := checkOnly(ep, "address"); err != nil {
				return nil, err
			}
			sa := ep.GetAddress().GetSocketAddress()
			if sa == nil {
				return nil, errors.New("endpoint without a socket address")
			}
			if err := checkOnly(sa, "address", "port_value", "protocol"); err != nil {
				return nil, err
			}
			if sa.GetProtocol() != corev3.SocketAddress_TCP {
				return nil, fmt.Errorf("endpoint protocol %s is not supported", sa.GetProtocol())
			}
			ip, err := netip.ParseAddr(sa.GetAddress())
			if err != nil {
				return nil, fmt.Errorf("endpoint address %q is not an IP: %w", sa.GetAddress(), err)
			}
			if sa.GetPortValue() == 0 || sa.GetPortValue() > 65535 {
				return nil, fmt.Errorf("endpoint port %d out of range", sa.GetPortValue())
			}
			switch le.GetHealthStatus() {
			case corev3.HealthStatus_UNKNOWN, corev3.HealthStatus_HEALTHY, corev3.HealthStatus_DEGRADED:
				out = append(out, netip.AddrPortFrom(ip, uint16(sa.GetPortValue())))
			}
		}
	}
	return out, nil
}
