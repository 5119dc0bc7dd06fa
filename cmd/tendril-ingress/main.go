// Command tendril-ingress is tendril's embedded data plane: it takes its configuration from the
// xDS server over delta ADS and serves the listeners it is given addresses for: SNI
// passthrough, PROXY protocol / CONNECT (in-cluster API access), and the reversed VPN's CONNECT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"syscall"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/buildinfo"
	"github.com/tendril-net/tendril/internal/logging"
	"github.com/tendril-net/tendril/internal/probe"
)

// Config is tendril-ingress's configuration.
type Config struct {
	XDSAddress     string
	NodeID         string
	SNIAddress     string
	ProxyAddress   string
	TunnelAddress  string
	MetricsAddress string
	// Profiling serves the Go profiler on the metrics address.
	Profiling      bool
	MaxPending     int
	TrustedProxies []netip.Prefix
	Log            logr.Logger
}

func main() {
	var cfg Config
	var verbosity int
	flag.StringVar(&cfg.XDSAddress, "xds", "127.0.0.1:18000", "xDS server address (host:port)")
	flag.StringVar(&cfg.NodeID, "node-id", "", "xDS node ID of this replica (default: the host name)")
	flag.StringVar(&cfg.SNIAddress, "sni-address", "", "address of the SNI passthrough listener (xDS listener \"sni\"); empty: not served")
	flag.StringVar(&cfg.ProxyAddress, "proxy-address", "", "address of the PROXY-protocol and X-Gardener-Destination CONNECT listener (xDS listener \"proxy\"); empty: not served")
	flag.StringVar(&cfg.TunnelAddress, "tunnel-address", "", "address of the Reversed-VPN CONNECT listener (xDS listener \"tunnel\"); empty: not served")
	flag.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:18081", "address for /metrics, /healthz and /readyz (empty: off)")
	flag.IntVar(&cfg.MaxPending, "max-pending", 10000, "connections allowed to wait for their ClientHello at once")
	flag.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	flag.Func("trusted-proxy-cidr", "CIDR of the load balancers whose own PROXY header is believed (with tendril-seed --lb-proxy-protocol); repeatable", func(v string) error {
		p, err := netip.ParsePrefix(v)
		if err != nil {
			return err
		}
		cfg.TrustedProxies = append(cfg.TrustedProxies, p)
		return nil
	})
	flag.IntVar(&verbosity, "v", 0, "log verbosity")
	version := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *version {
		fmt.Println(buildinfo.String("tendril-ingress"))
		return
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "tendril-ingress: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	if cfg.NodeID == "" {
		cfg.NodeID, _ = os.Hostname()
	}
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-ingress")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
}

// Run serves until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	listeners := map[string]string{}
	for name, addr := range map[string]string{"sni": cfg.SNIAddress, "proxy": cfg.ProxyAddress, "tunnel": cfg.TunnelAddress} {
		if addr != "" {
			listeners[name] = addr
		}
	}
	if len(listeners) == 0 {
		return errors.New("no listener address given (--sni-address, --proxy-address, --tunnel-address)")
	}
	reg := probe.NewRegistry()
	in := ingress.New(ingress.Config{Listeners: listeners, Log: cfg.Log, Registry: reg, MaxPending: cfg.MaxPending, TrustedProxies: cfg.TrustedProxies})

	g, ctx := errgroup.WithContext(ctx)
	if cfg.MetricsAddress != "" {
		ml, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		ready := func() (bool, string) {
			if in.Ready() {
				return true, ""
			}
			return false, "no configuration applied yet"
		}
		g.Go(func() error { return probe.Serve(ctx, ml, probe.Handler(reg, ready, cfg.Profiling)) })
	}
	g.Go(func() error {
		return in.Run(ctx, xdsclient.Config{Address: cfg.XDSAddress, NodeID: cfg.NodeID})
	})
	return g.Wait()
}
