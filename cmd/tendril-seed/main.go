// Command tendril-seed is tendril's seed-side control plane: it serves the shoots' routes to the
// shared ingress over xDS. Without Kubernetes it reads them from a route file (--routes).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/internal/logging"
	"github.com/tendril-net/tendril/internal/probe"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/source"
	"github.com/tendril-net/tendril/xds/translate"
)

// Config is tendril-seed's configuration.
type Config struct {
	// Routes is the route file to serve.
	Routes string
	// XDSAddress is where the ADS server listens.
	XDSAddress string
	// MetricsAddress is where /metrics, /healthz and /readyz are served; empty disables them.
	MetricsAddress string
	// Profiling serves the Go profiler on the metrics address.
	Profiling bool
	// LBProxyProtocol: the seed's load balancer prepends a PROXY header to every connection.
	LBProxyProtocol bool
	Log             logr.Logger
}

func main() {
	var cfg Config
	var verbosity int
	flag.StringVar(&cfg.Routes, "routes", "", "route file (YAML: shoots: [{name, hosts, apiserver, advertisedAddress, vpnServer}]); re-read when it changes")
	flag.StringVar(&cfg.XDSAddress, "xds-address", "127.0.0.1:18000", "address the xDS (ADS) gRPC server listens on")
	flag.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:18080", "address for /metrics, /healthz and /readyz (empty: off)")
	flag.BoolVar(&cfg.LBProxyProtocol, "lb-proxy-protocol", false, "the seed's load balancer prepends its own PROXY header to every connection: every listener reads it first (tendril-ingress needs --trusted-proxy-cidr)")
	flag.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	flag.IntVar(&verbosity, "v", 0, "log verbosity")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "tendril-seed: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-seed")

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
}

// Run serves the routes until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Routes == "" {
		return errors.New("--routes is required (the Kubernetes route source comes with the extension)")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	xs := server.New(server.Config{Log: cfg.Log.WithName("xds"), Registry: reg, Options: translate.Options{LBProxyProtocol: cfg.LBProxyProtocol}})
	var ready probe.Ready

	xl, err := net.Listen("tcp", cfg.XDSAddress)
	if err != nil {
		return fmt.Errorf("xDS listener: %w", err)
	}
	var ml net.Listener
	if cfg.MetricsAddress != "" {
		if ml, err = net.Listen("tcp", cfg.MetricsAddress); err != nil {
			xl.Close()
			return fmt.Errorf("metrics listener: %w", err)
		}
	}
	cfg.Log.Info("Serving xDS", "address", xl.Addr().String())

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return xs.Serve(ctx, xl) })
	if ml != nil {
		g.Go(func() error { return probe.Serve(ctx, ml, probe.Handler(reg, ready.Get, cfg.Profiling)) })
	}
	routes := &source.File{Path: cfg.Routes, Log: cfg.Log.WithName("routes"), Registry: reg}
	g.Go(func() error {
		return routes.Run(ctx, func(shoots []model.Shoot) error {
			st, err := xs.Apply(shoots)
			if err != nil {
				return err
			}
			ready.Set()
			cfg.Log.Info("Routes applied", "shoots", len(shoots), "translated", st.Translated, "updated", st.Updated, "removed", st.Removed)
			return nil
		})
	})
	return g.Wait()
}
