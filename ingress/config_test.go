package ingress

import (
	"net/netip"
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	setfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/common/set_filter_state/v3"
	netsetfilterstatev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/set_filter_state/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

func update(t *testing.T, typeURL string, ms ...proto.Message) xdsclient.Update {
	t.Helper()
	u := xdsclient.Update{TypeURL: typeURL, Version: "v1"}
	for _, m := range ms {
		a, err := anypb.New(m)
		if err != nil {
			t.Fatal(err)
		}
		name := ""
		switch r := m.(type) {
		case *listenerv3.Listener:
			name = r.GetName()
		case *clusterv3.Cluster:
			name = r.GetName()
		case *tlsv3.Secret:
			name = r.GetName()
		}
		u.Resources = append(u.Resources, &discoveryv3.Resource{Name: name, Resource: a})
	}
	return u
}

// TestApplyTranslated accepts everything tendril generates.
func TestApplyTranslated(t *testing.T) {
	in := New(Config{Listeners: map[string]string{"sni": "127.0.0.1:0", "proxy": "127.0.0.1:0", "tunnel": "127.0.0.1:0"}})
	r := translate.All(translate.Options{ProxyProtocol: true}, []model.Shoot{{Name: "shoot--a--b", Hosts: []string{"api.b.test"}, APIServer: netip.MustParseAddrPort("10.0.0.1:443")}})
	var clusters, endpoints, listeners []proto.Message
	for _, c := range r.Clusters {
		clusters = append(clusters, c)
	}
	for _, e := range r.Endpoints {
		endpoints = append(endpoints, e)
	}
	for _, l := range r.Listeners {
		listeners = append(listeners, l)
	}
	for _, u := range []xdsclient.Update{
		update(t, resourcev3.ClusterType, clusters...),
		update(t, resourcev3.EndpointType, endpoints...),
		update(t, resourcev3.ListenerType, listeners...),
	} {
		if err := in.Apply(u); err != nil {
			t.Fatalf("%s: %v", u.TypeURL, err)
		}
	}
	c := in.current.Load()
	l := c.listeners[translate.SNIListener]
	if l == nil || !l.tlsInspector || l.filterTimeout != translate.ClientHelloTimeout || len(l.chains) != 1 || l.chains[0].tcp.idleTimeout != translate.IdleTimeout || l.chains[0].tcp.connectAttempts != translate.ConnectAttempts {
		t.Fatalf("sni listener: %+v", l)
	}
	f := l.chains[0].tcp.clusterFormat
	if got := f.render(connInfo{serverName: "api.b.test"}); got != "sni|api.b.test" {
		t.Errorf("format renders %q", got)
	}
	if got := f.render(connInfo{}); got != "sni|-" {
		t.Errorf("format without a server name renders %q, want Envoy's sni|-", got)
	}
	p := c.listeners[translate.ProxyListener]
	if p == nil || p.proxyProtocol == nil || !p.proxyProtocol.allowWithout || p.filterTimeout != translate.ProxyHeaderTimeout {
		t.Fatalf("proxy listener: %+v", p)
	}
	if ch := p.chain(443); ch == nil || ch.tcp == nil || ch.tcp.clusterFormat.render(connInfo{localAddr: "240.0.0.1:443"}) != "proxy|240.0.0.1:443" {
		t.Fatalf("proxy listener, port 443 chain: %+v", ch)
	}
	if ch := p.chain(8443); ch == nil || ch.http == nil || len(ch.http.routes) != 4 || ch.http.maxHeaderBytes != translate.MaxRequestHeadersKB<<10 {
		t.Fatalf("proxy listener, CONNECT chain: %+v", ch)
	}
	if tl := c.listeners[translate.TunnelListener]; tl == nil || tl.chain(8132) == nil || tl.chain(8132).http.routes[1].clusterHeader != translate.ReversedVPNHeader {
		t.Fatalf("tunnel listener: %+v", tl)
	}
	cl := c.clusters["sni|api.b.test"]
	if cl == nil || cl.maxConnections != translate.MaxConnectionsPerCluster || c.upstreams(cl)[0].String() != "10.0.0.1:443" {
		t.Fatalf("cluster: %+v", cl)
	}
	if !in.Ready() {
		t.Error("not ready after a full configuration")
	}
}

// TestApplyRejects NACKs what the ingress cannot serve and keeps the previous configuration.
func TestApplyRejects(t *testing.T) {
	base := translate.Constant(translate.Options{}).Listeners[0]
	mutate := func(f func(l *listenerv3.Listener)) *listenerv3.Listener {
		l := proto.Clone(base).(*listenerv3.Listener)
		f(l)
		return l
	}
	cases := map[string]rejection{
		"unknown listener filter": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			l.ListenerFilters[0].ConfigType = &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAnyT(t, &corev3.Node{})}
		})), "listener filter"},
		"two filter chains": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			l.FilterChains = append(l.FilterChains, l.FilterChains[0])
		})), "two filter chains match"},
		"unsupported field": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			l.DrainType = listenerv3.Listener_MODIFY_ONLY
		})), "drain_type"},
		"continue on timeout": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			l.ContinueOnListenerFiltersTimeout = true
		})), "continue_on_listener_filters_timeout"},
		"unknown operator": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			l.FilterChains[0].Filters[0] = setFilterStateForTest(t, "sni|%START_TIME%")
		})), "%START_TIME%"},
		"too many connect attempts": {update(t, resourcev3.ListenerType, mutate(func(l *listenerv3.Listener) {
			fs := l.FilterChains[0].Filters
			tp := &tcpproxyv3.TcpProxy{}
			if err := fs[len(fs)-1].GetTypedConfig().UnmarshalTo(tp); err != nil {
				t.Fatal(err)
			}
			tp.MaxConnectAttempts = wrapperspb.UInt32(maxConnectAttempts + 1)
			fs[len(fs)-1].ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: mustAnyT(t, tp)}
		})), "max_connect_attempts 11"},
		"strict DNS cluster without endpoints": {update(t, resourcev3.ClusterType, &clusterv3.Cluster{
			Name: "x", ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STRICT_DNS}, ConnectTimeout: durationpb.New(1),
		}), "needs an endpoint"},
		"logical DNS cluster": {update(t, resourcev3.ClusterType, &clusterv3.Cluster{
			Name: "x", ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_LOGICAL_DNS}, ConnectTimeout: durationpb.New(1),
		}), "discovery type"},
		"upstream TLS": {update(t, resourcev3.ClusterType, &clusterv3.Cluster{
			Name: "x", ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
			TransportSocket: &corev3.TransportSocket{Name: "tls"},
		}), "LEAST_REQUEST"},
	}
	applyRejects(t, cases)
}

// rejection is an update the ingress must refuse, with an error that mentions want.
type rejection struct {
	u    xdsclient.Update
	want string
}

// applyRejects applies each case to a new ingress: it must be refused with its reason, and the
// configuration stay as it was.
func applyRejects(t *testing.T, cases map[string]rejection) {
	t.Helper()
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			in := New(Config{Listeners: map[string]string{"sni": "127.0.0.1:0"}})
			before := in.current.Load()
			err := in.Apply(tc.u)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Apply = %v, want an error mentioning %q", err, tc.want)
			}
			if in.current.Load() != before {
				t.Error("a rejected update replaced the configuration")
			}
		})
	}
}

func mustAnyT(t *testing.T, m proto.Message) *anypb.Any {
	t.Helper()
	a, err := anypb.New(m)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// setFilterStateForTest builds a set_filter_state filter that sets the tcp_proxy cluster from f.
func setFilterStateForTest(t *testing.T, f string) *listenerv3.Filter {
	t.Helper()
	cfg := &netsetfilterstatev3.Config{OnNewConnection: []*setfilterstatev3.FilterStateValue{{
		Key: &setfilterstatev3.FilterStateValue_ObjectKey{ObjectKey: translate.TCPProxyClusterKey},
		Value: &setfilterstatev3.FilterStateValue_FormatString{FormatString: &corev3.SubstitutionFormatString{
			Format: &corev3.SubstitutionFormatString_TextFormatSource{TextFormatSource: &corev3.DataSource{
				Specifier: &corev3.DataSource_InlineString{InlineString: f},
			}},
		}},
	}}}
	return &listenerv3.Filter{Name: translate.SetFilterStateFilter, ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAnyT(t, cfg)}}
}

func TestParseFormat(t *testing.T) {
	for in, want := range map[string]string{
		"sni|%REQUESTED_SERVER_NAME%":      "sni|api.x",
		"proxy|%DOWNSTREAM_LOCAL_ADDRESS%": "proxy|10.0.0.1:443",
		"literal":                          "literal",
		"%REQUESTED_SERVER_NAME%|%DOWNSTREAM_LOCAL_ADDRESS%": "api.x|10.0.0.1:443",
	} {
		f, err := parseFormat(in)
		if err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		if got := f.render(connInfo{serverName: "api.x", localAddr: "10.0.0.1:443"}); got != want {
			t.Errorf("%s renders %q, want %q", in, got, want)
		}
	}
	for _, bad := range []string{"sni|%REQUESTED_SERVER_NAME", "%DOWNSTREAM_REMOTE_ADDRESS%", "%%"} {
		if _, err := parseFormat(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
