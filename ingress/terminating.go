package ingress

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	luav3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/lua/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/tendril-net/tendril/wire"
)

// The terminating mode as tendril-ingress reads it from xDS (xds/translate's terminate.go): a
// terminating shoot's "sni|<host>" clusters name an internal listener; that listener ends TLS
// with an SDS certificate, runs exactly wire.AuthProxyLua (done natively by ingress/terminate)
// and routes upgrades and other requests to two upstream clusters over TLS with an SDS client
// certificate. Anything else in these resources is refused, as everywhere in the ingress.

// terminateConfig is one internal listener that terminates a shoot's TLS.
type terminateConfig struct {
	name           string
	servingSecret  string
	clientCASecret string
	// cluster carries requests over HTTP/2, upgradeCluster upgrades over HTTP/1.1.
	cluster, upgradeCluster string
	idleTimeout             time.Duration
	headersTimeout          time.Duration
	maxHeaderBytes          int
}

// upstreamTLS is a terminating shoot's upstream cluster's TLS: the client certificate (an SDS
// secret), the CA that verifies kube-apiserver (another) for name, and the protocol.
type upstreamTLS struct {
	certSecret, caSecret string
	name                 string
	http2                bool
}

// secretConfig is an SDS secret: a certificate with its key, or a CA bundle.
type secretConfig struct {
	cert *tls.Certificate
	cas  *x509.CertPool
}

const (
	tlsTransportSocket  = "envoy.transport_sockets.tls"
	httpProtocolOptions = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
)

// internalListener reports whether l is an internal listener (it has no address).
func internalListener(l *listenerv3.Listener) bool { return l.GetInternalListener() != nil }

func parseTerminateListener(l *listenerv3.Listener) (*terminateConfig, error) {
	if err := checkOnly(l, "name", "internal_listener", "filter_chains", "per_connection_buffer_limit_bytes"); err != nil {
		return nil, err
	}
	if err := checkOnly(l.GetInternalListener()); err != nil {
		return nil, err
	}
	if len(l.GetFilterChains()) != 1 {
		return nil, errors.New("an internal listener has exactly one filter chain")
	}
	fc := l.GetFilterChains()[0]
	if err := checkOnly(fc, "name", "transport_socket", "filters"); err != nil {
		return nil, err
	}
	tc := &terminateConfig{name: l.GetName()}
	ts := fc.GetTransportSocket()
	if err := checkOnly(ts, "name", "typed_config"); err != nil {
		return nil, err
	}
	dtc, err := unpack(ts.GetTypedConfig(), &tlsv3.DownstreamTlsContext{})
	if err != nil {
		return nil, fmt.Errorf("transport socket: %w", err)
	}
	if err := checkOnly(dtc, "common_tls_context", "require_client_certificate"); err != nil {
		return nil, err
	}
	if dtc.GetRequireClientCertificate().GetValue() {
		return nil, errors.New("require_client_certificate is not supported: bearer tokens need no certificate")
	}
	if tc.servingSecret, tc.clientCASecret, err = parseCommonTLS(dtc.GetCommonTlsContext(), true); err != nil {
		return nil, err
	}
	if len(fc.GetFilters()) != 1 {
		return nil, errors.New("a terminating chain has exactly the HTTP connection manager")
	}
	f := fc.GetFilters()[0]
	if err := checkOnly(f, "name", "typed_config"); err != nil {
		return nil, err
	}
	hcm, err := unpack(f.GetTypedConfig(), &hcmv3.HttpConnectionManager{})
	if err != nil {
		return nil, err
	}
	if err := parseTerminateManager(hcm, tc); err != nil {
		return nil, err
	}
	return tc, nil
}

// parseCommonTLS reads the TLS context both sides share: one SDS certificate and a combined
// validation context with an SDS CA. Downstream, it must accept any certificate at the
// handshake (the authenticating proxy judges it per request); upstream it names the one SAN
// kube-apiserver's certificate must carry.
func parseCommonTLS(c *tlsv3.CommonTlsContext, downstream bool) (cert, ca string, err error) {
	if err := checkOnly(c, "tls_certificate_sds_secret_configs", "combined_validation_context", "alpn_protocols"); err != nil {
		return "", "", err
	}
	certs := c.GetTlsCertificateSdsSecretConfigs()
	if len(certs) != 1 {
		return "", "", errors.New("exactly one SDS certificate is supported")
	}
	if cert, err = parseSDS(certs[0]); err != nil {
		return "", "", err
	}
	cvc := c.GetCombinedValidationContext()
	if err := checkOnly(cvc, "default_validation_context", "validation_context_sds_secret_config"); err != nil {
		return "", "", err
	}
	if ca, err = parseSDS(cvc.GetValidationContextSdsSecretConfig()); err != nil {
		return "", "", err
	}
	dvc := cvc.GetDefaultValidationContext()
	if downstream {
		if err := checkOnly(dvc, "trust_chain_verification"); err != nil {
			return "", "", err
		}
		if dvc.GetTrustChainVerification() != tlsv3.CertificateValidationContext_ACCEPT_UNTRUSTED {
			return "", "", errors.New("a terminating listener accepts untrusted client certificates (the authenticating proxy answers them with 401)")
		}
	} else if err := checkOnly(dvc, "match_typed_subject_alt_names"); err != nil {
		return "", "", err
	}
	return cert, ca, nil
}

func parseSDS(s *tlsv3.SdsSecretConfig) (string, error) {
	if err := checkOnly(s, "name", "sds_config"); err != nil {
		return "", err
	}
	if _, ok := s.GetSdsConfig().GetConfigSourceSpecifier().(*corev3.ConfigSource_Ads); !ok || s.GetName() == "" {
		return "", errors.New("an SDS secret is named and comes over ADS")
	}
	return s.GetName(), nil
}

func parseTerminateManager(h *hcmv3.HttpConnectionManager, tc *terminateConfig) error {
	if err := checkOnly(h, "stat_prefix", "codec_type", "route_config", "http_filters", "upgrade_configs", "use_remote_address",
		"stream_idle_timeout", "request_headers_timeout", "max_request_headers_kb", "common_http_protocol_options"); err != nil {
		return err
	}
	if h.GetCodecType() != hcmv3.HttpConnectionManager_AUTO {
		return errors.New("a terminating listener speaks HTTP/1.1 and HTTP/2 (codec AUTO)")
	}
	filters := h.GetHttpFilters()
	if len(filters) != 2 {
		return errors.New("http_filters: exactly the authenticating proxy (Lua) and the router")
	}
	for _, f := range filters {
		if err := checkOnly(f, "name", "typed_config"); err != nil {
			return err
		}
	}
	lua, err := unpack(filters[0].GetTypedConfig(), &luav3.Lua{})
	if err != nil {
		return err
	}
	if err := checkOnly(lua, "default_source_code"); err != nil {
		return err
	}
	if lua.GetDefaultSourceCode().GetInlineString() != wire.AuthProxyLua {
		return errors.New("the Lua filter must be wire.AuthProxyLua, which tendril-ingress implements natively; other Lua code is not supported")
	}
	if filters[1].GetTypedConfig().GetTypeUrl() != typeURL(&routerv3.Router{}) {
		return errors.New("http_filters: the router comes last")
	}
	// The authenticating proxy replaces X-Forwarded-For with the client's address, as
	// use_remote_address does.
	if !h.GetUseRemoteAddress().GetValue() {
		return errors.New("use_remote_address must be set: X-Forwarded-For is the client's address")
	}
	kinds := map[string]bool{}
	for _, u := range h.GetUpgradeConfigs() {
		if err := checkOnly(u, "upgrade_type"); err != nil {
			return err
		}
		kinds[u.GetUpgradeType()] = true
	}
	if len(kinds) != 2 || !kinds["websocket"] || !kinds["SPDY/3.1"] {
		return errors.New("upgrade_configs: exactly websocket and SPDY/3.1 (kubectl exec, attach, port-forward)")
	}
	tc.idleTimeout = defaultStreamIdleTimeout
	if d := h.GetStreamIdleTimeout(); d != nil {
		tc.idleTimeout = d.AsDuration()
	}
	if o := h.GetCommonHttpProtocolOptions(); o != nil {
		if err := checkOnly(o, "idle_timeout"); err != nil {
			return err
		}
		// One idle bound serves both: the ingress's HTTP server closes a connection without
		// requests after it, and a stream without bytes ends with its connection.
		if d := o.GetIdleTimeout().AsDuration(); d != tc.idleTimeout {
			return fmt.Errorf("common idle_timeout %v must equal stream_idle_timeout %v", d, tc.idleTimeout)
		}
	}
	tc.headersTimeout = 10 * time.Second
	if d := h.GetRequestHeadersTimeout(); d != nil {
		tc.headersTimeout = d.AsDuration()
	}
	tc.maxHeaderBytes = defaultMaxRequestHeadersKB << 10
	if kb := h.GetMaxRequestHeadersKb(); kb != nil {
		tc.maxHeaderBytes = int(kb.GetValue()) << 10
	}
	return parseTerminateRoutes(h.GetRouteConfig(), tc)
}

// parseTerminateRoutes reads the two routes: requests with an upgrade header to one cluster,
// the rest to the other; neither with a route timeout (watches last).
func parseTerminateRoutes(rc *routev3.RouteConfiguration, tc *terminateConfig) error {
	if err := checkOnly(rc, "name", "virtual_hosts"); err != nil {
		return err
	}
	if len(rc.GetVirtualHosts()) != 1 {
		return errors.New("a terminating route configuration has one virtual host")
	}
	vh := rc.GetVirtualHosts()[0]
	if err := checkOnly(vh, "name", "domains", "routes"); err != nil {
		return err
	}
	if len(vh.GetDomains()) != 1 || vh.GetDomains()[0] != "*" || len(vh.GetRoutes()) != 2 {
		return errors.New("a terminating virtual host serves domain * with two routes: upgrades, then the rest")
	}
	for i, r := range vh.GetRoutes() {
		if err := checkOnly(r, "name", "match", "route"); err != nil {
			return err
		}
		m := r.GetMatch()
		if err := checkOnly(m, "prefix", "headers"); err != nil {
			return err
		}
		if m.GetPrefix() != "/" {
			return errors.New("terminating routes match prefix /")
		}
		a := r.GetRoute()
		if err := checkOnly(a, "cluster", "timeout"); err != nil {
			return err
		}
		if a.GetTimeout() == nil || a.GetTimeout().AsDuration() != 0 {
			return errors.New("terminating routes have no route timeout (timeout 0s): watches last")
		}
		if i == 0 {
			hs := m.GetHeaders()
			if len(hs) != 1 || hs[0].GetName() != "upgrade" || !hs[0].GetPresentMatch() {
				return errors.New("the first terminating route matches the upgrade header's presence")
			}
			if err := checkOnly(hs[0], "name", "present_match"); err != nil {
				return err
			}
			tc.upgradeCluster = a.GetCluster()
		} else {
			if len(m.GetHeaders()) != 0 {
				return errors.New("the second terminating route matches every request")
			}
			tc.cluster = a.GetCluster()
		}
	}
	return nil
}

// parseUpstreamTLS reads a terminating shoot's upstream cluster's transport socket and HTTP
// protocol; c has been checked for its other fields.
func parseUpstreamTLS(c *clusterv3.Cluster) (*upstreamTLS, error) {
	ts := c.GetTransportSocket()
	if err := checkOnly(ts, "name", "typed_config"); err != nil {
		return nil, err
	}
	utc, err := unpack(ts.GetTypedConfig(), &tlsv3.UpstreamTlsContext{})
	if err != nil {
		return nil, fmt.Errorf("transport socket: %w", err)
	}
	if err := checkOnly(utc, "common_tls_context", "sni"); err != nil {
		return nil, err
	}
	u := &upstreamTLS{}
	if u.certSecret, u.caSecret, err = parseCommonTLS(utc.GetCommonTlsContext(), false); err != nil {
		return nil, err
	}
	sans := utc.GetCommonTlsContext().GetCombinedValidationContext().GetDefaultValidationContext().GetMatchTypedSubjectAltNames()
	if len(sans) != 1 || sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_DNS || sans[0].GetMatcher().GetExact() == "" {
		return nil, errors.New("kube-apiserver's certificate is matched by exactly one DNS name")
	}
	if err := checkOnly(sans[0].GetMatcher(), "exact"); err != nil {
		return nil, err
	}
	u.name = sans[0].GetMatcher().GetExact()
	if utc.GetSni() != u.name {
		return nil, fmt.Errorf("sni %q must be the name kube-apiserver's certificate is matched by (%q)", utc.GetSni(), u.name)
	}
	opts := c.GetTypedExtensionProtocolOptions()
	if len(opts) != 1 || opts[httpProtocolOptions] == nil {
		return nil, errors.New("a TLS cluster has exactly " + httpProtocolOptions)
	}
	hpo, err := unpack(opts[httpProtocolOptions], &httpv3.HttpProtocolOptions{})
	if err != nil {
		return nil, err
	}
	if err := checkOnly(hpo, "explicit_http_config"); err != nil {
		return nil, err
	}
	alpn := utc.GetCommonTlsContext().GetAlpnProtocols()
	switch p := hpo.GetExplicitHttpConfig(); {
	case p.GetHttp2ProtocolOptions() != nil && checkOnly(p.GetHttp2ProtocolOptions()) == nil:
		u.http2 = true
		if len(alpn) != 1 || alpn[0] != "h2" {
			return nil, errors.New("an HTTP/2 cluster offers ALPN h2")
		}
	case p.GetHttpProtocolOptions() != nil && checkOnly(p.GetHttpProtocolOptions()) == nil:
		if len(alpn) != 1 || alpn[0] != "http/1.1" {
			return nil, errors.New("an HTTP/1.1 cluster offers ALPN http/1.1")
		}
	default:
		return nil, errors.New("explicit_http_config: HTTP/2 or HTTP/1.1 without options")
	}
	return u, nil
}

// parseInternalAssignment reads a STATIC cluster's one endpoint that names an internal
// listener; ok is false if the assignment names none.
func parseInternalAssignment(c *clusterv3.Cluster) (string, bool, error) {
	la := c.GetLoadAssignment()
	if len(la.GetEndpoints()) != 1 || len(la.GetEndpoints()[0].GetLbEndpoints()) != 1 {
		return "", false, nil
	}
	ep := la.GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint()
	ia := ep.GetAddress().GetEnvoyInternalAddress()
	if ia == nil {
		return "", false, nil
	}
	if err := checkOnly(la, "cluster_name", "endpoints"); err != nil {
		return "", false, err
	}
	if err := checkOnly(la.GetEndpoints()[0], "lb_endpoints"); err != nil {
		return "", false, err
	}
	if err := checkOnly(la.GetEndpoints()[0].GetLbEndpoints()[0], "endpoint"); err != nil {
		return "", false, err
	}
	if err := checkOnly(ep, "address"); err != nil {
		return "", false, err
	}
	if err := checkOnly(ia, "server_listener_name"); err != nil {
		return "", false, err
	}
	if ia.GetServerListenerName() == "" {
		return "", false, errors.New("an internal address names its listener")
	}
	return ia.GetServerListenerName(), true, nil
}

func parseSecret(s *tlsv3.Secret) (*secretConfig, error) {
	if err := checkOnly(s, "name", "tls_certificate", "validation_context"); err != nil {
		return nil, err
	}
	inline := func(d *corev3.DataSource) ([]byte, error) {
		if err := checkOnly(d, "inline_bytes"); err != nil || len(d.GetInlineBytes()) == 0 {
			return nil, errors.New("secret material is inline_bytes")
		}
		return d.GetInlineBytes(), nil
	}
	switch {
	case s.GetTlsCertificate() != nil:
		tc := s.GetTlsCertificate()
		if err := checkOnly(tc, "certificate_chain", "private_key"); err != nil {
			return nil, err
		}
		chain, err := inline(tc.GetCertificateChain())
		if err != nil {
			return nil, err
		}
		key, err := inline(tc.GetPrivateKey())
		if err != nil {
			return nil, err
		}
		cert, err := tls.X509KeyPair(chain, key)
		if err != nil {
			return nil, fmt.Errorf("secret %s: %w", s.GetName(), err)
		}
		return &secretConfig{cert: &cert}, nil
	case s.GetValidationContext() != nil:
		vc := s.GetValidationContext()
		if err := checkOnly(vc, "trusted_ca"); err != nil {
			return nil, err
		}
		b, err := inline(vc.GetTrustedCa())
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("secret %s: no certificate in its trusted_ca", s.GetName())
		}
		return &secretConfig{cas: pool}, nil
	}
	return nil, fmt.Errorf("secret %s: neither a certificate nor a validation context", s.GetName())
}
