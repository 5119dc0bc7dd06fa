// Command tendril-local runs a local seed on loopback for `make run`: tendril-seed with a route
// file, tendril-ingress subscribed to it, and an example HTTPS upstream per shoot standing in for
// its kube-apiserver. It checks every shoot through the ingress, prints the commands that reach
// them, and keeps running until interrupted, stopping everything it started.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/internal/testpki"
)

// Config is tendril-local's configuration.
type Config struct {
	BinDir         string
	Dir            string
	SNIAddress     string
	XDSAddress     string
	SeedMetrics    string
	IngressMetrics string
	Shoots         []string
}

func main() {
	var cfg Config
	var shoots string
	flag.StringVar(&cfg.BinDir, "bin-dir", "bin", "directory holding tendril-seed and tendril-ingress")
	flag.StringVar(&cfg.Dir, "dir", "", "working directory for certificates, routes and logs (default: a new temporary directory)")
	flag.StringVar(&cfg.SNIAddress, "sni-address", "127.0.0.1:9443", "ingress SNI listener")
	flag.StringVar(&cfg.XDSAddress, "xds-address", "127.0.0.1:18000", "xDS server address")
	flag.StringVar(&cfg.SeedMetrics, "seed-metrics-address", "127.0.0.1:18080", "tendril-seed metrics and probes")
	flag.StringVar(&cfg.IngressMetrics, "ingress-metrics-address", "127.0.0.1:18081", "tendril-ingress metrics and probes")
	flag.StringVar(&shoots, "shoots", "alpha,beta", "example shoot names (project local)")
	flag.Parse()
	cfg.Shoots = strings.Split(shoots, ",")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "tendril-local:", err)
		os.Exit(1)
	}
}

type shoot struct {
	name, host string
	addr       string
}

// Run starts the local seed and keeps it up until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "tendril-local-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	ca, err := testpki.NewCA("tendril local CA")
	if err != nil {
		return err
	}
	caFile := filepath.Join(dir, "ca.pem")
	if err := ca.WriteCA(caFile); err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	var shoots []shoot
	var routes strings.Builder
	routes.WriteString("shoots:\n")
	for _, n := range cfg.Shoots {
		s := shoot{name: "shoot--local--" + n, host: "api." + n + ".local.tendril.dev"}
		addr, err := serveUpstream(ctx, &wg, ca, s)
		if err != nil {
			return err
		}
		s.addr = addr
		shoots = append(shoots, s)
		fmt.Fprintf(&routes, "- name: %s\n  hosts: [%s]\n  apiserver: %s\n", s.name, s.host, s.addr)
	}
	routeFile := filepath.Join(dir, "routes.yaml")
	if err := os.WriteFile(routeFile, []byte(routes.String()), 0o644); err != nil {
		return err
	}

	procs := []struct {
		name string
		args []string
	}{
		{"tendril-seed", []string{"--routes", routeFile, "--xds-address", cfg.XDSAddress, "--metrics-address", cfg.SeedMetrics}},
		{"tendril-ingress", []string{"--xds", cfg.XDSAddress, "--node-id", "local", "--sni-address", cfg.SNIAddress, "--metrics-address", cfg.IngressMetrics}},
	}
	exited := make(chan error, len(procs))
	for _, p := range procs {
		logFile := filepath.Join(dir, p.name+".log")
		lf, err := os.Create(logFile)
		if err != nil {
			return err
		}
		defer lf.Close()
		cmd := exec.CommandContext(ctx, filepath.Join(cfg.BinDir, p.name), p.args...)
		cmd.Stdout, cmd.Stderr = lf, lf
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 5 * time.Second
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start %s (run make build first): %w", p.name, err)
		}
		fmt.Printf("started %-16s pid %d, log %s\n", p.name, cmd.Process.Pid, logFile)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := cmd.Wait()
			if ctx.Err() == nil {
				exited <- fmt.Errorf("%s exited: %v (see %s)", p.name, err, logFile)
			}
		}()
	}

	start := time.Now()
	if err := waitReady(ctx, "http://"+cfg.IngressMetrics+"/readyz", exited); err != nil {
		return err
	}
	fmt.Printf("\ningress ready after %v; checking each shoot through %s:\n", time.Since(start).Round(time.Millisecond), cfg.SNIAddress)
	failed := false
	for _, s := range shoots {
		got, err := check(ctx, ca, cfg.SNIAddress, s.host)
		status := "ok"
		if err != nil {
			status, failed = "FAILED: "+err.Error(), true
		} else if got != s.name {
			status, failed = fmt.Sprintf("FAILED: reached %q", got), true
		}
		fmt.Printf("  %-24s %-32s %s\n", s.name, s.host, status)
	}
	if failed {
		return errors.New("a shoot is not reachable through the ingress")
	}
	_, port, _ := net.SplitHostPort(cfg.SNIAddress)
	fmt.Printf("\nReach a shoot through the ingress (TLS is passed through, the upstream's certificate is verified):\n")
	for _, s := range shoots {
		fmt.Printf("  curl --cacert %s --resolve %s:%s:127.0.0.1 https://%s:%s/version\n", caFile, s.host, port, s.host, port)
	}
	fmt.Printf("  openssl s_client -connect %s -servername %s -CAfile %s -verify_return_error\n", cfg.SNIAddress, shoots[0].host, caFile)
	fmt.Printf("Routes: %s (edit it: tendril-seed reloads it). Metrics: http://%s/metrics, http://%s/metrics\n", routeFile, cfg.SeedMetrics, cfg.IngressMetrics)
	fmt.Printf("Running until interrupted (Ctrl-C).\n")
	select {
	case <-ctx.Done():
		fmt.Println("\nstopping")
		return nil
	case err := <-exited:
		return err
	}
}

// serveUpstream serves HTTPS for s with a certificate for its host name: /version answers the
// shoot's name, as a stand-in for its kube-apiserver.
func serveUpstream(ctx context.Context, wg *sync.WaitGroup, ca *testpki.CA, s shoot) (string, error) {
	cert, err := ca.Leaf(s.host)
	if err != nil {
		return "", err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{cert}},
		ReadHeaderTimeout: 10 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]string{"shoot": s.name, "host": s.host})
		}),
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		_ = srv.ServeTLS(l, "", "")
	}()
	go func() {
		defer wg.Done()
		<-ctx.Done()
		_ = srv.Close()
	}()
	return l.Addr().String(), nil
}

func waitReady(ctx context.Context, url string, exited <-chan error) error {
	deadline := time.After(30 * time.Second)
	for {
		if r, err := http.Get(url); err == nil {
			io.Copy(io.Discard, r.Body)
			r.Body.Close()
			if r.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-exited:
			return err
		case <-deadline:
			return fmt.Errorf("%s not ready after 30 s", url)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// check requests /version of host through the ingress, verifying the certificate.
func check(ctx context.Context, ca *testpki.CA, ingress, host string) (string, error) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: ca.Pool},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, ingress)
		},
	}}
	var last error
	// The listener can be ready a moment before the routes arrive: retry briefly.
	for range 20 {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+host+"/version", nil)
		r, err := c.Do(req)
		if err == nil {
			var v map[string]string
			err = json.NewDecoder(r.Body).Decode(&v)
			r.Body.Close()
			if err == nil {
				return v["shoot"], nil
			}
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	return "", last
}
