package translate

import (
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	luav3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/lua/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/model"
)

// The terminating mode (model.Termination). The SNI listener stays as it is: a terminating
// shoot's "sni|<host>" clusters lead, instead of to kube-apiserver, to an internal listener of
// its own, which ends the TLS, authenticates and balances each request (as Gardener's istio
// does with its per-shoot internal listeners). So a terminating shoot's change touches only its
// own listener, clusters and secrets, never the SNI listener or another shoot.
const (
	TerminatePrefix = "terminate|"

	LuaFilter          = "envoy.filters.http.lua"
	TLSTransportSocket = "envoy.transport_sockets.tls"
	// HTTPProtocolOptions is the key of a cluster's upstream HTTP options.
	HTTPProtocolOptions = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
	// UpgradeHeader is matched (present) to send SPDY and WebSocket upgrades, which need
	// HTTP/1.1, to the shoot's HTTP/1.1 cluster.
	UpgradeHeader = "upgrade"

	// TerminateMaxRequestHeadersKB is kube-apiserver's own bound on a request's headers (1 MiB):
	// a client that kube-apiserver serves is served through the ingress too.
	TerminateMaxRequestHeadersKB = 1 << 10
)

// TerminateListener is the internal listener that terminates shoot's TLS; its "sni|<host>"
// clusters lead there.
func TerminateListener(shoot string) string { return TerminatePrefix + shoot }

// TerminateCluster is the HTTP/2 cluster a terminating shoot's requests are balanced over;
// TerminateUpgradeCluster the HTTP/1.1 one its upgrades go to. Both share the shoot's
// kube-apiserver endpoints (APIServerService).
func TerminateCluster(shoot string) string { return TerminatePrefix + shoot + "/kube-apiserver" }
func TerminateUpgradeCluster(shoot string) string {
	return TerminatePrefix + shoot + "/kube-apiserver-upgrade"
}

// The SDS secrets of a terminating shoot: the serving certificate and the client CA the ingress
// presents and verifies against, the front-proxy certificate it presents to kube-apiserver and
// the CA it verifies kube-apiserver with.
func ServingSecret(shoot string) string     { return shoot + "/serving" }
func ClientCASecret(shoot string) string    { return shoot + "/client-ca" }
func FrontProxySecret(shoot string) string  { return shoot + "/front-proxy" }
func APIServerCASecret(shoot string) string { return shoot + "/kube-apiserver-ca" }

// terminate returns the resources of a terminating shoot beyond its passthrough ones: the SNI
// clusters (one per host, leading to its internal listener), the listener, the two upstream
// clusters and the four secrets.
func terminate(s model.Shoot) Resources {
	t := s.Termination
	r := Resources{Listeners: []*listenerv3.Listener{terminateListener(s.Name)}}
	for _, h := range s.Hosts {
		r.Clusters = append(r.Clusters, internalCluster(SNICluster(h), TerminateListener(s.Name)))
	}
	r.Clusters = append(r.Clusters,
		terminateCluster(TerminateCluster(s.Name), s.Name, t.APIServerName, "h2", &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{Http2ProtocolOptions: &corev3.Http2ProtocolOptions{}},
		}),
		terminateCluster(TerminateUpgradeCluster(s.Name), s.Name, t.APIServerName, "http/1.1", &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_HttpProtocolOptions{HttpProtocolOptions: &corev3.Http1ProtocolOptions{}},
		}))
	r.Secrets = []*tlsv3.Secret{
		certificateSecret(ServingSecret(s.Name), t.ServingCert, t.ServingKey),
		caSecret(ClientCASecret(s.Name), t.ClientCA),
		certificateSecret(FrontProxySecret(s.Name), t.FrontProxyCert, t.FrontProxyKey),
		caSecret(APIServerCASecret(s.Name), t.APIServerCA),
	}
	return r
}

// internalCluster leads to the internal listener named listener (Envoy's bootstrap extension
// envoy.bootstrap.internal_listener must be on; the chart's bootstrap turns it on).
func internalCluster(name, listener string) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:       durationpb.New(ConnectTimeout),
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: name,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
					Address: &corev3.Address{Address: &corev3.Address_EnvoyInternalAddress{EnvoyInternalAddress: &corev3.EnvoyInternalAddress{
						AddressNameSpecifier: &corev3.EnvoyInternalAddress_ServerListenerName{ServerListenerName: listener},
					}}},
				}},
			}}}},
		},
		CircuitBreakers: &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
			MaxConnections: wrapperspb.UInt32(MaxConnectionsPerCluster),
		}}},
	}
}

func terminateListener(shoot string) *listenerv3.Listener {
	tlsCtx := &tlsv3.DownstreamTlsContext{
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{sds(ServingSecret(shoot))},
			// Every client certificate is accepted at the handshake and judged per request by
			// the authenticating-proxy filter (401, as kube-apiserver answers), against this CA.
			ValidationContextType: &tlsv3.CommonTlsContext_CombinedValidationContext{CombinedValidationContext: &tlsv3.CommonTlsContext_CombinedCertificateValidationContext{
				DefaultValidationContext:         &tlsv3.CertificateValidationContext{TrustChainVerification: tlsv3.CertificateValidationContext_ACCEPT_UNTRUSTED},
				ValidationContextSdsSecretConfig: sds(ClientCASecret(shoot)),
			}},
			AlpnProtocols: []string{"h2", "http/1.1"},
		},
		// Bearer tokens and anonymous requests need no certificate.
		RequireClientCertificate: wrapperspb.Bool(false),
	}
	route := func(name string, cluster string, headers ...*routev3.HeaderMatcher) *routev3.Route {
		return &routev3.Route{
			Name:  name,
			Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}, Headers: headers},
			Action: &routev3.Route_Route{Route: &routev3.RouteAction{
				ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: cluster},
				// Watches and logs -f last as long as they are read: no route timeout; the
				// stream idle timeout ends abandoned ones.
				Timeout: durationpb.New(0),
			}},
		}
	}
	hcm := &hcmv3.HttpConnectionManager{
		StatPrefix: TerminateListener(shoot),
		CodecType:  hcmv3.HttpConnectionManager_AUTO,
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			Name: TerminateListener(shoot),
			VirtualHosts: []*routev3.VirtualHost{{
				Name:    shoot,
				Domains: []string{"*"},
				Routes: []*routev3.Route{
					route("upgrade", TerminateUpgradeCluster(shoot), &routev3.HeaderMatcher{
						Name: UpgradeHeader, HeaderMatchSpecifier: &routev3.HeaderMatcher_PresentMatch{PresentMatch: true},
					}),
					route("request", TerminateCluster(shoot)),
				},
			}},
		}},
		HttpFilters: []*hcmv3.HttpFilter{
			{Name: LuaFilter, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: mustAny(&luav3.Lua{
				DefaultSourceCode: &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: wire.AuthProxyLua}},
			})}},
			{Name: RouterFilter, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: mustAny(&routerv3.Router{})}},
		},
		UpgradeConfigs: []*hcmv3.HttpConnectionManager_UpgradeConfig{{UpgradeType: "websocket"}, {UpgradeType: "SPDY/3.1"}},
		// kube-apiserver's audit log takes the client's address from X-Forwarded-For: Envoy
		// sets it to the downstream address instead of appending to what the client sent.
		UseRemoteAddress:      wrapperspb.Bool(true),
		StreamIdleTimeout:     durationpb.New(IdleTimeout),
		RequestHeadersTimeout: durationpb.New(ClientHelloTimeout),
		MaxRequestHeadersKb:   wrapperspb.UInt32(TerminateMaxRequestHeadersKB),
		CommonHttpProtocolOptions: &corev3.HttpProtocolOptions{
			IdleTimeout: durationpb.New(IdleTimeout),
		},
	}
	return &listenerv3.Listener{
		Name:                          TerminateListener(shoot),
		ListenerSpecifier:             &listenerv3.Listener_InternalListener{InternalListener: &listenerv3.Listener_InternalListenerConfig{}},
		PerConnectionBufferLimitBytes: wrapperspb.UInt32(PerConnectionBufferLimit),
		FilterChains: []*listenerv3.FilterChain{{
			Name: TerminateListener(shoot),
			TransportSocket: &corev3.TransportSocket{
				Name:       TLSTransportSocket,
				ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: mustAny(tlsCtx)},
			},
			Filters: []*listenerv3.Filter{{Name: HCMFilter, ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(hcm)}}},
		}},
	}
}

// terminateCluster is one of a terminating shoot's upstream clusters: its kube-apiserver
// endpoints, least outstanding requests first, over TLS with the front-proxy certificate, the
// replica's certificate verified for name, speaking protocol (alpn).
func terminateCluster(name, shoot, apiserverName, alpn string, protocol *httpv3.HttpProtocolOptions_ExplicitHttpConfig) *clusterv3.Cluster {
	c := edsCluster(name, APIServerService(shoot))
	c.LbPolicy = clusterv3.Cluster_LEAST_REQUEST
	c.TypedExtensionProtocolOptions = map[string]*anypb.Any{HTTPProtocolOptions: mustAny(&httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: protocol},
	})}
	c.TransportSocket = &corev3.TransportSocket{
		Name: TLSTransportSocket,
		ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: mustAny(&tlsv3.UpstreamTlsContext{
			CommonTlsContext: &tlsv3.CommonTlsContext{
				TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{sds(FrontProxySecret(shoot))},
				ValidationContextType: &tlsv3.CommonTlsContext_CombinedValidationContext{CombinedValidationContext: &tlsv3.CommonTlsContext_CombinedCertificateValidationContext{
					DefaultValidationContext: &tlsv3.CertificateValidationContext{MatchTypedSubjectAltNames: []*tlsv3.SubjectAltNameMatcher{{
						SanType: tlsv3.SubjectAltNameMatcher_DNS,
						Matcher: &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: apiserverName}},
					}}},
					ValidationContextSdsSecretConfig: sds(APIServerCASecret(shoot)),
				}},
				AlpnProtocols: []string{alpn},
			},
			Sni: apiserverName,
		})},
	}
	return c
}

// sds names a secret served over the same ADS stream.
func sds(name string) *tlsv3.SdsSecretConfig {
	return &tlsv3.SdsSecretConfig{Name: name, SdsConfig: &corev3.ConfigSource{
		ResourceApiVersion:    corev3.ApiVersion_V3,
		ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
	}}
}

func certificateSecret(name string, cert, key []byte) *tlsv3.Secret {
	return &tlsv3.Secret{Name: name, Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
		CertificateChain: &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: cert}},
		PrivateKey:       &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: key}},
	}}}
}

func caSecret(name string, bundle []byte) *tlsv3.Secret {
	return &tlsv3.Secret{Name: name, Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
		TrustedCa: &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: bundle}},
	}}}
}
