package charts

import (
	"net"
	"strconv"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	// The typed configs the bootstrap packs in Any, registered for protojson and Validate.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/resource_monitors/downstream_connections/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/resource_monitors/fixed_heap/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/xds/translate"
)

// checkEnvoyBootstrap parses the bootstrap as Envoy would (YAML → proto, unknown fields
// rejected), validates it and every typed config in it, and checks what the chart promises:
// delta ADS to the xDS Service, admin on loopback only, the overload manager and buffer limits,
// and no static listener on a port xds/translate's listeners bind.
func checkEnvoyBootstrap(t *testing.T, text, xdsAddr string, statsPort int32) {
	t.Helper()
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
