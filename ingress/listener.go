package ingress

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	setfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/common/set_filter_state/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	proxyprotocolv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/proxy_protocol/v3"
	tlsinspectorv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/tls_inspector/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	netsetfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/set_filter_state/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	"google.golang.org/protobuf/proto"
)

// listenerConfig is the subset of an Envoy listener tendril-ingress serves: optional PROXY
// protocol and TLS inspection, then filter chains chosen by destination port, each either a
// tcp_proxy (with an optional cluster override) or an HTTP connection manager serving CONNECT.
type listenerConfig struct {
	name string
	// lbProxyProtocol: the load balancer's own PROXY header comes first on every connection (a
	// proxy_protocol filter that does not allow connections without it). tendril-ingress reads
	// it only from trusted peers.
	lbProxyProtocol bool
	// proxyProtocol is set when the listener reads (inner) PROXY headers.
	proxyProtocol *proxyProtocolConfig
	tlsInspector  bool
	// filterTimeout bounds the listener filters (PROXY header, ClientHello).
	filterTimeout time.Duration
	chains        []*chainConfig
}

type proxyProtocolConfig struct {
	// allowWithout lets connections without a header through (the CONNECT path on 8443).
	allowWithout bool
}

// chainConfig is one filter chain.
type chainConfig struct {
	name string
	// destinationPort is the chain's filter_chain_match; 0 matches any.
	destinationPort uint32
	tcp             *tcpProxyConfig
	http            *connectConfig
}

type tcpProxyConfig struct {
	// clusterFormat renders the cluster override; nil means the default cluster.
	clusterFormat  *format
	defaultCluster string
	idleTimeout    time.Duration
	// connectAttempts is how many dials a connection makes, each to the next endpoint.
	connectAttempts int
}

// maxConnectAttempts bounds tcp_proxy's max_connect_attempts: each attempt may take the cluster's
// whole connect timeout while the client waits.
const maxConnectAttempts = 10

// connectConfig is an HTTP connection manager that serves CONNECT: its routes in order.
type connectConfig struct {
	routes         []connectRoute
	headersTimeout time.Duration
	maxHeaderBytes int
	idleTimeout    time.Duration
}

type connectRoute struct {
	name string
	// connect matches CONNECT requests; otherwise the route matches other methods by prefix.
	connect bool
	prefix  string
	headers []headerMatch
	// Exactly one action: a cluster named by a request header (the CONNECT is terminated), a
	// fixed cluster the CONNECT request itself is relayed to (its upstream answers it), or a
	// fixed response.
	clusterHeader string
	relayCluster  string
	status        int
	body          string
}

type headerMatch struct {
	name  string
	regex *regexp.Regexp
}

// chain picks the chain for a connection to port: an exact destination port match before a
// chain without one, as Envoy does.
func (lc *listenerConfig) chain(port uint16) *chainConfig {
	var fallback *chainConfig
	for _, c := range lc.chains {
		switch c.destinationPort {
		case uint32(port):
			return c
		case 0:
			if fallback == nil {
				fallback = c
			}
		}
	}
	return fallback
}

func typeURL(m proto.Message) string { return "type.googleapis.com/" + string(proto.MessageName(m)) }

func parseListener(l *listenerv3.Listener) (*listenerConfig, error) {
	if err := checkOnly(l, "name", "address", "listener_filters", "listener_filters_timeout",
		"continue_on_listener_filters_timeout", "filter_chains", "per_connection_buffer_limit_bytes", "stat_prefix"); err != nil {
		return nil, err
	}
	if l.GetContinueOnListenerFiltersTimeout() {
		return nil, errors.New("continue_on_listener_filters_timeout is not supported: a connection without its header or ClientHello has no route")
	}
	lc := &listenerConfig{name: l.GetName(), filterTimeout: defaultHelloTimeout}
	if d := l.GetListenerFiltersTimeout(); d != nil {
		lc.filterTimeout = d.AsDuration()
	}
	for _, f := range l.GetListenerFilters() {
		if err := checkOnly(f, "name", "typed_config"); err != nil {
			return nil, err
		}
		switch cfg := f.GetTypedConfig(); cfg.GetTypeUrl() {
		case typeURL(&tlsinspectorv3.TlsInspector{}):
			ti, err := unpack(cfg, &tlsinspectorv3.TlsInspector{})
			if err != nil {
				return nil, err
			}
			if err := checkOnly(ti); err != nil {
				return nil, err
			}
			lc.tlsInspector = true
		case typeURL(&proxyprotocolv3.ProxyProtocol{}):
			pp, err := unpack(cfg, &proxyprotocolv3.ProxyProtocol{})
			if err != nil {
				return nil, err
			}
			if err := checkOnly(pp, "allow_requests_without_proxy_protocol"); err != nil {
				return nil, err
			}
			if lc.proxyProtocol != nil || lc.tlsInspector {
				return nil, errors.New("proxy_protocol filters must come first: the load balancer's, then the inner one")
			}
			if !pp.GetAllowRequestsWithoutProxyProtocol() {
				if lc.lbProxyProtocol {
					return nil, errors.New("two required proxy_protocol filters")
				}
				lc.lbProxyProtocol = true
				continue
			}
			lc.proxyProtocol = &proxyProtocolConfig{allowWithout: true}
		default:
			return nil, fmt.Errorf("listener filter %s (%s) is not supported", f.GetName(), cfg.GetTypeUrl())
		}
	}
	if len(l.GetFilterChains()) == 0 {
		return nil, errors.New("no filter chains")
	}
	ports := map[uint32]bool{}
	for _, fc := range l.GetFilterChains() {
		c, err := parseChain(fc)
		if err != nil {
			return nil, fmt.Errorf("filter chain %s: %w", fc.GetName(), err)
		}
		if ports[c.destinationPort] {
			return nil, fmt.Errorf("two filter chains match destination port %d", c.destinationPort)
		}
		ports[c.destinationPort] = true
		if f := c.tcp.format(); f != nil && f.uses(opServerName) && !lc.tlsInspector {
			return nil, errors.New("%REQUESTED_SERVER_NAME% needs the tls_inspector listener filter")
		}
		if c.http != nil && lc.tlsInspector {
			return nil, errors.New("an HTTP chain behind tls_inspector is not supported")
		}
		lc.chains = append(lc.chains, c)
	}
	return lc, nil
}

func (t *tcpProxyConfig) format() *format {
	if t == nil {
		return nil
	}
	return t.clusterFormat
}

func (f *format) uses(op string) bool {
	return slices.ContainsFunc(f.parts, func(p formatPart) bool { return p.op == op })
}

func parseChain(fc *listenerv3.FilterChain) (*chainConfig, error) {
	if err := checkOnly(fc, "name", "filters", "filter_chain_match"); err != nil {
		return nil, err
	}
	c := &chainConfig{name: fc.GetName()}
	if m := fc.GetFilterChainMatch(); m != nil {
		if err := checkOnly(m, "destination_port"); err != nil {
			return nil, err
		}
		c.destinationPort = m.GetDestinationPort().GetValue()
	}
	filters := fc.GetFilters()
	if len(filters) == 0 {
		return nil, errors.New("no filters")
	}
	var clusterFormat *format
	for i, f := range filters {
		if err := checkOnly(f, "name", "typed_config"); err != nil {
			return nil, err
		}
		last := i == len(filters)-1
		switch cfg := f.GetTypedConfig(); cfg.GetTypeUrl() {
		case typeURL(&netsetfilterstatev3.Config{}):
			if last {
				return nil, errors.New("set_filter_state must be followed by tcp_proxy")
			}
			sfs, err := unpack(cfg, &netsetfilterstatev3.Config{})
			if err != nil {
				return nil, err
			}
			if clusterFormat, err = parseSetFilterState(sfs); err != nil {
				return nil, err
			}
		case typeURL(&tcpproxyv3.TcpProxy{}):
			if !last {
				return nil, errors.New("tcp_proxy must be the last filter")
			}
			tp, err := unpack(cfg, &tcpproxyv3.TcpProxy{})
			if err != nil {
				return nil, err
			}
			if c.tcp, err = parseTCPProxy(tp); err != nil {
				return nil, err
			}
			c.tcp.clusterFormat = clusterFormat
		case typeURL(&hcmv3.HttpConnectionManager{}):
			if i != 0 || !last {
				return nil, errors.New("the HTTP connection manager must be the only filter")
			}
			hcm, err := unpack(cfg, &hcmv3.HttpConnectionManager{})
			if err != nil {
				return nil, err
			}
			if c.http, err = parseConnectManager(hcm); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("network filter %s (%s) is not supported", f.GetName(), cfg.GetTypeUrl())
		}
	}
	return c, nil
}

func parseTCPProxy(tp *tcpproxyv3.TcpProxy) (*tcpProxyConfig, error) {
	if err := checkOnly(tp, "stat_prefix", "cluster", "idle_timeout", "max_connect_attempts"); err != nil {
		return nil, err
	}
	t := &tcpProxyConfig{defaultCluster: tp.GetCluster(), idleTimeout: time.Hour, connectAttempts: 1} // Envoy's defaults
	if n := tp.GetMaxConnectAttempts(); n != nil {
		// Envoy requires at least 1; more than a few only multiplies the connect timeout.
		if n.GetValue() < 1 || n.GetValue() > maxConnectAttempts {
			return nil, fmt.Errorf("tcp_proxy max_connect_attempts %d: must be 1 to %d", n.GetValue(), maxConnectAttempts)
		}
		t.connectAttempts = int(n.GetValue())
	}
	if d := tp.GetIdleTimeout(); d != nil {
		t.idleTimeout = d.AsDuration() // 0 disables it, as in Envoy
	}
	return t, nil
}

func parseSetFilterState(c *netsetfilterstatev3.Config) (*format, error) {
	if err := checkOnly(c, "on_new_connection"); err != nil {
		return nil, err
	}
	var f *format
	for _, v := range c.GetOnNewConnection() {
		if err := checkOnly(v, "object_key", "format_string", "read_only", "shared_with_upstream"); err != nil {
			return nil, err
		}
		if k := v.GetObjectKey(); k != "envoy.tcp_proxy.cluster" {
			return nil, fmt.Errorf("set_filter_state object key %q is not supported", k)
		}
		if v.GetSharedWithUpstream() != setfilterstatev3.FilterStateValue_NONE {
			return nil, errors.New("set_filter_state shared_with_upstream is not supported")
		}
		fs := v.GetFormatString()
		if err := checkOnly(fs, "text_format_source"); err != nil {
			return nil, err
		}
		src := fs.GetTextFormatSource()
		if _, ok := src.GetSpecifier().(*corev3.DataSource_InlineString); !ok {
			return nil, errors.New("set_filter_state format: only inline_string is supported")
		}
		var err error
		if f, err = parseFormat(src.GetInlineString()); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// Envoy's defaults for the connection manager fields tendril may leave unset.
const (
	defaultMaxRequestHeadersKB = 60
	defaultStreamIdleTimeout   = 5 * time.Minute
)

func parseConnectManager(h *hcmv3.HttpConnectionManager) (*connectConfig, error) {
	if err := checkOnly(h, "stat_prefix", "codec_type", "route_config", "http_filters", "upgrade_configs",
		"stream_idle_timeout", "request_headers_timeout", "max_request_headers_kb"); err != nil {
		return nil, err
	}
	switch h.GetCodecType() {
	case hcmv3.HttpConnectionManager_AUTO, hcmv3.HttpConnectionManager_HTTP1:
	default:
		return nil, fmt.Errorf("codec %s is not supported: CONNECT is served over HTTP/1.1", h.GetCodecType())
	}
	if len(h.GetHttpFilters()) != 1 || h.GetHttpFilters()[0].GetTypedConfig().GetTypeUrl() != typeURL(&routerv3.Router{}) {
		return nil, errors.New("http_filters: exactly the router is supported")
	}
	if err := checkOnly(h.GetHttpFilters()[0], "name", "typed_config"); err != nil {
		return nil, err
	}
	router, err := unpack(h.GetHttpFilters()[0].GetTypedConfig(), &routerv3.Router{})
	if err != nil {
		return nil, err
	}
	if err := checkOnly(router); err != nil {
		return nil, err
	}
	connectUpgrade := false
	for _, u := range h.GetUpgradeConfigs() {
		if err := checkOnly(u, "upgrade_type"); err != nil {
			return nil, err
		}
		if u.GetUpgradeType() != "CONNECT" {
			return nil, fmt.Errorf("upgrade %q is not supported", u.GetUpgradeType())
		}
		connectUpgrade = true
	}
	cc := &connectConfig{
		headersTimeout: 0,
		maxHeaderBytes: defaultMaxRequestHeadersKB << 10,
		idleTimeout:    defaultStreamIdleTimeout,
	}
	if d := h.GetRequestHeadersTimeout(); d != nil {
		cc.headersTimeout = d.AsDuration()
	}
	if cc.headersTimeout == 0 {
		// Envoy would wait forever; a data plane that never times out a request is a
		// slow-loris target, so tendril-ingress refuses the configuration instead.
		return nil, errors.New("request_headers_timeout must be set")
	}
	if kb := h.GetMaxRequestHeadersKb(); kb != nil {
		cc.maxHeaderBytes = int(kb.GetValue()) << 10
	}
	if d := h.GetStreamIdleTimeout(); d != nil {
		cc.idleTimeout = d.AsDuration()
	}
	rc := h.GetRouteConfig()
	if rc == nil {
		return nil, errors.New("an inline route_config is required (RDS is not supported)")
	}
	if err := checkOnly(rc, "name", "virtual_hosts"); err != nil {
		return nil, err
	}
	if len(rc.GetVirtualHosts()) != 1 {
		return nil, errors.New("exactly one virtual host is supported")
	}
	vh := rc.GetVirtualHosts()[0]
	if err := checkOnly(vh, "name", "domains", "routes"); err != nil {
		return nil, err
	}
	if !slices.Equal(vh.GetDomains(), []string{"*"}) {
		return nil, errors.New(`virtual host domains must be ["*"]`)
	}
	for _, r := range vh.GetRoutes() {
		cr, err := parseRoute(r, connectUpgrade)
		if err != nil {
			return nil, fmt.Errorf("route %s: %w", r.GetName(), err)
		}
		cc.routes = append(cc.routes, cr)
	}
	return cc, nil
}

func parseRoute(r *routev3.Route, connectUpgrade bool) (connectRoute, error) {
	cr := connectRoute{name: r.GetName()}
	if err := checkOnly(r, "name", "match", "route", "direct_response"); err != nil {
		return cr, err
	}
	m := r.GetMatch()
	if err := checkOnly(m, "connect_matcher", "prefix", "headers"); err != nil {
		return cr, err
	}
	switch ps := m.GetPathSpecifier().(type) {
	case *routev3.RouteMatch_ConnectMatcher_:
		if !connectUpgrade {
			return cr, errors.New("connect_matcher without the CONNECT upgrade")
		}
		cr.connect = true
	case *routev3.RouteMatch_Prefix:
		cr.prefix = ps.Prefix
	default:
		return cr, errors.New("only connect_matcher and prefix matches are supported")
	}
	for _, hm := range m.GetHeaders() {
		if err := checkOnly(hm, "name", "string_match"); err != nil {
			return cr, err
		}
		sm := hm.GetStringMatch()
		if err := checkOnly(sm, "safe_regex"); err != nil {
			return cr, err
		}
		if err := checkOnly(sm.GetSafeRegex(), "regex"); err != nil {
			return cr, err
		}
		// Envoy's safe_regex is RE2, as Go's regexp is; a full match is required.
		re, err := regexp.Compile(sm.GetSafeRegex().GetRegex())
		if err != nil {
			return cr, fmt.Errorf("header %s regex: %w", hm.GetName(), err)
		}
		cr.headers = append(cr.headers, headerMatch{name: hm.GetName(), regex: re})
	}
	switch a := r.GetAction().(type) {
	case *routev3.Route_Route:
		ra := a.Route
		if err := checkOnly(ra, "cluster_header", "cluster", "timeout", "upgrade_configs"); err != nil {
			return cr, err
		}
		if t := ra.GetTimeout(); t == nil || t.AsDuration() != 0 {
			return cr, errors.New("a CONNECT route must disable the route timeout (timeout: 0s)")
		}
		if !cr.connect || len(ra.GetUpgradeConfigs()) != 1 || ra.GetUpgradeConfigs()[0].GetUpgradeType() != "CONNECT" {
			return cr, errors.New("a cluster route must be a CONNECT route")
		}
		u := ra.GetUpgradeConfigs()[0]
		if err := checkOnly(u, "upgrade_type", "connect_config"); err != nil {
			return cr, err
		}
		// Envoy terminates a CONNECT whose upgrade has connect_config and proxies it, request
		// and all, otherwise; tendril generates the first with a header-named cluster and the
		// second with a fixed one.
		switch {
		case ra.GetClusterHeader() != "" && u.GetConnectConfig() != nil:
			if err := checkOnly(u.GetConnectConfig()); err != nil {
				return cr, err
			}
			cr.clusterHeader = ra.GetClusterHeader()
		case ra.GetCluster() != "" && u.GetConnectConfig() == nil:
			cr.relayCluster = ra.GetCluster()
		default:
			return cr, errors.New("only a terminated CONNECT to a cluster_header and a proxied CONNECT to a cluster are supported")
		}
	case *routev3.Route_DirectResponse:
		dr := a.DirectResponse
		if err := checkOnly(dr, "status", "body"); err != nil {
			return cr, err
		}
		if dr.GetStatus() < 200 || dr.GetStatus() > 599 {
			return cr, fmt.Errorf("direct response status %d", dr.GetStatus())
		}
		cr.status = int(dr.GetStatus())
		if b := dr.GetBody(); b != nil {
			if _, ok := b.GetSpecifier().(*corev3.DataSource_InlineString); !ok {
				return cr, errors.New("direct response body: only inline_string is supported")
			}
			cr.body = b.GetInlineString()
		}
	default:
		return cr, errors.New("only route and direct_response actions are supported")
	}
	return cr, nil
}
