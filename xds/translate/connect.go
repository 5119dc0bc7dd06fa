package translate

import (
	"net/netip"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
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
	// ProxyDestinationRegex admits the kube-apiserver and the vpn server of any shoot.
	ProxyDestinationRegex = `^outbound\|(443\|\|kube-apiserver|1194\|\|vpn-seed-server)\.` + nsLabel + `\.svc\.cluster\.local$`
	// TunnelDestinationRegex admits only vpn servers.
	TunnelDestinationRegex = `^outbound\|1194\|\|vpn-seed-server\.` + nsLabel + `\.svc\.cluster\.local$`
)

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

// VPNServerWireName is the cluster, and the header value, that reaches shoot ns's vpn server.
func VPNServerWireName(ns string) string { return wire.VPNServerWireName(ns) }

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
	return &listenerv3.Listener{
		Name:    ProxyListener,
		Address: socketAddress("0.0.0.0", ProxyPort),
		ListenerFilters: append(lbProxyProtocol(opts), &listenerv3.ListenerFilter{
			Name: ProxyProtocolFilter,
			ConfigType: &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAny(&proxyprotocolv3.ProxyProtocol{
				// Connections without a header are the CONNECT generation of the same path.
				AllowRequestsWithoutProxyProtocol: true,
			})},
		}),
		ListenerFiltersTimeout:        durationpb.New(ProxyHeaderTimeout),
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{
			{
				// A PROXY header whose destination is an advertised address on 443.
				Name:             ProxyListener + "-proxy-protocol",
				FilterChainMatch: &listenerv3.FilterChainMatch{DestinationPort: wrapperspb.UInt32(APIServerPort)},
				Filters: []*listenerv3.Filter{
					setClusterFilter(ProxyClusterPrefix + DownstreamLocalAddress),
					tcpProxyFilter(ProxyListener),
				},
			},
			{
				Name:    ProxyListener + "-connect",
				Filters: []*listenerv3.Filter{connectManager(ProxyListener, GardenerDestinationHeader, ProxyDestinationRegex)},
			},
		},
	}
}

func tunnelListener(opts Options) *listenerv3.Listener {
	l := &listenerv3.Listener{
		Name:                          TunnelListener,
		Address:                       socketAddress("0.0.0.0", TunnelPort),
		ListenerFilters:               lbProxyProtocol(opts),
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Name:    TunnelListener,
			Filters: []*listenerv3.Filter{connectManager(TunnelListener, ReversedVPNHeader, TunnelDestinationRegex)},
		}},
	}
	if opts.LBProxyProtocol {
		l.ListenerFiltersTimeout = durationpb.New(ProxyHeaderTimeout)
	}
	return l
}

// connectManager is an HTTP connection manager that serves CONNECT only: one route takes the
// cluster from header once the header matches regex; any other CONNECT gets 400, any other
// method 405.
func connectManager(statPrefix, header, regex string) *listenerv3.Filter {
	hcm := &hcmv3.HttpConnectionManager{
		StatPrefix: statPrefix,
		CodecType:  hcmv3.HttpConnectionManager_HTTP1,
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			Name: statPrefix,
			VirtualHosts: []*routev3.VirtualHost{{
				Name:    statPrefix,
				Domains: []string{"*"},
				Routes: []*routev3.Route{
					{
						Name: "connect",
						Match: &routev3.RouteMatch{
							PathSpecifier: &routev3.RouteMatch_ConnectMatcher_{ConnectMatcher: &routev3.RouteMatch_ConnectMatcher{}},
							Headers: []*routev3.HeaderMatcher{{
								Name: header,
								HeaderMatchSpecifier: &routev3.HeaderMatcher_StringMatch{StringMatch: &matcherv3.StringMatcher{
									MatchPattern: &matcherv3.StringMatcher_SafeRegex{SafeRegex: &matcherv3.RegexMatcher{Regex: regex}},
								}},
							}},
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
				},
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
