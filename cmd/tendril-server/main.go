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
	"syscall"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/credentials"

	"github.com/tendril-net/tendril/internal/logging"
	"github.com/tendril-net/tendril/internal/netflag"
	"github.com/tendril-net/tendril/internal/probe"
	"github.com/tendril-net/tendril/server"
	"github.com/tendril-net/tendril/tunnel/wg"
)

// Config is tendril-server's configuration.
type Config struct {
	PrivateKeyFile     string
	AgentPublicKey     string
	Addresses          []netip.Addr
	AgentAddress       netip.Addr
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
	Log                logr.Logger
}

func main() {
	var cfg Config
	cfg.Addresses = mustAddrs("fd8f:6d53:b97a:1::1,198.18.0.1")
	cfg.AgentAddress = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
	var verbosity int
	flag.StringVar(&cfg.PrivateKeyFile, "private-key-file", "", "the server's WireGuard private key (base64, as wg genkey writes it)")
	flag.StringVar(&cfg.AgentPublicKey, "agent-public-key", "", "the shoot agent's WireGuard public key (base64), or @FILE to read it from a file")
	flag.Var((*netflag.Addrs)(&cfg.Addresses), "addresses", "the server's inner tunnel addresses, comma-separated: an IPv6 one from Gardener's VPN range, and an IPv4 one (RFC 2544's 198.18/15, unlikely in a shoot) as the source toward IPv4 shoot networks")
	flag.Func("agent-address", "the agent's inner tunnel address (default fd8f:6d53:b97a:1::2)", func(v string) (err error) {
		cfg.AgentAddress, err = netip.ParseAddr(v)
		return err
	})
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
	flag.IntVar(&verbosity, "v", 0, "log verbosity")
	flag.Parse()
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-server")
	fail := func(err error) {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
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
	priv, err := wg.LoadPrivateKey(cfg.PrivateKeyFile)
	if err != nil {
		return err
	}
	agentKey, err := wg.ParsePublicKeyArg(cfg.AgentPublicKey)
	if err != nil {
		return fmt.Errorf("--agent-public-key: %w", err)
	}
	// The agent is reached at its own address and routes the shoot's networks.
	allowed := append([]netip.Prefix{netip.PrefixFrom(cfg.AgentAddress, cfg.AgentAddress.BitLen())}, cfg.ShootCIDRs...)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv, err := server.New(server.Config{
		Tunnel: wg.Config{
			PrivateKey:     priv,
			LocalAddresses: cfg.Addresses,
			Peers:          []wg.Peer{{PublicKey: agentKey, AllowedIPs: allowed}},
		},
		ShootCIDRs:         cfg.ShootCIDRs,
		MaxConcurrentDials: cfg.MaxConcurrentDials,
		Log:                cfg.Log,
		Registry:           reg,
	})
	if err != nil {
		return err
	}
	defer srv.Close()

	tl, err := net.Listen("tcp", cfg.TunnelAddress)
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
		cl, err := tls.Listen("tcp", cfg.ConnectAddress, tlsCfg)
		if err != nil {
			tl.Close()
			return fmt.Errorf("CONNECT listener: %w", err)
		}
		g.Go(func() error { return srv.ServeConnect(ctx, cl) })
	}
	if cfg.GRPCAddress != "" {
		gl, err := net.Listen("tcp", cfg.GRPCAddress)
		if err != nil {
			return fmt.Errorf("gRPC listener: %w", err)
		}
		g.Go(func() error { return srv.ServeGRPC(ctx, gl, credentials.NewTLS(tlsCfg)) })
	}
	for _, sock := range []struct {
		path  string
		serve func(net.Listener) error
	}{
		{cfg.ConnectSocket, func(l net.Listener) error { return srv.ServeConnect(ctx, l) }},
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
		ml, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		g.Go(func() error { return probe.Serve(ctx, ml, probe.Handler(reg, srv.Ready, false)) })
	}
	cfg.Log.Info("Serving", "tunnel", tl.Addr().String(), "connect", cfg.ConnectAddress, "grpc", cfg.GRPCAddress, "shootCIDRs", fmt.Sprint(cfg.ShootCIDRs))
	return g.Wait()
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
	}, nil
}
