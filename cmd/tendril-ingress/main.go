// Command tendril-ingress is tendril's embedded data plane: it takes its configuration from the
// xDS server over delta ADS and serves the listeners it is given addresses for: SNI
// passthrough, PROXY protocol / CONNECT (in-cluster API access), and the reversed VPN's CONNECT.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/host/idlemem"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/internal/proc/logging"
	"github.com/tendril-net/tendril/internal/proc/probe"
	"github.com/tendril-net/tendril/internal/proc/procscale"
)

// Config is tendril-ingress's configuration.
type Config struct {
	// Listeners are the sockets this process inherited (nil: none): a listener whose address
	// is among them is that socket.
	Listeners  *inherit.Listeners
	XDSAddress string
	NodeID     string
	// XDSCertFile, XDSKeyFile and XDSCAFile are the files of the xDS client's certificate, key and the CA bundle the server is
	// verified against, re-read when they change; XDSServerName is the name the server's
	// certificate must carry (empty: XDSAddress's host). XDSInsecure connects in plaintext
	// instead (local use); one of the two is required.
	XDSCertFile, XDSKeyFile, XDSCAFile string
	XDSServerName                      string
	XDSInsecure                        bool

	SNIAddress     string
	ProxyAddress   string
	TunnelAddress  string
	MetricsAddress string
	// Profiling serves the Go profiler on the metrics address.
	Profiling bool
	// MaxPending, MaxPendingPerListener and MaxPendingPerSource bound the connections in
	// their handshake (ingress.Config); zero means the default.
	MaxPending            int
	MaxPendingPerListener int
	MaxPendingPerSource   int
	TrustedProxies        []netip.Prefix
	// TerminateNetHTTP2: ingress.Config.TerminateNetHTTP2.
	TerminateNetHTTP2 bool
	// DrainDelay and DrainTimeout shape the shutdown (ingress.Config); zero: none.
	DrainDelay   time.Duration
	DrainTimeout time.Duration
	// AdaptiveProcs sizes GOMAXPROCS to the ingress's CPU use (package procscale), up to the
	// runtime's default.
	AdaptiveProcs bool
	Log           logr.Logger
}

func main() {
	var cfg Config
	var verbosity int
	flag.StringVar(&cfg.XDSAddress, "xds", "127.0.0.1:18000", "xDS server address (host:port)")
	flag.StringVar(&cfg.NodeID, "node-id", "", "xDS node ID of this replica (default: the host name); the server admits it only if it is the client certificate's common name or starts with it and a dash")
	flag.StringVar(&cfg.XDSCertFile, "xds-cert-file", "", "xDS over mutual TLS: the client certificate (PEM chain), re-read when it changes")
	flag.StringVar(&cfg.XDSKeyFile, "xds-key-file", "", "xDS over mutual TLS: the client certificate's key")
	flag.StringVar(&cfg.XDSCAFile, "xds-ca-file", "", "xDS over mutual TLS: the CA bundle the server's certificate must chain to")
	flag.StringVar(&cfg.XDSServerName, "xds-server-name", "", "xDS over mutual TLS: the name the server's certificate must carry (default: --xds's host)")
	flag.BoolVar(&cfg.XDSInsecure, "xds-insecure", false, "connect to the xDS server in plaintext, unauthenticated (local use only; otherwise --xds-cert-file, --xds-key-file and --xds-ca-file are required)")
	flag.StringVar(&cfg.SNIAddress, "sni-address", "", "address of the SNI passthrough listener (xDS listener \"sni\"); empty: not served")
	flag.StringVar(&cfg.ProxyAddress, "proxy-address", "", "address of the PROXY-protocol and X-Gardener-Destination CONNECT listener (xDS listener \"proxy\"); empty: not served")
	flag.StringVar(&cfg.TunnelAddress, "tunnel-address", "", "address of the Reversed-VPN CONNECT listener (xDS listener \"tunnel\"); empty: not served")
	flag.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:18081", "address for /metrics, /healthz and /readyz (empty: off)")
	flag.IntVar(&cfg.MaxPending, "max-pending", ingress.DefaultMaxPending, "connections allowed in their handshake (PROXY header, ClientHello, CONNECT request) at once, across all listeners; at the limit the oldest is closed for a new one")
	flag.IntVar(&cfg.MaxPendingPerListener, "max-pending-per-listener", ingress.DefaultMaxPendingPerListener, "connections allowed in their handshake at once on one listener; at the limit the listener's oldest is closed for a new one")
	flag.IntVar(&cfg.MaxPendingPerSource, "max-pending-per-source", ingress.DefaultMaxPendingPerSource, "connections of one source address (IPv6: one /64) allowed in their handshake at once, across all listeners; beyond it the source's new connections are refused (--trusted-proxy-cidr peers are exempt)")
	flag.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	flag.Func("trusted-proxy-cidr", "CIDR of the load balancers whose own PROXY header is believed (with tendril-seed --lb-proxy-protocol); repeatable", func(v string) error {
		p, err := netip.ParsePrefix(v)
		if err != nil {
			return err
		}
		cfg.TrustedProxies = append(cfg.TrustedProxies, p)
		return nil
	})
	// --drain-timeout's default is the chart's. --drain-delay's is 0, so a replica outside
	// Kubernetes (and the tests) stops at once; the chart sets the delay its load balancer needs.
	flag.BoolVar(&cfg.TerminateNetHTTP2, "terminate-net-http2", false, "serve terminating shoots' HTTP/2 clients with net/http's server instead of relaying them frame by frame (the way before h2relay)")
	flag.DurationVar(&cfg.DrainTimeout, "drain-timeout", DefaultDrainTimeout, "on SIGTERM, how long established connections may go on after the listeners close; the rest are then closed (0: at once)")
	flag.DurationVar(&cfg.DrainDelay, "drain-delay", 0, "on SIGTERM, how long to go on accepting new connections while /readyz already fails, for the load balancer to notice (the chart sets 5s); 0: close the listeners at once")
	flag.BoolVar(&cfg.AdaptiveProcs, "adaptive-procs", true, "size GOMAXPROCS to the ingress's CPU use: one processor while it uses less than a third of a core, more at once when it needs them, up to the runtime's default, read again every 10 s to follow a CPU limit changed in place (an idle processor costs the Go scheduler CPU on every event); off when the GOMAXPROCS environment variable is set")
	flag.IntVar(&verbosity, "v", 0, "log verbosity")
	version := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	probe.SampleHeap(cfg.Profiling)
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
	// Sockets a parent bound and handed over (tests, tendril-bench, tendril-local); not for
	// the processes this one starts.
	inherited, err := inherit.Parse(os.Getenv(inherit.EnvVar))
	os.Unsetenv(inherit.EnvVar)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tendril-ingress:", err)
		os.Exit(2)
	}
	cfg.Listeners = inherited
	if v := os.Getenv("GOMAXPROCS"); v != "" && cfg.AdaptiveProcs {
		cfg.Log.Info("GOMAXPROCS is set: keeping it (no --adaptive-procs)", "GOMAXPROCS", v)
		cfg.AdaptiveProcs = false
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal starts the drain; a second one (an impatient ^C) kills at once, as the
	// default action does once the handler is gone.
	context.AfterFunc(ctx, stop)
	if err := Run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
}

// DefaultDrainTimeout is --drain-timeout's default, the chart's ingress.drain.timeoutSeconds: as
// long as the chart's Envoy drains (--drain-time-s 45), time for requests and transfers in flight
// to finish. kubectl watches, exec sessions and VPN tunnels do not end by themselves; they are
// closed at its end and reconnect through another replica, so a longer drain would only slow a
// rollout (one replica at a time) without saving them.
const DefaultDrainTimeout = 45 * time.Second

// descriptorReserve are the descriptors the ingress needs besides its connections: listeners,
// the xDS and metrics connections, the relay loops' epoll sets, stdio and the runtime's own.
const descriptorReserve = 64

// logCapacity logs how many relayed connections the open-file limit allows: each holds two
// sockets (the client's and the upstream's). Go raised the soft limit to the hard one at start;
// the hard one is the container runtime's (process_max_fds in the metrics).
func logCapacity(log logr.Logger) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		log.Error(err, "Reading the open-file limit")
		return
	}
	log.Info("Open-file limit", "limit", lim.Cur, "connections", (int64(lim.Cur)-descriptorReserve)/2)
}

// Run serves until ctx ends, then drains (ingress.Config.DrainDelay, DrainTimeout) and returns.
// The probes are served through the drain, so /readyz reports it and /metrics can be scraped.
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
	if cfg.MaxPending < 0 || cfg.MaxPendingPerListener < 0 || cfg.MaxPendingPerSource < 0 {
		return errors.New("--max-pending, --max-pending-per-listener and --max-pending-per-source must not be negative (0: the default)")
	}
	if cfg.DrainDelay < 0 || cfg.DrainTimeout < 0 {
		return errors.New("--drain-delay and --drain-timeout must not be negative")
	}
	xc := xdsclient.Config{Address: cfg.XDSAddress, NodeID: cfg.NodeID}
	tlsCfg, err := xdsTLS(cfg)
	if err != nil {
		return err
	}
	xc.TLS = tlsCfg
	logCapacity(cfg.Log)
	reg := probe.NewRegistry()
	// The relay loops are as many as the processors may be at start (procscale starts at the
	// most); a CPU limit raised later gives more processors, not more loops.
	maxProcs := runtime.GOMAXPROCS(0)
	in := ingress.New(ingress.Config{Listeners: listeners, Log: cfg.Log, Registry: reg, MaxPending: cfg.MaxPending,
		MaxPendingPerListener: cfg.MaxPendingPerListener, MaxPendingPerSource: cfg.MaxPendingPerSource, TrustedProxies: cfg.TrustedProxies,
		DrainDelay: cfg.DrainDelay, DrainTimeout: cfg.DrainTimeout, TerminateNetHTTP2: cfg.TerminateNetHTTP2, Loops: maxProcs, Listen: cfg.Listeners.Listen})

	// The probes outlive ctx until the ingress has drained; a failure of either ends ingress's
	// context (through the group's), which drains it too.
	probeCtx, stopProbes := context.WithCancel(context.WithoutCancel(ctx))
	defer stopProbes()
	g, gctx := errgroup.WithContext(ctx)
	if cfg.MetricsAddress != "" {
		ml, err := cfg.Listeners.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		ready := func() (bool, string) {
			switch {
			case in.Draining():
				return false, "draining: shutting down"
			case in.Ready():
				return true, ""
			}
			return false, "no configuration applied yet"
		}
		g.Go(func() error { return probe.Serve(probeCtx, ml, probe.Handler(reg, ready, cfg.Profiling)) })
	}
	// The memory of a load back to the system once it is over (idlemem), and that of a peak of
	// connections once half of them have closed, which allocates nothing that would show it.
	g.Go(func() error {
		return idlemem.Run(probeCtx, idlemem.Config{Held: in.Open, Released: in.MemoryReleased})
	})
	if cfg.AdaptiveProcs {
		log := cfg.Log.WithName("procs")
		g.Go(func() error {
			return procscale.Run(probeCtx, procscale.Config{Changed: func(procs int, used float64) {
				in.ProcsChanged()
				log.V(1).Info("GOMAXPROCS changed", "procs", procs, "usedCores", used)
			}})
		})
	}
	g.Go(func() error {
		defer stopProbes()
		return in.Run(gctx, xc)
	})
	return g.Wait()
}

// xdsTLS is the xDS client's TLS configuration: mutual TLS from the certificate files, or nil
// with --xds-insecure. The files are read once here, so that a wrong path fails at start.
func xdsTLS(cfg Config) (*tls.Config, error) {
	f := &tlsreload.Files{Cert: cfg.XDSCertFile, Key: cfg.XDSKeyFile, CA: cfg.XDSCAFile, Log: cfg.Log.WithName("xds-tls")}
	files := f.Cert != "" || f.Key != "" || f.CA != ""
	switch {
	case cfg.XDSInsecure && files:
		return nil, errors.New("--xds-insecure and --xds-cert-file/--xds-key-file/--xds-ca-file exclude each other")
	case cfg.XDSInsecure:
		cfg.Log.Info("xDS in plaintext, unauthenticated (--xds-insecure)")
		return nil, nil
	case f.Cert == "" || f.Key == "" || f.CA == "":
		return nil, errors.New("xDS runs over mutual TLS: give --xds-cert-file, --xds-key-file and --xds-ca-file (or --xds-insecure for local use)")
	}
	if _, err := f.Material(); err != nil {
		return nil, fmt.Errorf("xDS client certificate: %w", err)
	}
	name := cfg.XDSServerName
	if name == "" {
		// The host of --xds: crypto/tls sends no server name for an IP address, and a name
		// is what the server's certificate is checked against.
		host, _, err := net.SplitHostPort(cfg.XDSAddress)
		if err != nil {
			return nil, fmt.Errorf("--xds %q: %w", cfg.XDSAddress, err)
		}
		name = host
	}
	return tlsreload.ClientConfig(f, name), nil
}
