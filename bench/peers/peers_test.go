package peers

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var testRoutes = []Route{
	{Name: "shoot--bench--s0", Host: "api.s0.bench.tendril.local", Upstream: "127.0.0.1:41234", Advertised: netip.MustParseAddr("240.0.0.1")},
	{Name: "shoot--bench--s1", Host: "api.s1.bench.tendril.local", Upstream: "127.0.0.1:41235", Advertised: netip.MustParseAddr("240.0.0.2")},
}

// configLacks reports the first of wants that cfg does not contain.
func configLacks(t *testing.T, name, cfg string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(cfg, want) {
			t.Errorf("%s lacks %q:\n%s", name, want, cfg)
		}
	}
}

func TestRenderHAProxy(t *testing.T) {
	cfg, err := RenderHAProxy(HAProxyConfig{Listen: "127.0.0.1:8443", Threads: 2, MaxConn: 100, Timeouts: DefaultTimeouts, Routes: testRoutes})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"nbthread 2",
		"mode tcp",
		"bind 127.0.0.1:8443",
		"tcp-request inspect-delay 10000ms",
		"tcp-request content accept if { req_ssl_hello_type 1 }",
		"use_backend shoot--bench--s1 if { req_ssl_sni -i api.s1.bench.tendril.local }",
		"backend shoot--bench--s0\n    server shoot--bench--s0 127.0.0.1:41234\n",
		"timeout connect 5000ms",
		"timeout client 60000ms",
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("haproxy.cfg lacks %q:\n%s", want, cfg)
		}
	}
	if strings.Contains(cfg, "\n    log ") || strings.Contains(cfg, "\nlog") {
		t.Errorf("haproxy.cfg logs:\n%s", cfg)
	}
	if strings.Contains(cfg, "accept-proxy") || strings.Contains(cfg, "mode http") {
		t.Errorf("SNI haproxy.cfg has another job's lines:\n%s", cfg)
	}
}

func TestRenderHAProxyProxy(t *testing.T) {
	cfg, err := RenderHAProxy(HAProxyConfig{Job: JobProxy, Listen: "127.0.0.1:8443", Threads: 2, MaxConn: 100, Timeouts: DefaultTimeouts, Routes: testRoutes})
	if err != nil {
		t.Fatal(err)
	}
	configLacks(t, "haproxy.cfg", cfg,
		"mode tcp",
		"bind 127.0.0.1:8443 accept-proxy\n",
		"use_backend shoot--bench--s0 if { dst 240.0.0.1 } { dst_port 443 }\n",
		"use_backend shoot--bench--s1 if { dst 240.0.0.2 } { dst_port 443 }\n",
		"backend shoot--bench--s1\n    server shoot--bench--s1 127.0.0.1:41235\n")
	if strings.Contains(cfg, "req_ssl_sni") {
		t.Errorf("PROXY haproxy.cfg waits for the ClientHello:\n%s", cfg)
	}
	noAdvertised := []Route{testRoutes[0], {Name: "x", Host: "x.local", Upstream: "127.0.0.1:1"}}
	if _, err := RenderHAProxy(HAProxyConfig{Job: JobProxy, Routes: noAdvertised}); err == nil {
		t.Error("PROXY routing without an advertised address accepted")
	}
}

func TestRenderHAProxyConnect(t *testing.T) {
	cfg, err := RenderHAProxy(HAProxyConfig{Job: JobConnect, Listen: "127.0.0.1:8443", Threads: 2, MaxConn: 100, Timeouts: DefaultTimeouts, Routes: testRoutes})
	if err != nil {
		t.Fatal(err)
	}
	configLacks(t, "haproxy.cfg", cfg,
		"mode http",
		"timeout tunnel 60000ms",
		"http-request deny deny_status 405 unless METH_CONNECT\n",
		"http-request deny deny_status 400 unless { req.hdr_cnt(X-Gardener-Destination) eq 1 }",
		"use_backend shoot--bench--s1 if { req.hdr(X-Gardener-Destination) -m str outbound|443||kube-apiserver.shoot--bench--s1.svc.cluster.local }\n")
	if _, err := RenderHAProxy(HAProxyConfig{Job: "tunnel", Routes: testRoutes}); err == nil {
		t.Error("unknown job accepted")
	}
}

func TestRenderNginx(t *testing.T) {
	c := NginxConfig{Listen: "127.0.0.1:8443", Workers: 2, MaxConn: 100, Dir: "/tmp/x",
		StreamModule: "/usr/lib/nginx/modules/ngx_stream_module.so", Timeouts: DefaultTimeouts, Routes: testRoutes}
	cfg, err := RenderNginx(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"load_module /usr/lib/nginx/modules/ngx_stream_module.so;",
		"worker_processes 2;",
		"pid /tmp/x/nginx.pid;",
		"map $ssl_preread_server_name $backend {",
		"api.s1.bench.tendril.local shoot--bench--s1;",
		"upstream shoot--bench--s0 {\n        server 127.0.0.1:41234;",
		"listen 127.0.0.1:8443;",
		"ssl_preread on;",
		"proxy_pass $backend;",
		"preread_timeout 10000ms;",
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("nginx.conf lacks %q:\n%s", want, cfg)
		}
	}
	c.StreamModule = ""
	if cfg, _ := RenderNginx(c); strings.Contains(cfg, "load_module") {
		t.Errorf("built-in stream module still loaded:\n%s", cfg)
	}

	c.Job = JobProxy
	cfg, err = RenderNginx(c)
	if err != nil {
		t.Fatal(err)
	}
	configLacks(t, "nginx.conf", cfg,
		"map $proxy_protocol_server_addr:$proxy_protocol_server_port $backend {",
		"240.0.0.2:443 shoot--bench--s1;",
		"listen 127.0.0.1:8443 proxy_protocol;",
		"proxy_protocol_timeout 10000ms;")
	if strings.Contains(cfg, "ssl_preread") {
		t.Errorf("PROXY nginx.conf reads the ClientHello:\n%s", cfg)
	}
	c.Job = JobConnect
	if _, err := RenderNginx(c); err == nil {
		t.Error("nginx configuration for CONNECT rendered")
	}
	if err := (Nginx{Job: JobConnect}).Check(context.Background()); err == nil || !strings.Contains(err.Error(), "CONNECT") {
		t.Errorf("Nginx{JobConnect}.Check = %v, want a refusal", err)
	}
}

func TestRenderSquid(t *testing.T) {
	cfg, err := RenderSquid(SquidConfig{Listen: "127.0.0.1:8443", Workers: 2, Dir: "/tmp/x", MaxConn: 100, Timeouts: DefaultTimeouts, Routes: testRoutes})
	if err != nil {
		t.Fatal(err)
	}
	configLacks(t, "squid.conf", cfg,
		"http_port 127.0.0.1:8443\n",
		"workers 2\n",
		"pid_filename /tmp/x/squid.pid\n",
		`acl shoot--bench--s1 req_header X-Gardener-Destination ^outbound\|443\|\|kube-apiserver\.shoot--bench--s1\.svc\.cluster\.local$`+"\n",
		"http_access deny !CONNECT\n",
		"http_access allow shoot--bench--s1\n",
		"cache_peer 127.0.0.1 parent 41235 0 no-query no-digest originserver default name=shoot--bench--s1\n",
		"cache_peer_access shoot--bench--s1 allow shoot--bench--s1\ncache_peer_access shoot--bench--s1 deny all\n",
		"never_direct allow all\n",
		"peer_connect_timeout 5 seconds\n",
		"request_timeout 10 seconds\n",
		"access_log none\n")
	if _, err := RenderSquid(SquidConfig{Dir: "rel", Routes: testRoutes}); err == nil {
		t.Error("relative squid dir accepted")
	}
}

func TestRouteFile(t *testing.T) {
	got, err := RouteFile(testRoutes[:1])
	if err != nil {
		t.Fatal(err)
	}
	want := "shoots:\n- name: shoot--bench--s0\n  hosts: [\"api.s0.bench.tendril.local\"]\n  apiserver: \"127.0.0.1:41234\"\n  advertisedAddress: \"240.0.0.1\"\n"
	if got != want {
		t.Errorf("route file:\n%s\nwant:\n%s", got, want)
	}
	r := testRoutes[0]
	r.Advertised = netip.Addr{}
	got, err = RouteFile([]Route{r})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(got, "advertisedAddress") {
		t.Errorf("route file for a shoot without an advertised address:\n%s", got)
	}
}

func TestRejectBadRoutes(t *testing.T) {
	for _, r := range []Route{
		{Name: "a b", Host: "x.local", Upstream: "127.0.0.1:1"},
		{Name: "a", Host: "x.local;\n", Upstream: "127.0.0.1:1"},
		{Name: "a", Host: "X.local", Upstream: "127.0.0.1:1"},
		{Name: "a", Host: "x.local", Upstream: "localhost:1"},
	} {
		if _, err := RenderHAProxy(HAProxyConfig{Routes: []Route{r}}); err == nil {
			t.Errorf("route %+v accepted", r)
		}
	}
	if _, err := RouteFile(append(testRoutes, testRoutes[0])); err == nil {
		t.Error("duplicate route accepted")
	}
	shared := testRoutes[1]
	shared.Name, shared.Host, shared.Advertised = "other", "other.local", testRoutes[0].Advertised
	if _, err := RouteFile([]Route{testRoutes[0], shared}); err == nil || !strings.Contains(err.Error(), "advertised") {
		t.Errorf("shared advertised address: %v, want an error", err)
	}
	zoned := testRoutes[0]
	zoned.Advertised = netip.MustParseAddr("fe80::1%eth0")
	if _, err := RouteFile([]Route{zoned}); err == nil {
		t.Error("advertised address with a zone accepted")
	}
}

// TestPeerConfigsValid checks the rendered configurations with the peers'
// own checkers, for the peers installed here.
func TestPeerConfigsValid(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, job := range []Job{JobSNI, JobProxy, JobConnect} {
		t.Run("haproxy/"+string(job), func(t *testing.T) {
			h := HAProxy{Job: job}
			if err := h.Check(ctx); err != nil {
				t.Skip(err)
			}
			cfg, err := h.Config("127.0.0.1:8443", testRoutes)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "haproxy.cfg")
			if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := h.CheckConfig(ctx, path); err != nil {
				t.Error(err)
			}
		})
	}
	t.Run("squid", func(t *testing.T) {
		s := Squid{}
		if err := s.Check(ctx); err != nil {
			t.Skip(err)
		}
		dir := t.TempDir()
		cfg, err := s.Config(dir, "127.0.0.1:8443", testRoutes)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "squid.conf")
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := s.CheckConfig(ctx, path); err != nil {
			t.Error(err)
		}
	})
	for _, job := range []Job{JobSNI, JobProxy} {
		t.Run("nginx/"+string(job), func(t *testing.T) {
			n := Nginx{Job: job}
			if err := n.Check(ctx); err != nil {
				t.Skip(err)
			}
			dir := t.TempDir()
			cfg, err := n.Config(ctx, dir, "127.0.0.1:8443", testRoutes)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, "nginx.conf")
			if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := n.CheckConfig(ctx, dir, path); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestTendrilMissing(t *testing.T) {
	err := Tendril{BinDir: filepath.Join(t.TempDir(), "bin")}.Check(context.Background())
	if err == nil || !strings.Contains(err.Error(), "tendril-ingress not found") {
		t.Errorf("Check = %v, want tendril-ingress not found", err)
	}
}

func TestReadMemory(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("no /proc")
	}
	m, ok := ReadMemory(os.Getpid())
	if !ok || m.RSS <= 0 || m.Peak < m.RSS {
		t.Errorf("ReadMemory(self) = %+v, %v", m, ok)
	}
	if _, ok := ReadMemory(-1); ok {
		t.Error("ReadMemory(-1) succeeded")
	}
}

// TestMaxConn: the idle benchmark's connection limit reaches the rendered
// configurations; without one they keep the default.
func TestMaxConn(t *testing.T) {
	for conns, want := range map[int]string{0: "maxconn 8192\n", 9950: "maxconn 9950\n"} {
		cfg, err := HAProxy{MaxConn: conns}.Config("127.0.0.1:8443", testRoutes)
		if err != nil {
			t.Fatal(err)
		}
		configLacks(t, "haproxy.cfg", cfg, want)
	}
	n := Nginx{MaxConn: 19900}
	if err := n.Check(context.Background()); err != nil {
		t.Skip("nginx:", err)
	}
	cfg, err := n.Config(context.Background(), t.TempDir(), "127.0.0.1:8443", testRoutes)
	if err != nil {
		t.Fatal(err)
	}
	configLacks(t, "nginx.conf", cfg, "worker_connections 19900;", "worker_rlimit_nofile 19900;")
}
