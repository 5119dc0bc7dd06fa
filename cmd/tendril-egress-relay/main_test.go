package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

func TestParse(t *testing.T) {
	cfg, err := parse([]string{"--socket=/s/relay.sock", "--server=tendril-server.ns.svc:8090", "--socket-mode=0660",
		"--tls-cert-file=c", "--tls-key-file=k", "--ca-file=ca", "--max-connections=7"})
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Relay
	if r.Socket != "/s/relay.sock" || !slices.Equal(r.Servers, []string{"tendril-server.ns.svc:8090"}) || r.SocketMode != 0o660 || r.MaxConnections != 7 ||
		r.CertFile != "c" || r.KeyFile != "k" || r.CAFile != "ca" || cfg.MetricsAddress != "127.0.0.1:16913" || cfg.Profiling {
		t.Errorf("config %+v", cfg)
	}
	// An HA shoot's replicas, by their own names.
	const r0, r1 = "tendril-server-0.tendril-server.ns.svc.cluster.local:8090", "tendril-server-1.tendril-server.ns.svc.cluster.local:8090"
	cfg, err = parse([]string{"--socket=/s/relay.sock", "--server=" + r0 + ", " + r1, "--server-name=tendril-server.ns.svc"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.Relay.Servers, []string{r0, r1}) || cfg.Relay.ServerName != "tendril-server.ns.svc" {
		t.Errorf("servers %q, server name %q", cfg.Relay.Servers, cfg.Relay.ServerName)
	}
	if _, err := parse([]string{"--version"}); !errors.Is(err, errVersion) {
		t.Errorf("--version: %v, want errVersion", err)
	}
	for _, args := range [][]string{{"--socket-mode=rw"}, {"--socket-mode=01777"}, {"extra"}, {"--server=" + r0 + ",," + r1}, {"--server=" + r0 + ","}} {
		if _, err := parse(args); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}

// TestRun: the binary's wiring serves /healthz and /readyz beside the relay and stops with ctx.
func TestRun(t *testing.T) {
	dir, err := os.MkdirTemp("", "relaycmd")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ca, err := testpki.NewCA("ca")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Leaf("kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	cert, key, bundle := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "bundle.crt")
	if err := testpki.WriteFiles(leaf, ca, cert, key, bundle); err != nil {
		t.Fatal(err)
	}
	// The metrics socket bound here and handed to Run, as a parent process hands it over.
	sock, err := inherit.Bind("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	metrics := sock.Addr
	cfg, err := parse([]string{"--socket=" + filepath.Join(dir, "relay.sock"), "--server=127.0.0.1:1",
		"--tls-cert-file=" + cert, "--tls-key-file=" + key, "--ca-file=" + bundle, "--metrics-address=" + metrics, "--profiling"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listeners, err = inherit.Of(sock); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + metrics + "/readyz")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
			err = &net.AddrError{Err: strings.TrimSpace(string(body))}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	resp, err := http.Get("http://" + metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "tendril_egress_relay_max_connections 1024") {
		t.Errorf("metrics lack the relay's:\n%.2000s", body)
	}
	if resp, err := http.Get("http://" + metrics + "/debug/pprof/goroutine?debug=1"); err != nil {
		t.Error(err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("--profiling: /debug/pprof/goroutine answered %s", resp.Status)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
