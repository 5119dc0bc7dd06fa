package charts

import (
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	// The typed configs the bootstrap packs in Any, registered for protojson and Validate.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/bootstrap/internal_listener/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/resource_monitors/downstream_connections/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/resource_monitors/fixed_heap/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/xds/translate"
)

// checkEnvoyBootstrap parses the bootstrap as Envoy would (YAML → proto, unknown fields
// rejected), validates it and every typed config in it, and checks what the chart promises:
// delta ADS to the xDS Service, admin on loopback only, the overload manager and buffer limits,
// and no static listener on a port xds/translate's listeners bind.
func checkEnvoyBootstrap(t *testing.T, data map[string]string, xdsAddr string, statsPort int32, certDir string) {
	t.Helper()
	text := data["envoy.yaml"]
	j, err := yaml.YAMLToJSON([]byte(text))
	if err != nil {
		t.Fatalf("envoy.yaml: %v", err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(j, &b); err != nil {
		t.Fatalf("envoy.yaml is no Envoy bootstrap: %v", err)
	}
	if err := translate.Validate(&b); err != nil {
		t.Fatalf("envoy.yaml: %v", err)
	}

	ads := b.GetDynamicResources().GetAdsConfig()
	if ads.GetApiType() != corev3.ApiConfigSource_DELTA_GRPC || ads.GetTransportApiVersion() != corev3.ApiVersion_V3 {
		t.Errorf("ads_config %v: want delta gRPC, v3", ads)
	}
	for name, cs := range map[string]*corev3.ConfigSource{"lds": b.GetDynamicResources().GetLdsConfig(), "cds": b.GetDynamicResources().GetCdsConfig()} {
		if cs.GetAds() == nil {
			t.Errorf("%s_config is not ADS", name)
		}
	}
	if len(ads.GetGrpcServices()) != 1 {
		t.Fatalf("ads_config: %d gRPC services", len(ads.GetGrpcServices()))
	}
	xdsCluster := ads.GetGrpcServices()[0].GetEnvoyGrpc().GetClusterName()
	var found bool
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() != xdsCluster {
			continue
		}
		found = true
		sa := c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress()
		if got := net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))); got != xdsAddr {
			t.Errorf("xDS cluster %s dials %s, want %s", xdsCluster, got, xdsAddr)
		}
		if c.GetPerConnectionBufferLimitBytes().GetValue() == 0 {
			t.Errorf("xDS cluster: no per_connection_buffer_limit_bytes")
		}
		if len(c.GetTypedExtensionProtocolOptions()) == 0 {
			t.Errorf("xDS cluster: no HTTP/2 (gRPC needs it)")
		}
		checkXDSTLS(t, c, data, sa.GetAddress(), certDir)
	}
	if !found {
		t.Errorf("no static cluster %s for ADS", xdsCluster)
	}
	if b.GetNode().GetCluster() == "" {
		t.Errorf("node.cluster empty")
	}
	if a := b.GetAdmin().GetAddress().GetSocketAddress().GetAddress(); a != "127.0.0.1" {
		t.Errorf("admin listens on %q, want 127.0.0.1 only", a)
	}
	om := b.GetOverloadManager()
	if len(om.GetResourceMonitors()) == 0 || len(om.GetActions()) == 0 {
		t.Errorf("overload_manager without monitors or actions: %v", om)
	}
	translated := map[uint32]string{translate.SNIPort: translate.SNIListener, translate.ProxyPort: translate.ProxyListener, translate.TunnelPort: translate.TunnelListener}
	var stats bool
	for _, l := range b.GetStaticResources().GetListeners() {
		port := l.GetAddress().GetSocketAddress().GetPortValue()
		if name, ok := translated[port]; ok || l.GetName() == translate.SNIListener || l.GetName() == translate.ProxyListener || l.GetName() == translate.TunnelListener {
			t.Errorf("static listener %s on port %d collides with xDS listener %s", l.GetName(), port, name)
		}
		if l.GetPerConnectionBufferLimitBytes().GetValue() == 0 {
			t.Errorf("static listener %s: no per_connection_buffer_limit_bytes", l.GetName())
		}
		if port == uint32(statsPort) {
			stats = true
		}
	}
	if !stats {
		t.Errorf("no static listener on the metrics port %d", statsPort)
	}
}

// checkXDSTLS checks the xDS cluster's mutual TLS: an UpstreamTlsContext whose certificate and
// validation context come from SDS files in the ConfigMap (data), each a valid Secret that reads
// the client Secret's files in certDir, watches certDir for rotation, and verifies the server
// by the xDS Service's name.
func checkXDSTLS(t *testing.T, c *clusterv3.Cluster, data map[string]string, host, certDir string) {
	t.Helper()
	ts := c.GetTransportSocket()
	if ts == nil {
		t.Fatal("xDS cluster: no transport socket (xDS runs over mutual TLS)")
	}
	var up tlsv3.UpstreamTlsContext
	if err := ts.GetTypedConfig().UnmarshalTo(&up); err != nil {
		t.Fatalf("xDS cluster transport socket: %v", err)
	}
	if up.GetSni() != host {
		t.Errorf("xDS TLS SNI %q, want %s", up.GetSni(), host)
	}
	ctx := up.GetCommonTlsContext()
	if !slices.Equal(ctx.GetAlpnProtocols(), []string{"h2"}) {
		t.Errorf("xDS TLS ALPN %q, want h2 (grpc-go refuses a TLS client without it)", ctx.GetAlpnProtocols())
	}
	sds := map[string]*corev3.ConfigSource{}
	for _, s := range ctx.GetTlsCertificateSdsSecretConfigs() {
		sds[s.GetName()] = s.GetSdsConfig()
	}
	if v := ctx.GetValidationContextSdsSecretConfig(); v != nil {
		sds[v.GetName()] = v.GetSdsConfig()
	}
	if len(sds) != 2 {
		t.Fatalf("xDS TLS: SDS secrets %v, want a certificate and a validation context", slices.Collect(maps.Keys(sds)))
	}
	var cert, ca bool
	for name, src := range sds {
		path := src.GetPathConfigSource().GetPath()
		text, ok := data[strings.TrimPrefix(path, "/etc/envoy/")]
		if !strings.HasPrefix(path, "/etc/envoy/") || !ok {
			t.Errorf("SDS secret %s from %q: not a file of the ConfigMap", name, path)
			continue
		}
		j, err := yaml.YAMLToJSON([]byte(text))
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var resp discoveryv3.DiscoveryResponse
		if err := protojson.Unmarshal(j, &resp); err != nil {
			t.Fatalf("%s is no SDS response: %v", path, err)
		}
		if len(resp.GetResources()) != 1 {
			t.Fatalf("%s: %d resources", path, len(resp.GetResources()))
		}
		var sec tlsv3.Secret
		if err := resp.GetResources()[0].UnmarshalTo(&sec); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if err := translate.Validate(&sec); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if sec.GetName() != name {
			t.Errorf("%s holds secret %s, the cluster asks for %s", path, sec.GetName(), name)
		}
		if tc := sec.GetTlsCertificate(); tc != nil {
			cert = true
			if tc.GetCertificateChain().GetFilename() != certDir+"/tls.crt" || tc.GetPrivateKey().GetFilename() != certDir+"/tls.key" || tc.GetWatchedDirectory().GetPath() != certDir {
				t.Errorf("%s: certificate %v, want %s/tls.crt and tls.key, watching %s", path, tc, certDir, certDir)
			}
		}
		if vc := sec.GetValidationContext(); vc != nil {
			ca = true
			if vc.GetTrustedCa().GetFilename() != certDir+"/ca.crt" || vc.GetWatchedDirectory().GetPath() != certDir {
				t.Errorf("%s: validation context %v, want %s/ca.crt, watching %s", path, vc, certDir, certDir)
			}
			sans := vc.GetMatchTypedSubjectAltNames()
			if len(sans) != 1 || sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_DNS || sans[0].GetMatcher().GetExact() != host {
				t.Errorf("%s: server names %v, want DNS %s", path, sans, host)
			}
		}
	}
	if !cert || !ca {
		t.Errorf("xDS TLS: certificate %v, validation context %v", cert, ca)
	}
}
