package translate

import (
	"net/netip"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	proxyprotocolv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/proxy_protocol/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/wire"
)

// The in-cluster (GEP-8) and reversed-VPN (GEP-14) entry points.
const (
	ProxyListener  = "proxy"
	TunnelListener = "tunnel"
	ProxyPort      = 8443
	TunnelPort     = 8132
	// APIServerPort is the destination port of the PROXY header an apiserver-proxy sends: the
	// advertised address's port.
	APIServerPort = 443

	ProxyClusterPrefix = "proxy|"

	// GardenerDestinationHeader carries the cluster on the unified port (Gardener ≥ 1.130);
	// ReversedVPNHeader is the reversed VPN's own header on 8132 (spelled in wire).
	GardenerDestinationHeader = wire.GardenerDestinationHeader
	ReversedVPNHeader         = wire.ReversedVPNHeader

	// DownstreamLocalAddress is the command operator for the connection's destination, which
	// the proxy_protocol filter restores from the PROXY header.
	DownstreamLocalAddress = "%DOWNSTREAM_LOCAL_ADDRESS%"

	ProxyProtocolFilter = "envoy.filters.listener.proxy_protocol"
	HCMFilter           = "envoy.filters.network.http_connection_manager"
	RouterFilter        = "envoy.filters.http.router"
)

// Header regexes: the guard in front of cluster_header, so that a header value can only name a
// cluster of its own name space ("outbound|…" in the wire form), never "sni|…" or "proxy|…".
// The namespace part is a DNS label.
const (
	nsLabel = `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
	// ProxyDestinationRegex admits the kube-apiserver and the tendril-server of any shoot.
	// A replica of an HA shoot's server is named as its pod under the Service (tendril-server-N.tendril-server).
	ProxyDestinationRegex = `^outbound\|(443\|\|kube-apiserver|1194\|\|tendril-server(-[0-9]\.tendril-server)?)\.` + nsLabel + `\.svc\.cluster\.local$`
	// TunnelDestinationRegex admits only tendril-servers on the legacy port: by their own name,
	// and by the single vpn-seed-server name that tendril's agents used before they had one, so
	// that an agent of an earlier tendril keeps its tunnel until its shoot's next reconcile
	// rolls it (Gardener's vpn-shoot dials the unified port since GEP-30).
	TunnelDestinationRegex = `^outbound\|1194\|\|(tendril-server|vpn-seed-server)\.` + nsLabel + `\.svc\.cluster\.local$`
	// legacyGardenerRegex is what of Gardener's grammar the legacy port refuses with a word why:
	// the HA VPN names (tendril never had HA agents on this name).
	legacyGardenerRegex = `^outbound\|1194\|\|vpn-seed-server-[0-4]\.` + nsLabel + `\.svc\.cluster\.local$`
	// GardenerGatewayRegex admits the destinations of Gardener's grammar that only Gardener's
	// gateway serves, which the unified port relays there instead of routing them itself:
	// Gardener's own VPN, single and HA (vpn-seed-server-0 … -4, as Gardener admits them), and
	// the kube-apiserver socket that Gardener's apiserver-proxy names when Istio terminates TLS
	// for the shoot (IstioTLSTermination; the shoot namespace forms are Gardener's).
	GardenerGatewayRegex = `^(outbound\|1194\|\|vpn-seed-server(-[0-4])?\.` + nsLabel + `\.svc\.cluster\.local|` +
		`(shoot-[a-z0-9]+(-[a-z0-9]+)*|shoot--[a-z0-9]+(-[a-z0-9]+)*--[a-z0-9]+(-[a-z0-9]+)*)--kube-apiserver-socket)$`
)

// GardenerGatewayCluster is the constant cluster the unified port relays Gardener's own
// destinations to: Gardener's istio ingress gateway's unified port (Options.GardenerGateway).
const GardenerGatewayCluster = "gardener-gateway"

// Timeouts and limits of the entry points (design.md, "Wire details").
const (
	// ProxyHeaderTimeout bounds the wait for a PROXY header: the sender writes it first.
	ProxyHeaderTimeout = 2 * time.Second
	// ConnectRequestTimeout bounds the wait for a complete CONNECT request.
	ConnectRequestTimeout = ClientHelloTimeout
	// MaxRequestHeadersKB bounds a CONNECT request's headers: Gardener's clients send ~200 B.
	MaxRequestHeadersKB = 16
)

// APIServerWireName is the cluster, and the header value, that reaches shoot ns's kube-apiserver
// through CONNECT; the form is Gardener's, so its clients work unchanged.
func APIServerWireName(ns string) string { return wire.APIServerWireName(ns) }

// TendrilServerWireName is the cluster, and the header value, that reaches shoot ns's tunnel
// server (tendril-server) for tendril's agents.
func TendrilServerWireName(ns string) string { return wire.TendrilServerWireName(ns) }

// TendrilServerReplicaWireName is wire.TendrilServerReplicaWireName.
func TendrilServerReplicaWireName(ns, hostname string) string {
	return wire.TendrilServerReplicaWireName(ns, hostname)
}

// VPNReplicaService is the EDS service name of one replica of shoot ns's tendril-server.
func VPNReplicaService(ns, hostname string) string { return ns + "/" + hostname + ".tendril-server" }

// LegacyTunnelWireName is the cluster by which the legacy port still reaches shoot ns's
// tendril-server under the name earlier agents dial (TunnelDestinationRegex).
func LegacyTunnelWireName(ns string) string { return wire.GardenerVPNWireName(ns, -1) }

// ProxyCluster is the cluster a PROXY header with destination advertised:443 selects.
func ProxyCluster(advertised netip.Addr) string {
	return ProxyClusterPrefix + netip.AddrPortFrom(advertised, APIServerPort).String()
}

// VPNServerService is the EDS service name of shoot ns's vpn server.
func VPNServerService(ns string) string { return ns + "/tendril-server" }

// lbProxyProtocol is the listener filter that reads the load balancer's own PROXY header, when
// the seed has one: required, since every connection through the load balancer carries it.
func lbProxyProtocol(opts Options) []*listenerv3.ListenerFilter {
	if !opts.LBProxyProtocol {
		return nil
	}
	return []*listenerv3.ListenerFilter{{
		Name:       ProxyProtocolFilter,
		ConfigType: &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAny(&proxyprotocolv3.ProxyProtocol{})},
	}}
}

func proxyListener(opts Options) *listenerv3.Listener {
	l := &listenerv3.Listener{
		Name:                          ProxyListener,
		Address:                       socketAddress("0.0.0.0", ProxyPort),
		ListenerFilters:               lbProxyProtocol(opts),
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Name:    ProxyListener + "-connect",
			Filters: []*listenerv3.Filter{connectManager(ProxyListener, GardenerDestinationHeader, ProxyDestinationRegex, gardenerGatewayRoute(opts))},
		}},
	}
	if opts.ProxyProtocol {
		l.ListenerFilters = append(l.ListenerFilters, &listenerv3.ListenerFilter{
			Name: ProxyProtocolFilter,
			ConfigType: &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAny(&proxyprotocolv3.ProxyProtocol{
				// Connections without a header are the CONNECT generation of the same path.
				AllowRequestsWithoutProxyProtocol: true,
			})},
		})
		// A PROXY header whose destination is an advertised address on 443.
		l.FilterChains = append([]*listenerv3.FilterChain{{
			Name:             ProxyListener + "-proxy-protocol",
			FilterChainMatch: &listenerv3.FilterChainMatch{DestinationPort: wrapperspb.UInt32(APIServerPort)},
			Filters: []*listenerv3.Filter{
				setClusterFilter(ProxyClusterPrefix + DownstreamLocalAddress),
				tcpProxyFilter(ProxyListener),
			},
		}}, l.FilterChains...)
	}
	if len(l.ListenerFilters) > 0 {
		l.ListenerFiltersTimeout = durationpb.New(ProxyHeaderTimeout)
	}
	return l
}

// gardenerGatewayRoute is the unified port's route for what only Gardener's gateway serves
// (GardenerGatewayRegex): Gardener's vpn-shoot and apiserver-proxy dial the shoot's internal API
// name, which tendril's DNS webhook points here. With a gateway, the CONNECT itself, header and
// all, goes on to it, and it answers and routes it to vpn-seed-server or the kube-apiserver
// socket (the path Gardener's NetworkPolicies allow: vpn-seed-server admits only its gateways);
// without one, 503 says why.
func gardenerGatewayRoute(opts Options) *routev3.Route {
	r := &routev3.Route{
		Name: "gardener-gateway",
		Match: &routev3.RouteMatch{
			PathSpecifier: &routev3.RouteMatch_ConnectMatcher_{ConnectMatcher: &routev3.RouteMatch_ConnectMatcher{}},
			Headers:       []*routev3.HeaderMatcher{headerRegex(GardenerDestinationHeader, GardenerGatewayRegex)},
		},
	}
	if !opts.GardenerGateway.IsSet() {
		r.Action = directResponse(503, "Gardener's gateway destinations (vpn-seed-server, kube-apiserver-socket) are not relayed by this ingress\n")
		return r
	}
	r.Action = &routev3.Route_Route{Route: &routev3.RouteAction{
		ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: GardenerGatewayCluster},
		Timeout:          durationpb.New(0),
		// No connect_config: the CONNECT is proxied, not terminated; the gateway answers it.
		UpgradeConfigs: []*routev3.RouteAction_UpgradeConfig{{UpgradeType: "CONNECT"}},
	}}
	return r
}

// HostPort is a host name or IP address and a port.
type HostPort struct {
	Host string
	Port uint16
}

// IsSet reports whether h names an address.
func (h HostPort) IsSet() bool { return h.Host != "" && h.Port != 0 }

// gardenerGatewayCluster is Gardener's gateway, resolved by DNS (its Service's name, typically).
func gardenerGatewayCluster(relay HostPort) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 GardenerGatewayCluster,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STRICT_DNS},
		ConnectTimeout:       durationpb.New(ConnectTimeout),
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: GardenerGatewayCluster,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
					Address: socketAddress(relay.Host, uint32(relay.Port)),
				}},
			}}}},
		},
		CircuitBreakers: &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
			MaxConnections: wrapperspb.UInt32(MaxConnectionsPerCluster),
		}}},
	}
}

func tunnelListener(opts Options) *listenerv3.Listener {
	// Gardener's VPN left this port for the unified one (vpn-shoot dials :8443 since GEP-30):
	// its HA names here get a status that says so rather than "malformed header".
	moved := &routev3.Route{
		Name: "gardener-gateway",
		Match: &routev3.RouteMatch{
			PathSpecifier: &routev3.RouteMatch_ConnectMatcher_{ConnectMatcher: &routev3.RouteMatch_ConnectMatcher{}},
			Headers:       []*routev3.HeaderMatcher{headerRegex(ReversedVPNHeader, legacyGardenerRegex)},
		},
		Action: directResponse(503, "Gardener's gateway destinations are relayed on the unified port only\n"),
	}
	l := &listenerv3.Listener{
		Name:                          TunnelListener,
		Address:                       socketAddress("0.0.0.0", TunnelPort),
		ListenerFilters:               lbProxyProtocol(opts),
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Name:    TunnelListener,
			Filters: []*listenerv3.Filter{connectManager(TunnelListener, ReversedVPNHeader, TunnelDestinationRegex, moved)},
		}},
	}
	if opts.LBProxyProtocol {
		l.ListenerFiltersTimeout = durationpb.New(ProxyHeaderTimeout)
	}
	return l
}

func headerRegex(name, regex string) *routev3.HeaderMatcher {
	return &routev3.HeaderMatcher{
		Name: name,
		HeaderMatchSpecifier: &routev3.HeaderMatcher_StringMatch{StringMatch: &matcherv3.StringMatcher{
			MatchPattern: &matcherv3.StringMatcher_SafeRegex{SafeRegex: &matcherv3.RegexMatcher{Regex: regex}},
		}},
	}
}

// connectManager is an HTTP connection manager that serves CONNECT only: first the routes
// before, then one route that takes the cluster from header once the header matches regex; any
// other CONNECT gets 400, any other method 405.
func connectManager(statPrefix, header, regex string, before ...*routev3.Route) *listenerv3.Filter {
	hcm := &hcmv3.HttpConnectionManager{
		StatPrefix: statPrefix,
		CodecType:  hcmv3.HttpConnectionManager_HTTP1,
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			Name: statPrefix,
			VirtualHosts: []*routev3.VirtualHost{{
				Name:    statPrefix,
				Domains: []string{"*"},
				Routes: append(before, []*routev3.Route{
					{
						Name: "connect",
						Match: &routev3.RouteMatch{
							PathSpecifier: &routev3.RouteMatch_ConnectMatcher_{ConnectMatcher: &routev3.RouteMatch_ConnectMatcher{}},
							Headers:       []*routev3.HeaderMatcher{headerRegex(header, regex)},
						},
						Action: &routev3.Route_Route{Route: &routev3.RouteAction{
							ClusterSpecifier: &routev3.RouteAction_ClusterHeader{ClusterHeader: header},
							// A tunnel lasts as long as it is used: no route timeout, the stream
							// idle timeout ends abandoned ones.
							Timeout: durationpb.New(0),
							UpgradeConfigs: []*routev3.RouteAction_UpgradeConfig{{
								UpgradeType:   "CONNECT",
								ConnectConfig: &routev3.RouteAction_UpgradeConfig_ConnectConfig{},
							}},
						}},
					},
					{
						Name:   "connect-without-destination",
						Match:  &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_ConnectMatcher_{ConnectMatcher: &routev3.RouteMatch_ConnectMatcher{}}},
						Action: directResponse(400, "missing or malformed "+header+" header\n"),
					},
					{
						Name:   "not-connect",
						Match:  &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
						Action: directResponse(405, "only CONNECT is served here\n"),
					},
				}...),
			}},
		}},
		HttpFilters: []*hcmv3.HttpFilter{{
			Name:       RouterFilter,
			ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: mustAny(&routerv3.Router{})},
		}},
		UpgradeConfigs:        []*hcmv3.HttpConnectionManager_UpgradeConfig{{UpgradeType: "CONNECT"}},
		StreamIdleTimeout:     durationpb.New(IdleTimeout),
		RequestHeadersTimeout: durationpb.New(ConnectRequestTimeout),
		MaxRequestHeadersKb:   wrapperspb.UInt32(MaxRequestHeadersKB),
	}
	return &listenerv3.Filter{
		Name:       HCMFilter,
		ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(hcm)},
	}
}

func directResponse(status uint32, body string) *routev3.Route_DirectResponse {
	return &routev3.Route_DirectResponse{DirectResponse: &routev3.DirectResponseAction{
		Status: status,
		Body:   &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: body}},
	}}
}
