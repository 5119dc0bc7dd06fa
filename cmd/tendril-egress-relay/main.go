// Command tendril-egress-relay is the sidecar that lets kube-apiserver use tendril-server's
// konnectivity gRPC egress: kube-apiserver dials gRPC egress only over a Unix socket, so the relay
// listens on one in a volume shared with kube-apiserver and carries each connection to
// tendril-server's gRPC port over mutual TLS (package egressrelay). On a CONNECT socket (beside
// that one or instead of it) it serves kube-apiserver's HTTP CONNECT egress the same way. Given
// several servers (an HA shoot's replicas), it sends each tunnel to the first that answers.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/egressrelay"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/internal/proc/logging"
	"github.com/tendril-net/tendril/internal/proc/probe"
)

// Config is tendril-egress-relay's configuration.
type Config struct {
	Relay egressrelay.Config
	// MetricsAddress serves /metrics, /healthz and /readyz; empty: off.
	MetricsAddress string
	// Profiling serves the Go profiler on the metrics address.
	Profiling bool
	Log       logr.Logger
	// Listeners are the sockets this process inherited (nil: none): a listener whose address
	// is among them is that socket.
	Listeners *inherit.Listeners
}

func main() {
	cfg, err := parse(os.Args[1:])
	probe.SampleHeap(cfg.Profiling)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		if errors.Is(err, errVersion) {
			fmt.Println(buildinfo.String("tendril-egress-relay"))
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "tendril-egress-relay:", err)
		os.Exit(2)
	}
	// Sockets a parent bound and handed over (tests); not for the processes this one starts.
	if cfg.Listeners, err = inherit.Parse(os.Getenv(inherit.EnvVar)); err != nil {
		fmt.Fprintln(os.Stderr, "tendril-egress-relay:", err)
		os.Exit(2)
	}
	os.Unsetenv(inherit.EnvVar)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
}

// errVersion is parse's answer to --version, like flag.ErrHelp to -h.
var errVersion = errors.New("version requested")

func parse(args []string) (Config, error) {
	var cfg Config
	var verbosity int
	var mode, servers string
	flags := flag.NewFlagSet("tendril-egress-relay", flag.ContinueOnError)
	flags.StringVar(&cfg.Relay.Socket, "socket", "", "the Unix socket on which konnectivity's gRPC is served (egress selection proxyProtocol GRPC: its udsName); a stale socket there is replaced (empty: off; this or --connect-socket is required)")
	flags.StringVar(&cfg.Relay.ConnectSocket, "connect-socket", "", "the Unix socket on which HTTP CONNECT is served (egress selection proxyProtocol HTTPConnect over a Unix socket); each CONNECT is a stream of the one connection to tendril-server (empty: off)")
	flags.StringVar(&mode, "socket-mode", "0600", "permission bits of the socket (octal); kube-apiserver's user must be able to write it")
	flags.StringVar(&servers, "server", "", "tendril-server's konnectivity gRPC front-end, host:port (tendril-server.<namespace>.svc:8090); "+
		"for an HA shoot its replicas by their own names, comma-separated (tendril-server-0.tendril-server.<namespace>.svc.cluster.local:8090,"+
		"tendril-server-1.tendril-server.<namespace>.svc.cluster.local:8090): each tunnel goes to the first that answers its dial")
	flags.StringVar(&cfg.Relay.ServerName, "server-name", "", "the name tendril-server's certificate must carry, whichever server is dialled (default: the host of --server; required when its servers are on several hosts)")
	flags.StringVar(&cfg.Relay.CertFile, "tls-cert-file", "", "the client certificate for tendril-server (PEM); read again when it changes")
	flags.StringVar(&cfg.Relay.KeyFile, "tls-key-file", "", "the client certificate's key (PEM); read again when it changes")
	flags.StringVar(&cfg.Relay.CAFile, "ca-file", "", "the CA bundle that signed tendril-server's certificate (PEM); read again when it changes")
	flags.IntVar(&cfg.Relay.MaxConnections, "max-connections", 1024, "connections relayed at once; more are closed at once and counted")
	flags.DurationVar(&cfg.Relay.HandshakeTimeout, "handshake-timeout", 10*time.Second, "bound on the dial, TLS handshake and first bytes of tendril-server")
	flags.DurationVar(&cfg.Relay.IdleTimeout, "idle-timeout", time.Hour, "a relayed connection without a byte for this long is closed")
	flags.DurationVar(&cfg.Relay.DrainTimeout, "drain-timeout", 30*time.Second, "how long relayed connections may continue after SIGTERM")
	flags.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:16913", "address for /metrics, /healthz and /readyz (empty: off); loopback, as the relay shares kube-apiserver's pod")
	flags.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	flags.IntVar(&verbosity, "v", 0, "log verbosity")
	version := flags.Bool("version", false, "print the version and exit")
	if err := flags.Parse(args); err != nil {
		return cfg, err
	}
	if *version {
		return cfg, errVersion
	}
	if flags.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", flags.Args())
	}
	if servers != "" {
		for s := range strings.SplitSeq(servers, ",") {
			if s = strings.TrimSpace(s); s == "" {
				return cfg, fmt.Errorf("--server %q: an empty entry in the list", servers)
			}
			cfg.Relay.Servers = append(cfg.Relay.Servers, s)
		}
	}
	m, err := strconv.ParseUint(mode, 8, 32)
	if err != nil || m > 0o777 || m == 0 {
		return cfg, fmt.Errorf("--socket-mode %q: want octal permission bits such as 0600", mode)
	}
	cfg.Relay.SocketMode = fs.FileMode(m)
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-egress-relay")
	cfg.Relay.Log = cfg.Log
	return cfg, nil
}

// Run relays until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	reg := probe.NewRegistry()
	cfg.Relay.Registry = reg
	r, err := egressrelay.New(cfg.Relay)
	if err != nil {
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	if err := probe.Start(ctx, g, cfg.Listeners.Listen, cfg.MetricsAddress, reg, r.Ready, cfg.Profiling); err != nil {
		return err
	}
	g.Go(func() error { return r.Run(ctx) })
	return g.Wait()
}
