package ingress

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	luav3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/lua/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// replicaSeen is what a stand-in kube-apiserver replica reports of a request: which replica it
// is, the identity headers it got, the protocol and the verified front-proxy certificate.
type replicaSeen struct {
	Replica    int      `json:"replica"`
	User       string   `json:"user"`
	Groups     []string `json:"groups"`
	Extra      string   `json:"extra"`
	Proto      string   `json:"proto"`
	FrontProxy string   `json:"frontProxy"`
}

// terminatingShoot is a shoot in the terminating mode with its PKI and replicas: TLS servers
// that require the front-proxy certificate (as kube-apiserver's --requestheader-client-ca-file
// trusts it) and answer with what they saw; "SPDY/3.1" upgrades echo.
type terminatingShoot struct {
	shoot                   model.Shoot
	shootCA, clientCA, fpCA *testpki.CA
	replicas                []*http.Server
}

func newTerminatingShoot(t *testing.T, name, host string, replicas int) *terminatingShoot {
	t.Helper()
	ts := &terminatingShoot{}
	for i, p := range []**testpki.CA{&ts.shootCA, &ts.clientCA, &ts.fpCA} {
		ca, err := testpki.NewCA(fmt.Sprintf("%s ca %d", name, i))
		if err != nil {
			t.Fatal(err)
		}
		*p = ca
	}
	apiCert, err := ts.shootCA.Leaf("kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	ts.shoot = model.Shoot{Name: name, Hosts: []string{host}, Termination: ts.termination(t, host)}
	var wg sync.WaitGroup
	for i := range replicas {
		l := testnet.Listen(t)
		srv := &http.Server{
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{apiCert}, ClientAuth: tls.RequireAndVerifyClientCert,
				ClientCAs: ts.fpCA.Pool, NextProtos: []string{"h2", "http/1.1"}},
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("Upgrade") == "SPDY/3.1" {
					c, brw, err := http.NewResponseController(w).Hijack()
					if err != nil {
						return
					}
					defer c.Close()
					fmt.Fprint(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n")
					brw.Flush()
					line, _ := brw.ReadString('\n')
					fmt.Fprintf(brw, "replica %d: %s", i, line)
					brw.Flush()
					return
				}
				seen := replicaSeen{Replica: i, User: r.Header.Get("X-Remote-User"), Groups: r.Header.Values("X-Remote-Group"),
					Extra: r.Header.Get("X-Remote-Extra-Scopes"), Proto: r.Proto, FrontProxy: r.TLS.PeerCertificates[0].Subject.CommonName}
				_ = json.NewEncoder(w).Encode(seen)
			}),
		}
		ts.replicas = append(ts.replicas, srv)
		ts.shoot.APIServers = append(ts.shoot.APIServers, netip.MustParseAddrPort(l.Addr().String()))
		wg.Go(func() { _ = srv.ServeTLS(l, "", "") })
	}
	t.Cleanup(func() {
		for _, s := range ts.replicas {
			s.Close()
		}
		wg.Wait()
	})
	return ts
}

// termination issues a new serving certificate for host (a rotation when called again).
func (ts *terminatingShoot) termination(t *testing.T, host string) *model.Termination {
	t.Helper()
	serving, err := ts.shootCA.Leaf(host)
	if err != nil {
		t.Fatal(err)
	}
	fp, err := ts.fpCA.Client("front-proxy", nil, time.Time{}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	tm := &model.Termination{ClientCA: ts.clientCA.PEM(), APIServerCA: ts.shootCA.PEM(), APIServerName: "kube-apiserver"}
	if tm.ServingCert, tm.ServingKey, err = testpki.PEM(serving); err != nil {
		t.Fatal(err)
	}
	if tm.FrontProxyCert, tm.FrontProxyKey, err = testpki.PEM(fp); err != nil {
		t.Fatal(err)
	}
	return tm
}

// client is an HTTP client of the shoot through the ingress, with cert (if any) as its client
// certificate; its connections are counted in dials.
// serve routes the shoot in w and waits until the ingress runs its terminating proxy; it
// returns the proxy's internal listener.
func (ts *terminatingShoot) serve(t *testing.T, w *world) string {
	t.Helper()
	w.mu.Lock()
	w.shoots[ts.shoot.Name] = ts.shoot
	w.mu.Unlock()
	w.apply()
	listener := translate.TerminateListener(ts.shoot.Name)
	testwait.Until(t, "terminating listener served", func() bool { return w.in.terms.get(listener) != nil })
	return listener
}

func (ts *terminatingShoot) client(w *world, cert *tls.Certificate, dials *atomic.Int32) *http.Client {
	cfg := &tls.Config{RootCAs: ts.shootCA.Pool, ServerName: ts.shoot.Hosts[0], NextProtos: []string{"h2"}}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	dialer := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig:   cfg,
		ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			if dials != nil {
				dials.Add(1)
			}
			return dialer.DialContext(ctx, "tcp", w.sni)
		},
	}}
}

func get(t *testing.T, c *http.Client, url string, header http.Header) (int, replicaSeen) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var seen replicaSeen
	if resp.StatusCode == http.StatusOK {
		if err := json.NewDecoder(resp.Body).Decode(&seen); err != nil {
			t.Fatal(err)
		}
	} else {
		_, _ = io.Copy(io.Discard, resp.Body)
	}
	return resp.StatusCode, seen
}

// TestTerminatingShoot: tendril-ingress, programmed by the xDS server from a model with a
// terminating shoot beside a passthrough one, ends the terminating shoot's TLS, authenticates
// certificate clients into X-Remote-* (forged ones stripped), balances one client connection's
// requests over its replicas over HTTP/2 with the front-proxy certificate, carries an upgrade
// over HTTP/1.1, and survives a serving-certificate rotation without touching open
// connections; the passthrough shoot is served as before throughout.
func TestTerminatingShoot(t *testing.T) {
	w := newWorld(t)
	w.addShoot("shoot--t--beta", "api.beta.test")
	ts := newTerminatingShoot(t, "shoot--t--alpha", "api.alpha.test", 3)
	listener := ts.serve(t, w)

	alice, err := ts.clientCA.Client("alice", []string{"team-a", "team-b"}, time.Time{}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	c := ts.client(w, &alice, &dials)
	url := "https://" + ts.shoot.Hosts[0] + "/api"
	forged := http.Header{"X-Remote-User": {"admin"}, "X-Remote-Group": {"system:masters"}, "X-Remote-Extra-Scopes": {"all"}}
	const n = 300
	perReplica := make([]int, len(ts.replicas))
	for range n {
		code, seen := get(t, c, url, forged)
		if code != http.StatusOK {
			t.Fatalf("status %d", code)
		}
		if seen.User != "alice" || strings.Join(seen.Groups, ",") != "team-a,team-b" || seen.Extra != "" {
			t.Fatalf("replica saw user %q groups %q extra %q, want alice, team-a,team-b and no extra", seen.User, seen.Groups, seen.Extra)
		}
		if seen.Proto != "HTTP/2.0" || seen.FrontProxy != "front-proxy" {
			t.Fatalf("replica saw %s from %q, want HTTP/2.0 from the front proxy", seen.Proto, seen.FrontProxy)
		}
		perReplica[seen.Replica]++
	}
	t.Logf("%d requests on one client connection per replica: %v", n, perReplica)
	// Sequential requests on one connection: least outstanding with ties taken in turn gives
	// each replica n/3 exactly; ±10 % is the bound.
	for i, got := range perReplica {
		if got < n/3*9/10 || got > n/3*11/10 {
			t.Errorf("replica %d served %d of %d requests on one client connection: %v", i, got, n, perReplica)
		}
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("the client dialed %d connections, want 1", n)
	}

	// A bearer-token client: no identity set, forged headers gone.
	if code, seen := get(t, ts.client(w, nil, nil), url, http.Header{"Authorization": {"Bearer x"}, "X-Remote-User": {"admin"}}); code != http.StatusOK || seen.User != "" || len(seen.Groups) != 0 {
		t.Errorf("token client: %d, replica saw user %q groups %q", code, seen.User, seen.Groups)
	}
	// Another CA's certificate is 401 and reaches no replica.
	otherCA, err := testpki.NewCA("other shoot")
	if err != nil {
		t.Fatal(err)
	}
	mallory, err := otherCA.Client("alice", []string{"system:masters"}, time.Time{}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := get(t, ts.client(w, &mallory, nil), url, nil); code != http.StatusUnauthorized {
		t.Errorf("a certificate of another CA: %d, want 401", code)
	}

	// The refusal and the stripped requests are exported.
	if got := gathered(t, w, "tendril_ingress_terminate_refused_requests_total", "reason", "bad_certificate"); got != 1 {
		t.Errorf("bad_certificate refusals exported: %v, want 1", got)
	}
	if got := gathered(t, w, "tendril_ingress_terminate_stripped_requests_total", "", ""); got != n+1 {
		t.Errorf("stripped requests exported: %v, want %d", got, n+1)
	}

	// An upgrade goes over HTTP/1.1 and streams both ways.
	up := upgrade(t, w, ts, &alice)
	if !strings.HasPrefix(up, "replica ") || !strings.HasSuffix(up, ": ping\n") {
		t.Errorf("upgraded stream answered %q", up)
	}

	// The passthrough shoot is untouched.
	if got, err := w.who("api.beta.test"); err != nil || got != "shoot--t--beta" {
		t.Errorf("passthrough shoot: %q, %v", got, err)
	}

	// Rotation: a new serving certificate; the open connection goes on, a new one gets it.
	before := servingSerial(t, ts, w)
	rotated := ts.shoot
	rotated.Termination = ts.termination(t, ts.shoot.Hosts[0])
	rotated.Termination.FrontProxyCert, rotated.Termination.FrontProxyKey = ts.shoot.Termination.FrontProxyCert, ts.shoot.Termination.FrontProxyKey
	w.mu.Lock()
	w.shoots[ts.shoot.Name] = rotated
	w.mu.Unlock()
	w.apply()
	testwait.Until(t, "rotated certificate served", func() bool { return servingSerial(t, ts, w) != before })
	if code, _ := get(t, c, url, nil); code != http.StatusOK {
		t.Errorf("after the rotation, the open connection: %d", code)
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("the rotation made the client dial again (%d connections)", n)
	}
	// Quiet, the client's connection is parked; its next request wakes it, on the same
	// connection. (The token client's and mallory's connections stay open too.)
	testwait.Until(t, "the quiet connections parked", func() bool {
		return gathered(t, w, "tendril_ingress_terminate_parked_connections", "", "") == 3
	})
	if code, seen := get(t, c, url, nil); code != http.StatusOK || seen.User != "alice" {
		t.Errorf("a parked connection's request: %d, user %q", code, seen.User)
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("the parked connection was not used (%d connections)", n)
	}

	// Back to passthrough: the terminating listener goes.
	w.mu.Lock()
	w.shoots[ts.shoot.Name] = model.Shoot{Name: ts.shoot.Name, Hosts: ts.shoot.Hosts, APIServers: ts.shoot.APIServers}
	w.mu.Unlock()
	w.apply()
	testwait.Until(t, "terminating listener removed", func() bool { return w.in.terms.get(listener) == nil })
}

// servingSerial is the serial number of the certificate a new connection to the shoot gets.
func servingSerial(t *testing.T, ts *terminatingShoot, w *world) string {
	t.Helper()
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", w.sni, &tls.Config{RootCAs: ts.shootCA.Pool, ServerName: ts.shoot.Hosts[0]})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}

// upgrade sends a SPDY/3.1 upgrade over HTTP/1.1 and a line on the upgraded stream, and returns
// the line it gets back.
func upgrade(t *testing.T, w *world, ts *terminatingShoot, cert *tls.Certificate) string {
	t.Helper()
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", w.sni, &tls.Config{RootCAs: ts.shootCA.Pool,
		ServerName: ts.shoot.Hosts[0], Certificates: []tls.Certificate{*cert}, NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "POST /api/v1/namespaces/default/pods/p/exec HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n", ts.shoot.Hosts[0])
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %s", resp.Status)
	}
	fmt.Fprint(c, "ping\n")
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return line
}

// TestApplyRejectsTerminating: the terminating resources as translate makes them apply; each
// change the ingress does not implement is refused (NACK) with the reason, and the configuration
// stays as it was.
func TestApplyRejectsTerminating(t *testing.T) {
	ts := newTerminatingShoot(t, "shoot--t--alpha", "api.alpha.test", 1)
	r := translate.Shoot(ts.shoot)
	listener := r.Listeners[0]
	var h2 *clusterv3.Cluster
	for _, c := range r.Clusters {
		if c.GetName() == translate.TerminateCluster(ts.shoot.Name) {
			h2 = c
		}
	}
	good := New(Config{Listeners: map[string]string{"sni": "127.0.0.1:0"}})
	t.Cleanup(good.terms.close) // Serve would, at its end
	for _, u := range []xdsclient.Update{
		update(t, resourcev3.SecretType, secretsOf(r)...),
		update(t, resourcev3.ClusterType, clustersOf(r)...),
		update(t, resourcev3.ListenerType, listener),
	} {
		if err := good.Apply(u); err != nil {
			t.Fatalf("the translated resources: %v", err)
		}
	}
	if tc := good.current.Load().terminates[listener.GetName()]; tc == nil || tc.maxHeaderBytes != translate.TerminateMaxRequestHeadersKB<<10 {
		t.Fatalf("terminating listener parsed as %+v", tc)
	}
	hcmOf := func(l *listenerv3.Listener) *hcmv3.HttpConnectionManager {
		h := &hcmv3.HttpConnectionManager{}
		if err := l.GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	withHCM := func(change func(*hcmv3.HttpConnectionManager)) *listenerv3.Listener {
		l := proto.Clone(listener).(*listenerv3.Listener)
		h := hcmOf(l)
		change(h)
		l.FilterChains[0].Filters[0].ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: mustAnyT(t, h)}
		return l
	}
	withTLS := func(change func(*tlsv3.DownstreamTlsContext)) *listenerv3.Listener {
		l := proto.Clone(listener).(*listenerv3.Listener)
		d := &tlsv3.DownstreamTlsContext{}
		if err := l.GetFilterChains()[0].GetTransportSocket().GetTypedConfig().UnmarshalTo(d); err != nil {
			t.Fatal(err)
		}
		change(d)
		l.FilterChains[0].TransportSocket.ConfigType = &corev3.TransportSocket_TypedConfig{TypedConfig: mustAnyT(t, d)}
		return l
	}
	withCluster := func(change func(*clusterv3.Cluster)) *clusterv3.Cluster {
		c := proto.Clone(h2).(*clusterv3.Cluster)
		change(c)
		return c
	}
	cases := map[string]rejection{
		"other Lua code": {update(t, resourcev3.ListenerType, withHCM(func(h *hcmv3.HttpConnectionManager) {
			h.HttpFilters[0].ConfigType = &hcmv3.HttpFilter_TypedConfig{TypedConfig: mustAnyT(t, &luav3.Lua{
				DefaultSourceCode: &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: "function envoy_on_request(h) end"}},
			})}
		})), "wire.AuthProxyLua"},
		"no Lua filter": {update(t, resourcev3.ListenerType, withHCM(func(h *hcmv3.HttpConnectionManager) {
			h.HttpFilters = h.HttpFilters[1:]
		})), "authenticating proxy"},
		"route timeout": {update(t, resourcev3.ListenerType, withHCM(func(h *hcmv3.HttpConnectionManager) {
			h.GetRouteConfig().VirtualHosts[0].Routes[1].GetRoute().Timeout = durationpb.New(time.Minute)
		})), "no route timeout"},
		"no SPDY": {update(t, resourcev3.ListenerType, withHCM(func(h *hcmv3.HttpConnectionManager) {
			h.UpgradeConfigs = h.UpgradeConfigs[:1]
		})), "SPDY/3.1"},
		"client certificate required": {update(t, resourcev3.ListenerType, withTLS(func(d *tlsv3.DownstreamTlsContext) {
			d.RequireClientCertificate = wrapperspb.Bool(true)
		})), "require_client_certificate"},
		"handshake verifies": {update(t, resourcev3.ListenerType, withTLS(func(d *tlsv3.DownstreamTlsContext) {
			d.GetCommonTlsContext().GetCombinedValidationContext().DefaultValidationContext.TrustChainVerification = tlsv3.CertificateValidationContext_VERIFY_TRUST_CHAIN
		})), "untrusted"},
		"inline certificate": {update(t, resourcev3.ListenerType, withTLS(func(d *tlsv3.DownstreamTlsContext) {
			d.CommonTlsContext.TlsCertificates = []*tlsv3.TlsCertificate{{}}
		})), "tls_certificates"},
		"round robin with TLS": {update(t, resourcev3.ClusterType, withCluster(func(c *clusterv3.Cluster) {
			c.LbPolicy = clusterv3.Cluster_ROUND_ROBIN
		})), "LEAST_REQUEST"},
		"sni differs": {update(t, resourcev3.ClusterType, withCluster(func(c *clusterv3.Cluster) {
			u := &tlsv3.UpstreamTlsContext{}
			if err := c.GetTransportSocket().GetTypedConfig().UnmarshalTo(u); err != nil {
				t.Fatal(err)
			}
			u.Sni = "elsewhere"
			c.TransportSocket.ConfigType = &corev3.TransportSocket_TypedConfig{TypedConfig: mustAnyT(t, u)}
		})), "sni"},
		"garbage certificate": {update(t, resourcev3.SecretType, &tlsv3.Secret{Name: "x", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			CertificateChain: &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: []byte("garbage")}},
			PrivateKey:       &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: []byte("garbage")}},
		}}}), "secret x"},
		"certificate from a file": {update(t, resourcev3.SecretType, &tlsv3.Secret{Name: "x", Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: &corev3.DataSource{Specifier: &corev3.DataSource_Filename{Filename: "/etc/ca.pem"}},
		}}}), "inline_bytes"},
	}
	applyRejects(t, cases)
}

func secretsOf(r translate.Resources) []proto.Message {
	var ms []proto.Message
	for _, s := range r.Secrets {
		ms = append(ms, s)
	}
	return ms
}

func clustersOf(r translate.Resources) []proto.Message {
	var ms []proto.Message
	for _, c := range r.Clusters {
		ms = append(ms, c)
	}
	return ms
}

// gathered is the value of the world's metric name for the terminating listener (and, with
// label set, that label's value).
func gathered(t *testing.T, w *world, name, label, value string) float64 {
	t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := label == ""
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					match = true
				}
			}
			if match && m.Counter != nil {
				return m.GetCounter().GetValue()
			}
			if match {
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

// TestDrainClosesIdleTerminatedConnections: a drain tells a terminating shoot's HTTP clients to
// go away, so the ingress's Serve returns once their requests are done, long before its
// DrainTimeout, and closes none (an idle keep-alive connection would otherwise hold it there).
func TestDrainClosesIdleTerminatedConnections(t *testing.T) {
	w := newWorldConfig(t, translate.Options{}, Config{DrainTimeout: time.Hour})
	ts := newTerminatingShoot(t, "shoot--t--alpha", "api.alpha.test", 1)
	ts.serve(t, w)
	c := ts.client(w, nil, nil)
	if code, _ := get(t, c, "https://"+ts.shoot.Hosts[0]+"/api", nil); code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	if w.in.Open() != 1 {
		t.Fatalf("%d connections open, want the client's idle one", w.in.Open())
	}
	// Quiet, it is parked (no goroutine reads it) when the drain begins.
	testwait.Until(t, "the idle connection parked", func() bool {
		return gathered(t, w, "tendril_ingress_terminate_parked_connections", "", "") == 1
	})
	w.stop()
	select {
	case <-w.served:
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return: the idle terminated connection holds the drain")
	}
	if got := w.drainClosed("sni"); got != 0 {
		t.Errorf("connections closed by the drain on sni: %v, want 0", got)
	}
}

// TestTerminatingCircuitBreaker: a terminating shoot's connection holds a slot of its cluster's
// circuit breaker until it closes, as a proxied one does; with the breaker full the next
// connection is refused (circuit_open) before its proxy sees it.
func TestTerminatingCircuitBreaker(t *testing.T) {
	w := newWorldConfig(t, translate.Options{}, Config{})
	ts := newTerminatingShoot(t, "shoot--t--alpha", "api.alpha.test", 1)
	ts.serve(t, w)
	cluster, url := translate.SNICluster(ts.shoot.Hosts[0]), "https://"+ts.shoot.Hosts[0]+"/api"
	// Everything but the connections under test: the breaker's slots taken as connections would.
	var held []func()
	defer func() {
		for _, release := range held {
			release()
		}
	}()
	for {
		release, ok := w.in.acquire(cluster, translate.MaxConnectionsPerCluster)
		if !ok {
			break
		}
		held = append(held, release)
	}
	c := ts.client(w, nil, nil)
	if resp, err := c.Get(url); err == nil {
		resp.Body.Close()
		t.Fatalf("with the breaker full: %s, want the connection refused", resp.Status)
	}
	if n := w.connections(outcomeCircuitOpen); n != 1 {
		t.Errorf("%v connections refused circuit_open, want 1", n)
	}
	held[0]()
	held = held[1:]
	if code, _ := get(t, c, url, nil); code != http.StatusOK {
		t.Fatalf("with one slot free: status %d", code)
	}
	if release, ok := w.in.acquire(cluster, translate.MaxConnectionsPerCluster); ok {
		release()
		t.Error("the open terminated connection holds no slot")
	}
	c.CloseIdleConnections()
	testwait.Until(t, "the closed connection's slot freed", func() bool {
		release, ok := w.in.acquire(cluster, translate.MaxConnectionsPerCluster)
		if ok {
			held = append(held, release)
		}
		return ok
	})
}
