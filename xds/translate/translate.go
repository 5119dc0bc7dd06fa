// Package translate turns tendril's routing model into Envoy xDS resources in the
// constant-listener layout (design.md, "xDS layout"): the listeners never depend on the shoots, and
// each shoot is nothing but clusters and cluster load assignments, so one shoot's change costs the
// same at 10 shoots as at 10,000. Translation is pure and deterministic: no I/O, no clocks, no
// Kubernetes; the same model always yields the same resources.
package translate

import (
	"net/netip"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	setfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/common/set_filter_state/v3"
	tlsinspectorv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/tls_inspector/v3"
	netsetfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/set_filter_state/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/xds/model"
)

// Names of the constant resources, and the prefixes that keep the per-listener cluster name
// spaces apart: a server name can only ever select an "sni|" cluster.
const (
	SNIListener      = "sni"
	BlackholeCluster = "tendril-blackhole"
	SNIClusterPrefix = "sni|"

	// TCPProxyClusterKey is Envoy's well-known filter state key that overrides tcp_proxy's cluster
	// per connection.
	TCPProxyClusterKey = "envoy.tcp_proxy.cluster"
	// RequestedServerName is the command operator for the ClientHello's server name; Envoy renders
	// it as "-" when there is none, which names no cluster.
	RequestedServerName = "%REQUESTED_SERVER_NAME%"

	// Well-known extension names, as Envoy registers them.
	TLSInspectorFilter   = "envoy.filters.listener.tls_inspector"
	SetFilterStateFilter = "envoy.filters.network.set_filter_state"
	TCPProxyFilter       = "envoy.filters.network.tcp_proxy"
)

// Ports the listeners bind inside the ingress pod; the data plane maps them to real addresses.
const SNIPort = 443

// Timeouts, explicit so that Envoy and tendril-ingress behave alike (design.md, "Wire details").
const (
	// ClientHelloTimeout bounds the wait for the ClientHello (listener filters).
	ClientHelloTimeout = 10 * time.Second
	// IdleTimeout closes a spliced connection after this long without bytes in either direction;
	// kube-apiserver watches and tunnels carry their own keepalives well inside it.
	IdleTimeout = time.Hour
	// ConnectTimeout bounds one dial to an upstream.
	ConnectTimeout = 5 * time.Second
	// ConnectAttempts is how many dials a TCP connection makes, each to the next endpoint, before
	// it is refused: one per kube-apiserver replica of a highly available control plane (3).
	ConnectAttempts = 3
)

// MaxConnectionsPerCluster lifts Envoy's default circuit breaker (1,024 connections per cluster),
// which a large shoot's watches alone would exceed: 5,000 nodes × a few watches each. tendril-ingress
// enforces the same limit.
const MaxConnectionsPerCluster = 65536

// PerConnectionBufferLimit is Envoy's per-connection read buffer (the default is 1 MiB): 32 KiB
// keeps 100,000 idle watches well under 4 GiB of buffers and still fills a loopback splice.
const PerConnectionBufferLimit = 32 << 10

// Resources is a set of xDS resources by type, in a deterministic order.
type Resources struct {
	Listeners []*listenerv3.Listener
	Clusters  []*clusterv3.Cluster
	Endpoints []*endpointv3.ClusterLoadAssignment
	Secrets   []*tlsv3.Secret
}

// Append adds all of o's resources to r.
func (r *Resources) Append(o Resources) {
	r.Listeners = append(r.Listeners, o.Listeners...)
	r.Clusters = append(r.Clusters, o.Clusters...)
	r.Endpoints = append(r.Endpoints, o.Endpoints...)
	r.Secrets = append(r.Secrets, o.Secrets...)
}

// SNICluster is the name of the cluster a connection with server name host selects.
func SNICluster(host string) string { return SNIClusterPrefix + host }

// APIServerService is the EDS service name shared by all of a shoot's kube-apiserver clusters, so
// that its endpoints are one ClusterLoadAssignment however many names reach it.
func APIServerService(shoot string) string { return shoot + "/kube-apiserver" }

// Options are the seed-wide choices that shape the constant resources. The zero value is a seed
// whose load balancer passes connections through unchanged.
type Options struct {
	// LBProxyProtocol says the seed's load balancer prepends its own PROXY header to every
	// connection: every listener reads that header first. (Envoy then keeps only the last
	// header's addresses; tendril-ingress keeps both and trusts the outer one only from its
	// --trusted-proxy-cidr.)
	LBProxyProtocol bool
	// ProxyProtocol has the unified port also read PROXY headers (v1 or v2) and route those to
	// an advertised address on 443: GEP-8's first in-cluster path, which Gardener removed from
	// its :8443 in v1.123 (CONNECT with X-Gardener-Destination replaced it), kept for
	// apiserver-proxies in proxy-protocol mode. Off, the unified port serves CONNECT only, as
	// Gardener's does.
	ProxyProtocol bool
	// GardenerGateway is Gardener's istio ingress gateway's unified port (its Service's name
	// and 8443, typically): the unified port relays the CONNECTs only Gardener serves there
	// (its VPN, the kube-apiserver socket). Unset: they are refused with 503.
	GardenerGateway HostPort
	// RemoveHTTPProxyLegacyPort drops the legacy tunnel listener (8132, Reversed-VPN), as
	// Gardener's feature gate of that name drops its gateway's; tendril's agents use the
	// unified port.
	RemoveHTTPProxyLegacyPort bool
}

// All translates a whole route set: the constant resources followed by every shoot's, in the
// order of shoots.
func All(opts Options, shoots []model.Shoot) Resources {
	r := Constant(opts)
	for _, s := range shoots {
		r.Append(Shoot(s))
	}
	return r
}

// Constant returns the resources that never change with shoots: the listeners, the blackhole
// cluster tcp_proxy falls back to and, with a gateway to relay to, its cluster.
func Constant(opts Options) Resources {
	r := Resources{
		Listeners: []*listenerv3.Listener{sniListener(opts), proxyListener(opts)},
		Clusters:  []*clusterv3.Cluster{blackholeCluster()},
	}
	if !opts.RemoveHTTPProxyLegacyPort {
		r.Listeners = append(r.Listeners, tunnelListener(opts))
	}
	if opts.GardenerGateway.IsSet() {
		r.Clusters = append(r.Clusters, gardenerGatewayCluster(opts.GardenerGateway))
	}
	return r
}

// Shoot returns one shoot's resources: the clusters that reach its kube-apiserver (one per server
// name, one for its advertised address, one for the CONNECT wire name), sharing one load
// assignment with all of its endpoints (none while it has no ready endpoint), and when it has vpn
// server endpoints, that server's clusters (its own name, and the legacy port's name of earlier
// agents) and assignment, and a cluster and assignment per named replica of that server (an HA
// shoot's, whose agents keep a tunnel to each). A terminating shoot's server names lead to its
// own internal listener instead (terminate). Nothing else depends on the shoot, and an endpoint
// change touches only the one assignment.
func Shoot(s model.Shoot) Resources {
	service := APIServerService(s.Name)
	var r Resources
	if s.Termination != nil {
		r = terminate(s)
	} else {
		for _, h := range s.Hosts {
			r.Clusters = append(r.Clusters, edsCluster(SNICluster(h), service))
		}
	}
	if s.AdvertisedAddress.IsValid() {
		r.Clusters = append(r.Clusters, edsCluster(ProxyCluster(s.AdvertisedAddress), service))
	}
	r.Clusters = append(r.Clusters, edsCluster(APIServerWireName(s.Name), service))
	r.Endpoints = append(r.Endpoints, assignment(service, s.APIServerEndpoints()))
	if vpnEndpoints := s.VPNServerEndpoints(); len(vpnEndpoints) > 0 {
		vpn := VPNServerService(s.Name)
		r.Clusters = append(r.Clusters, edsCluster(TendrilServerWireName(s.Name), vpn), edsCluster(LegacyTunnelWireName(s.Name), vpn))
		r.Endpoints = append(r.Endpoints, assignment(vpn, vpnEndpoints))
	}
	for _, rep := range s.VPNReplicas {
		service := VPNReplicaService(s.Name, rep.Hostname)
		r.Clusters = append(r.Clusters, edsCluster(TendrilServerReplicaWireName(s.Name, rep.Hostname), service))
		r.Endpoints = append(r.Endpoints, assignment(service, []netip.AddrPort{netip.AddrPortFrom(rep.Endpoint.Addr().Unmap(), rep.Endpoint.Port())}))
	}
	return r
}

func sniListener(opts Options) *listenerv3.Listener {
	return &listenerv3.Listener{
		Name:    SNIListener,
		Address: socketAddress("0.0.0.0", SNIPort),
		ListenerFilters: append(lbProxyProtocol(opts), &listenerv3.ListenerFilter{
			Name:       TLSInspectorFilter,
			ConfigType: &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAny(&tlsinspectorv3.TlsInspector{})},
		}),
		ListenerFiltersTimeout:           durationpb.New(ClientHelloTimeout),
		ContinueOnListenerFiltersTimeout: false,
		PerConnectionBufferLimitBytes:    wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Name: SNIListener,
			Filters: []*listenerv3.Filter{
				setClusterFilter(SNIClusterPrefix + RequestedServerName),
				tcpProxyFilter(SNIListener),
			},
		}},
	}
}

// setClusterFilter sets the tcp_proxy cluster override from format, rendered on each new
// connection before tcp_proxy (network filters run onNewConnection in chain order).
func setClusterFilter(format string) *listenerv3.Filter {
	cfg := &netsetfilterstatev3.Config{
		OnNewConnection: []*setfilterstatev3.FilterStateValue{{
			Key: &setfilterstatev3.FilterStateValue_ObjectKey{ObjectKey: TCPProxyClusterKey},
			Value: &setfilterstatev3.FilterStateValue_FormatString{FormatString: &corev3.SubstitutionFormatString{
				Format: &corev3.SubstitutionFormatString_TextFormatSource{TextFormatSource: &corev3.DataSource{
					Specifier: &corev3.DataSource_InlineString{InlineString: format},
				}},
			}},
		}},
	}
	return &listenerv3.Filter{
		Name:       SetFilterStateFilter,
		ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(cfg)},
	}
}

func tcpProxyFilter(statPrefix string) *listenerv3.Filter {
	cfg := &tcpproxyv3.TcpProxy{
		StatPrefix:       statPrefix,
		ClusterSpecifier: &tcpproxyv3.TcpProxy_Cluster{Cluster: BlackholeCluster},
		IdleTimeout:      durationpb.New(IdleTimeout),
		// A kube-apiserver replica that went away stays in the endpoints until its EndpointSlice
		// says so (seconds, during a rolling update): a refused or timed-out dial moves on to the
		// next endpoint (round robin) instead of failing the client's connection.
		MaxConnectAttempts: wrapperspb.UInt32(ConnectAttempts),
	}
	return &listenerv3.Filter{
		Name:       TCPProxyFilter,
		ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(cfg)},
	}
}

func blackholeCluster() *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 BlackholeCluster,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:       durationpb.New(ConnectTimeout),
		LoadAssignment:       &endpointv3.ClusterLoadAssignment{ClusterName: BlackholeCluster},
	}
}

func edsCluster(name, service string) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig: &clusterv3.Cluster_EdsClusterConfig{
			EdsConfig: &corev3.ConfigSource{
				ResourceApiVersion:    corev3.ApiVersion_V3,
				ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
			},
			ServiceName: service,
		},
		ConnectTimeout: durationpb.New(ConnectTimeout),
		CircuitBreakers: &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
			MaxConnections: wrapperspb.UInt32(MaxConnectionsPerCluster),
		}}},
	}
}

// assignment is the load assignment of service: its endpoints, in the (sorted) order given, in
// one locality. With no endpoints it has no locality either, which both data planes read as "no
// upstream" and refuse connections.
func assignment(service string, endpoints []netip.AddrPort) *endpointv3.ClusterLoadAssignment {
	la := &endpointv3.ClusterLoadAssignment{ClusterName: service}
	if len(endpoints) == 0 {
		return la
	}
	lle := &endpointv3.LocalityLbEndpoints{LbEndpoints: make([]*endpointv3.LbEndpoint, 0, len(endpoints))}
	for _, e := range endpoints {
		lle.LbEndpoints = append(lle.LbEndpoints, &endpointv3.LbEndpoint{
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Address: socketAddress(e.Addr().String(), uint32(e.Port())),
			}},
		})
	}
	la.Endpoints = []*endpointv3.LocalityLbEndpoints{lle}
	return la
}

func socketAddress(ip string, port uint32) *corev3.Address {
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Protocol:      corev3.SocketAddress_TCP,
		Address:       ip,
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: port},
	}}}
}

// mustAny packs m. Marshalling a well-formed generated message cannot fail; a failure is a
// programming error that every golden test would hit.
func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic("translate: pack " + string(proto.MessageName(m)) + ": " + err.Error())
	}
	return a
}
