// Command tendril-server is the seed side of one shoot's reversed VPN: it accepts the shoot
// agent's tunnel (forwarded by the ingress) and serves kube-apiserver's egress to the shoot's
// networks through it: HTTP CONNECT or konnectivity's gRPC ProxyService, each over mutual TLS
// or a Unix socket.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/credentials"

	"github.com/tendril-net/tendril/internal/host/idlemem"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/internal/proc/logging"
	"github.com/tendril-net/tendril/internal/proc/netflag"
	"github.com/tendril-net/tendril/internal/proc/probe"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
)

// Config is tendril-server's configuration.
type Config struct {
	// Listeners are the sockets this process inherited (nil: none): a listener whose address
	// is among them is that socket.
	Listeners      *inherit.Listeners
	PrivateKeyFile string
	// AgentPublicKeys are the agents' keys (base64 or @FILE), one per replica; AgentAddresses
	// their inner addresses in the same order (if empty: fd8f:6d53:b97a:1::2, ::3, …).
	AgentPublicKeys    []string
	AgentAddresses     []netip.Addr
	AgentTimeout       time.Duration
	Addresses          []netip.Addr
	ShootCIDRs         []netip.Prefix
	TunnelAddress      string
	ConnectAddress     string
	ConnectSocket      string
	GRPCAddress        string
	GRPCSocket         string
	TLSCertFile        string
	TLSKeyFile         string
	ClientCAFile       string
	MetricsAddress     string
	MaxConcurrentDials int
	// ReleaseStartupPages drops the binary's pages that startup touched from the resident set
	// once serving and again once the tunnel is up (releaseStartupMemory).
	ReleaseStartupPages bool
	// TUN, if set, names the TUN device the tunnel runs on (the kernel's TCP/IP stack; needs
	// NET_ADMIN); empty: the userspace netstack.
	TUN string
	// MemoryLimitMiB is the Go runtime's soft memory limit; 0 leaves Go's (none). The
	// environment's GOMEMLIMIT, if set, wins.
	MemoryLimitMiB int
	// IdleGCPercent is the GC percent while idle (idlemem.Config.IdleGCPercent); 0 leaves
	// GOGC alone.
	IdleGCPercent int
	// Profiling serves the Go profiler on the metrics address.
	Profiling bool
	Log       logr.Logger
}

func main() {
	var cfg Config
	cfg.Addresses = mustAddrs("fd8f:6d53:b97a:1::1,198.18.0.1")
	var verbosity int
	flag.StringVar(&cfg.PrivateKeyFile, "private-key-file", "", "the server's WireGuard private key (base64, as wg genkey writes it)")
	flag.Func("agent-public-key", "a shoot agent's WireGuard public key (base64), or @FILE to read it from a file; repeat the flag or separate with commas for several agents (HA replicas)", func(v string) error {
		for _, k := range strings.Split(v, ",") {
			if k = strings.TrimSpace(k); k != "" {
				cfg.AgentPublicKeys = append(cfg.AgentPublicKeys, k)
			}
		}
		return nil
	})
	flag.Var((*netflag.Addrs)(&cfg.Addresses), "addresses", "the server's inner tunnel addresses, comma-separated: an IPv6 one from Gardener's VPN range, and an IPv4 one (RFC 2544's 198.18/15, unlikely in a shoot) as the source toward IPv4 shoot networks")
	flag.Func("agent-address", "an agent's inner tunnel address, in the order of --agent-public-key; repeat the flag or separate with commas (default fd8f:6d53:b97a:1::2 for the first agent, ::3 for the second, …)", func(v string) error {
		var as netflag.Addrs
		if err := as.Set(v); err != nil {
			return err
		}
		cfg.AgentAddresses = append(cfg.AgentAddresses, as...)
		return nil
	})
	flag.DurationVar(&cfg.AgentTimeout, "agent-timeout", 5*time.Second, "an agent that sends no packet WireGuard accepts for this long counts as dead; the shoot's networks then route to another live agent (agents heartbeat every second)")
	flag.Var((*netflag.Prefixes)(&cfg.ShootCIDRs), "shoot-cidrs", "the shoot's node, pod and service networks, comma-separated: the only egress targets")
	flag.StringVar(&cfg.TunnelAddress, "tunnel-address", ":1194", "where agents' tunnel streams arrive (forwarded by the ingress)")
	flag.StringVar(&cfg.ConnectAddress, "connect-address", ":9443", "egress HTTP CONNECT over mutual TLS (empty: off)")
	flag.StringVar(&cfg.ConnectSocket, "connect-socket", "", "egress HTTP CONNECT on this Unix socket (empty: off)")
	flag.StringVar(&cfg.GRPCAddress, "grpc-address", ":8090", "egress konnectivity gRPC ProxyService over mutual TLS (empty: off)")
	flag.StringVar(&cfg.GRPCSocket, "grpc-socket", "", "egress konnectivity gRPC ProxyService on this Unix socket (empty: off)")
	flag.StringVar(&cfg.TLSCertFile, "tls-cert-file", "", "certificate of the CONNECT and gRPC front-ends")
	flag.StringVar(&cfg.TLSKeyFile, "tls-key-file", "", "key of the CONNECT and gRPC front-ends")
	flag.StringVar(&cfg.ClientCAFile, "client-ca-file", "", "CA that signs kube-apiserver's client certificate")
	flag.StringVar(&cfg.MetricsAddress, "metrics-address", ":9090", "address for /metrics, /healthz and /readyz (empty: off)")
	flag.IntVar(&cfg.MaxConcurrentDials, "max-concurrent-dials", 256, "dials in flight through the tunnel at once; more wait up to the dial timeout, then get 503")
	flag.BoolVar(&cfg.ReleaseStartupPages, "release-startup-pages", true, "once serving, and again once the first agent's tunnel is up, drop the binary's code and constant pages that startup touched from the resident set (they stay in the page cache and fault back in when used): an idle server's RSS goes from about 19 to 12 MiB")
	flag.StringVar(&cfg.TUN, "tun", "", "create a TUN device of this name and carry the tunnel's connections with the kernel's TCP/IP stack (needs NET_ADMIN and /dev/net/tun; the agent runs with --tun too); empty: gVisor's userspace TCP/IP stack, unprivileged")
	flag.IntVar(&cfg.MemoryLimitMiB, "memory-limit-mib", idlemem.TunnelSoftLimitMiB, "soft limit of the Go runtime's memory, MiB (0: none; GOMEMLIMIT in the environment wins): bounds the peak of a load, above it the GC runs more often")
	flag.IntVar(&cfg.IdleGCPercent, "idle-gc-percent", idlemem.TunnelIdleGCPercent, "GC percent while idle, so that an idle process holds little garbage (0: GOGC throughout; a GOGC at or below it stays)")
	flag.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	flag.IntVar(&verbosity, "v", 0, "log verbosity")
	version := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	probe.SampleHeap(cfg.Profiling)
	if *version {
		fmt.Println(buildinfo.String("tendril-server"))
		return
	}
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-server")
	fail := func(err error) {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
	// Sockets a parent bound and handed over (tests, tendril-bench, tendril-local); not for
	// the processes this one starts.
	inherited, err := inherit.Parse(os.Getenv(inherit.EnvVar))
	os.Unsetenv(inherit.EnvVar)
	if err != nil {
		fail(err)
	}
	cfg.Listeners = inherited
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		fail(err)
	}
}

func mustAddrs(v string) []netip.Addr {
	var a netflag.Addrs
	if err := a.Set(v); err != nil {
		panic(err) // a constant default
	}
	return a
}

// Run serves until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if os.Getenv("GOMEMLIMIT") == "" && cfg.MemoryLimitMiB > 0 {
		debug.SetMemoryLimit(int64(cfg.MemoryLimitMiB) << 20)
	}
	priv, err := wg.LoadPrivateKey(cfg.PrivateKeyFile)
	if err != nil {
		return err
	}
	peers, err := agentPeers(cfg.AgentPublicKeys, cfg.AgentAddresses)
	if err != nil {
		return err
	}
	reg := probe.NewRegistry()
	srv, err := seedserver.New(seedserver.Config{
		Tunnel: wg.Config{
			PrivateKey:     priv,
			LocalAddresses: cfg.Addresses,
			Peers:          peers,
			TUN:            cfg.TUN,
		},
		ShootCIDRs:         cfg.ShootCIDRs,
		AgentTimeout:       cfg.AgentTimeout,
		MaxConcurrentDials: cfg.MaxConcurrentDials,
		Log:                cfg.Log,
		Registry:           reg,
	})
	if err != nil {
		return err
	}
	defer srv.Close()

	tl, err := cfg.Listeners.Listen("tcp", cfg.TunnelAddress)
	if err != nil {
		return fmt.Errorf("tunnel listener: %w", err)
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return srv.ServeTunnel(ctx, tl) })
	var tlsCfg *tls.Config
	if cfg.ConnectAddress != "" || cfg.GRPCAddress != "" {
		if tlsCfg, err = mutualTLS(cfg.TLSCertFile, cfg.TLSKeyFile, cfg.ClientCAFile); err != nil {
			tl.Close()
			return err
		}
	}
	if cfg.ConnectAddress != "" {
		cl, err := cfg.Listeners.Listen("tcp", cfg.ConnectAddress)
		if err != nil {
			tl.Close()
			return fmt.Errorf("CONNECT listener: %w", err)
		}
		g.Go(func() error { return srv.ServeConnect(ctx, cl, tlsCfg) })
	}
	if cfg.GRPCAddress != "" {
		gl, err := cfg.Listeners.Listen("tcp", cfg.GRPCAddress)
		if err != nil {
			return fmt.Errorf("gRPC listener: %w", err)
		}
		g.Go(func() error { return srv.ServeGRPC(ctx, gl, credentials.NewTLS(tlsCfg)) })
	}
	for _, sock := range []struct {
		path  string
		serve func(net.Listener) error
	}{
		{cfg.ConnectSocket, func(l net.Listener) error { return srv.ServeConnect(ctx, l, nil) }},
		{cfg.GRPCSocket, func(l net.Listener) error { return srv.ServeGRPC(ctx, l, nil) }},
	} {
		if sock.path == "" {
			continue
		}
		_ = os.Remove(sock.path) // a stale socket from a previous run
		ul, err := net.Listen("unix", sock.path)
		if err != nil {
			return fmt.Errorf("socket %s: %w", sock.path, err)
		}
		g.Go(func() error { return sock.serve(ul) })
	}
	if cfg.MetricsAddress != "" {
		ml, err := cfg.Listeners.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		g.Go(func() error { return probe.Serve(ctx, ml, probe.Handler(reg, srv.Ready, cfg.Profiling)) })
	}
	if cfg.ReleaseStartupPages {
		releaseStartupMemory(cfg.Log)
		// The tunnel's bring-up is start-up too: the agent's first handshake, the first
		// connections through the netstack and the readiness probes touch code that an idle
		// server does not run again (docs/performance.md, "Idle memory"). Once, not after every
		// bring-up: what an idle server keeps running faults back in within a second anyway.
		g.Go(func() error {
			select {
			case <-ctx.Done():
			case <-srv.TunnelUp():
				releaseStartupMemory(cfg.Log)
			}
			return nil
		})
	}
	// The memory of a load back to the system once it is over (idlemem): Go alone keeps a
	// load's peak for minutes (docs/performance.md, "Memory after a load").
	g.Go(func() error {
		return idlemem.Run(ctx, idlemem.Config{IdleGCPercent: cfg.IdleGCPercent, Released: func() {
			// The load faulted in code that an idle server does not run (TLS handshakes,
			// the front-ends' and the netstack's paths): drop it again, as after start-up.
			if cfg.ReleaseStartupPages {
				if _, err := idlemem.ReleaseBinaryPages(); err != nil {
					cfg.Log.V(1).Info("Releasing the binary's pages failed (memory only)", "error", err.Error())
				}
			}
		}})
	})
	cfg.Log.Info("Serving", "tunnel", tl.Addr().String(), "connect", cfg.ConnectAddress, "grpc", cfg.GRPCAddress, "shootCIDRs", fmt.Sprint(cfg.ShootCIDRs))
	return g.Wait()
}

// releaseStartupMemory returns what start-up allocated and no longer needs to the system, then
// drops the binary's pages from the resident set (idlemem.ReleaseBinaryPages).
func releaseStartupMemory(log logr.Logger) {
	debug.FreeOSMemory()
	if _, err := idlemem.ReleaseBinaryPages(); err != nil {
		log.Info("Releasing startup pages failed (memory only)", "error", err.Error())
	}
}

// firstAgentAddress is the first agent's default inner address; the next agents count up.
var firstAgentAddress = netip.MustParseAddr("fd8f:6d53:b97a:1::2")

// agentPeers pairs the agents' keys with their inner addresses. Each agent is reached at its own
// address; the server routes the shoot's networks to one agent at a time itself.
func agentPeers(keys []string, addrs []netip.Addr) ([]wg.Peer, error) {
	if len(keys) == 0 {
		return nil, errors.New("--agent-public-key is required")
	}
	if len(addrs) == 0 {
		a := firstAgentAddress
		for range keys {
			addrs = append(addrs, a)
			a = a.Next()
		}
	}
	if len(addrs) != len(keys) {
		return nil, fmt.Errorf("%d agent keys but %d --agent-address values: give one address per agent", len(keys), len(addrs))
	}
	peers := make([]wg.Peer, len(keys))
	for i, k := range keys {
		key, err := wg.ParsePublicKeyArg(k)
		if err != nil {
			return nil, fmt.Errorf("--agent-public-key %d: %w", i+1, err)
		}
		peers[i] = wg.Peer{PublicKey: key, AllowedIPs: []netip.Prefix{netip.PrefixFrom(addrs[i], addrs[i].BitLen())}}
	}
	return peers, nil
}

// mutualTLS is the front-end's TLS: its own certificate, and kube-apiserver's client
// certificate required and verified against the shoot's CA. The handshake's deadline is the
// request deadline the server sets before its first read.
func mutualTLS(certFile, keyFile, caFile string) (*tls.Config, error) {
	if certFile == "" || keyFile == "" || caFile == "" {
		return nil, errors.New("the CONNECT and gRPC front-ends need --tls-cert-file, --tls-key-file and --client-ca-file (mutual TLS), or --connect-address=\"\" --grpc-address=\"\"")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("CONNECT certificate: %w", err)
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("client CA %s: no certificates", caFile)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
		// kube-apiserver never resumes a session (its egress dialers keep no session cache: a
		// new full handshake per dial), so a ticket after each handshake, which carries the
		// client's certificate and is encrypted for it, would be work and bytes for nothing.
		SessionTicketsDisabled: true,
	}, nil
}
