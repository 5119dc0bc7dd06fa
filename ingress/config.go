package ingress

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
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
	// terminates are the internal listeners of terminating shoots, by name; secrets the SDS
	// secrets they and their clusters name.
	terminates map[string]*terminateConfig
	secrets    map[string]*secretConfig
}

// clusterConfig is one upstream cluster: an EDS service name, static endpoints or names that
// DNS resolves.
type clusterConfig struct {
	name    string
	service string // EDS service name; "" for a static or DNS cluster
	static  []netip.AddrPort
	// dns are a STRICT_DNS cluster's endpoints, host:port, resolved at each dial: only CONNECT
	// routes name such a cluster (Gardener's VPN relay), and a VPN connects a few times a day.
	dns []string
	// internal names the internal listener a STATIC cluster leads to: its connections are
	// terminated there (a terminating shoot's server names), not dialed.
	internal string
	// upstream is set on a terminating shoot's upstream clusters: they carry HTTP requests.
	upstream       *upstreamTLS
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

func parseCluster(c *clusterv3.Cluster) (*clusterConfig, error) {
	if err := checkOnly(c, "name", "type", "eds_cluster_config", "connect_timeout", "load_assignment", "circuit_breakers", "lb_policy",
		"transport_socket", "typed_extension_protocol_options"); err != nil {
		return nil, err
	}
	cc := &clusterConfig{name: c.GetName(), connectTimeout: defaultConnectTimeout, maxConnections: defaultMaxConnections}
	// A cluster with TLS to its upstream is a terminating shoot's: HTTP, least requests first,
	// over EDS. Every other cluster is TCP, round robin.
	switch tlsCluster := c.GetTransportSocket() != nil || len(c.GetTypedExtensionProtocolOptions()) > 0; {
	case tlsCluster && c.GetLbPolicy() == clusterv3.Cluster_LEAST_REQUEST && c.GetType() == clusterv3.Cluster_EDS:
		up, err := parseUpstreamTLS(c)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
		cc.upstream = up
	case tlsCluster:
		return nil, fmt.Errorf("cluster %s: a cluster with upstream TLS is an EDS cluster with lb_policy LEAST_REQUEST", c.GetName())
	case c.GetLbPolicy() != clusterv3.Cluster_ROUND_ROBIN:
		return nil, fmt.Errorf("cluster %s: lb_policy %s is not supported", c.GetName(), c.GetLbPolicy())
	}
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
		listener, ok, err := parseInternalAssignment(c)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
		if ok {
			cc.internal = listener
			break
		}
		eps, _, err := parseAssignment(c.GetLoadAssignment(), false)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
		cc.static = eps
	case clusterv3.Cluster_STRICT_DNS:
		_, names, err := parseAssignment(c.GetLoadAssignment(), true)
		if err != nil {
			return nil, fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
		if len(names) == 0 {
			return nil, fmt.Errorf("cluster %s: a STRICT_DNS cluster needs an endpoint", c.GetName())
		}
		cc.dns = names
	default:
		return nil, fmt.Errorf("cluster %s: discovery type %s is not supported", c.GetName(), c.GetType())
	}
	return cc, nil
}

// parseAssignment returns the addresses of the usable endpoints: those not marked unhealthy,
// draining or timed out. With names, every endpoint is a host name (or IP) and port, returned
// as host:port for DNS to resolve.
func parseAssignment(la *endpointv3.ClusterLoadAssignment, names bool) ([]netip.AddrPort, []string, error) {
	if err := checkOnly(la, "cluster_name", "endpoints"); err != nil {
		return nil, nil, err
	}
	var out []netip.AddrPort
	var hosts []string
	for _, lle := range la.GetEndpoints() {
		if err := checkOnly(lle, "lb_endpoints", "locality"); err != nil {
			return nil, nil, err
		}
		for _, le := range lle.GetLbEndpoints() {
			if err := checkOnly(le, "endpoint", "health_status"); err != nil {
				return nil, nil, err
			}
			ep := le.GetEndpoint()
			if err := checkOnly(ep, "address"); err != nil {
				return nil, nil, err
			}
			sa := ep.GetAddress().GetSocketAddress()
			if sa == nil {
				return nil, nil, errors.New("endpoint without a socket address")
			}
			if err := checkOnly(sa, "address", "port_value", "protocol"); err != nil {
				return nil, nil, err
			}
			if sa.GetProtocol() != corev3.SocketAddress_TCP {
				return nil, nil, fmt.Errorf("endpoint protocol %s is not supported", sa.GetProtocol())
			}
			if sa.GetPortValue() == 0 || sa.GetPortValue() > 65535 {
				return nil, nil, fmt.Errorf("endpoint port %d out of range", sa.GetPortValue())
			}
			switch le.GetHealthStatus() {
			case corev3.HealthStatus_UNKNOWN, corev3.HealthStatus_HEALTHY, corev3.HealthStatus_DEGRADED:
			default:
				continue
			}
			if names {
				if sa.GetAddress() == "" {
					return nil, nil, errors.New("endpoint without a host")
				}
				hosts = append(hosts, net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
				continue
			}
			ip, err := netip.ParseAddr(sa.GetAddress())
			if err != nil {
				return nil, nil, fmt.Errorf("endpoint address %q is not an IP: %w", sa.GetAddress(), err)
			}
			out = append(out, netip.AddrPortFrom(ip, uint16(sa.GetPortValue())))
		}
	}
	return out, hosts, nil
}
