package peers

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var testRoutes = []Route{
	{Name: "shoot--bench--s0", Host: "api.s0.bench.tendril.local", Upstream: "127.0.0.1:41234"},
	{Name: "shoot--bench--s1", Host: "api.s1.bench.tendril.local", Upstream: "127.0.0.1:41235"},
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
}

func TestRouteFile(t *testing.T) {
	got, err := RouteFile(testRoutes[:1])
	if err != nil {
		t.Fatal(err)
	}
	want := "shoots:\n- name: shoot--bench--s0\n  hosts: [\"api.s0.bench.tendril.local\"]\n  apiserver: \"127.0.0.1:41234\"\n"
	if got != want {
		t.Errorf("route file:\n%s\nwant:\n%s", got, want)
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
}

// TestPeerConfigsValid checks the rendered configurations with the peers'
// own checkers, for the peers installed here.
func TestPeerConfigsValid(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t.Run("haproxy", func(t *testing.T) {
		h := HAProxy{}
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
	t.Run("nginx", func(t *testing.T) {
		n := Nginx{}
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

func TestFreePortsDistinct(t *testing.T) {
	ports, err := FreePorts(4)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p == 0 || seen[p] {
			t.Fatalf("ports %v not distinct and nonzero", ports)
		}
		seen[p] = true
	}
}

func TestTendrilMissing(t *testing.T) {
	err := Tendril{BinDir: filepath.Join(t.TempDir(), "bin")}.Check(context.Background())
	if err == nil || !strings.Contains(err.Error(), "tendril-ingress not found") {
		t.Errorf("Check = %v, want tendril-ingress not found", err)
	}
}
