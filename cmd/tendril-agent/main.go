// Command tendril-agent runs tendril's shoot-side agents. `tendril-agent apiserver-proxy` is the
// node agent of GEP-8 (a DaemonSet on the host network): it forwards in-cluster connections to
// kube-apiserver's advertised address to the seed ingress.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/agent/apiserverproxy"
	"github.com/tendril-net/tendril/agent/vpn"
	"github.com/tendril-net/tendril/internal/host/idlemem"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/sysctl"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/internal/proc/logging"
	"github.com/tendril-net/tendril/internal/proc/netflag"
	"github.com/tendril-net/tendril/internal/proc/probe"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/wire"
)

const usage = `usage: tendril-agent <mode> [flags]

modes:
  vpn               keep the reversed VPN to the seed up and serve the seed's connections into the shoot
  apiserver-proxy   forward in-cluster connections to kube-apiserver's advertised address to the seed ingress
  sysctl NAME=VALUE…  set kernel parameters of the network namespace (vpn --tun's init container: net.ipv4.ip_forward=1)
  --version         print the version and exit
`

func main() {
	probe.SampleHeap(false) // no profiler
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	if os.Args[1] == "--version" || os.Args[1] == "-version" {
		fmt.Println(buildinfo.String("tendril-agent"))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Sockets a parent bound and handed over (tests, tendril-bench); not for the processes
	// this one starts.
	inherited, err := inherit.Parse(os.Getenv(inherit.EnvVar))
	os.Unsetenv(inherit.EnvVar)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tendril-agent:", err)
		os.Exit(2)
	}
	var log logr.Logger
	switch os.Args[1] {
	case "vpn":
		var cfg VPNConfig
		cfg, err = parseVPN(os.Args[2:])
		if err == nil {
			log, cfg.Listeners = cfg.Log, inherited
			err = RunVPN(ctx, cfg)
		}
	case "apiserver-proxy":
		var cfg APIServerProxyConfig
		cfg, err = parseAPIServerProxy(os.Args[2:])
		if err == nil {
			log, cfg.Listeners = cfg.Log, inherited
			err = RunAPIServerProxy(ctx, cfg)
		}
	case "sysctl":
		err = runSysctl(os.Args[2:])
	default:
		fmt.Fprintf(os.Stderr, "tendril-agent: unknown mode %q\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		if log.GetSink() == nil {
			fmt.Fprintln(os.Stderr, "tendril-agent:", err)
		} else {
			log.Error(err, "Exiting")
		}
		os.Exit(1)
	}
}

// runSysctl sets each NAME=VALUE of args (sysctl's dotted names) and prints what it set.
func runSysctl(args []string) error {
	if len(args) == 0 {
		return errors.New("sysctl: want NAME=VALUE arguments")
	}
	for _, a := range args {
		name, value, ok := strings.Cut(a, "=")
		if !ok {
			return fmt.Errorf("sysctl: %q is not NAME=VALUE", a)
		}
		if err := sysctl.Ensure(name, value); err != nil {
			return err
		}
		fmt.Printf("%s = %s\n", name, value)
	}
	return nil
}

// VPNConfig is the configuration of `tendril-agent vpn`.
type VPNConfig struct {
	// Listeners are the sockets this process inherited (nil: none): a listener whose address
	// is among them is that socket.
	Listeners *inherit.Listeners
	VPN       vpn.Config
	// Destinations are the CONNECT destinations, one tunnel to each (vpn.Set); none: the one
	// a Direct agent needs no name for.
	Destinations   []string
	PrivateKeyFile string
	ServerKey      string
	MetricsAddress string
	// MemoryLimitMiB is the Go runtime's soft memory limit; 0 leaves Go's (none). The
	// environment's GOMEMLIMIT, if set, wins.
	MemoryLimitMiB int
	// IdleGCPercent is the GC percent while idle (idlemem.Config.IdleGCPercent); 0 leaves
	// GOGC alone.
	IdleGCPercent int
	Log           logr.Logger
}

func parseVPN(args []string) (VPNConfig, error) {
	var cfg VPNConfig
	fs := flag.NewFlagSet("tendril-agent vpn", flag.ContinueOnError)
	var verbosity int
	cfg.VPN.Address = netip.MustParseAddr("fd8f:6d53:b97a:1::2")
	if err := (*netflag.Addrs)(&cfg.VPN.ServerAddresses).Set("fd8f:6d53:b97a:1::1,198.18.0.1"); err != nil {
		return cfg, err
	}
	fs.StringVar(&cfg.PrivateKeyFile, "private-key-file", "", "the agent's WireGuard private key (base64)")
	fs.StringVar(&cfg.ServerKey, "server-public-key", "", "the server's WireGuard public key (base64), or @FILE")
	fs.Func("address", "the agent's inner tunnel address (default fd8f:6d53:b97a:1::2)", func(v string) (err error) {
		cfg.VPN.Address, err = netip.ParseAddr(v)
		return err
	})
	fs.Var((*netflag.Addrs)(&cfg.VPN.ServerAddresses), "server-addresses", "the server's inner tunnel addresses (IPv6 and IPv4, comma-separated)")
	fs.Var((*netflag.Prefixes)(&cfg.VPN.ShootCIDRs), "shoot-cidrs", "the shoot's node, pod and service networks, comma-separated: the only destinations the seed may reach")
	fs.StringVar(&cfg.VPN.Seed, "seed", "", "the ingress's tunnel listener (host:8132), or with --direct the server's tunnel port")
	fs.BoolVar(&cfg.VPN.Direct, "direct", false, "dial the server directly, without CONNECT")
	fs.StringVar(&cfg.VPN.Header, "header", wire.ReversedVPNHeader, "CONNECT header naming the destination (Reversed-VPN on 8132, X-Gardener-Destination on 8443)")
	fs.Func("destination", "CONNECT destination: outbound|1194||tendril-server.<namespace>.svc.cluster.local; comma-separated, one tunnel to each (an HA shoot's server replicas: outbound|1194||tendril-server-N.tendril-server.<namespace>.svc.cluster.local)", func(v string) error {
		cfg.Destinations = strings.Split(v, ",")
		return nil
	})
	fs.StringVar(&cfg.VPN.TUN, "tun", "", "create a TUN device of this name and carry the tunnel's connections with the kernel's TCP/IP stack: TCP into --shoot-cidrs is redirected to the agent, which dials it, UDP (DNS) forwarded by the kernel, masqueraded (needs NET_ADMIN, /dev/net/tun and a writable net.ipv4.ip_forward); empty: gVisor's userspace TCP/IP stack, unprivileged")
	fs.DurationVar(&cfg.VPN.HeartbeatInterval, "heartbeat-interval", time.Second, "how often to send a heartbeat through the tunnel (the server echoes it)")
	fs.DurationVar(&cfg.VPN.PathTimeout, "path-timeout", 5*time.Second, "end the stream and dial again when heartbeats go unanswered this long")
	fs.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:16912", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.IntVar(&cfg.MemoryLimitMiB, "memory-limit-mib", idlemem.TunnelSoftLimitMiB, "soft limit of the Go runtime's memory, MiB (0: none; GOMEMLIMIT in the environment wins): bounds the peak of a load, above it the GC runs more often")
	fs.IntVar(&cfg.IdleGCPercent, "idle-gc-percent", idlemem.TunnelIdleGCPercent, "GC percent while idle, so that an idle process holds little garbage (0: GOGC throughout; a GOGC at or below it stays)")
	fs.IntVar(&verbosity, "v", 0, "log verbosity")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("vpn")
	cfg.VPN.Log = cfg.Log
	return cfg, nil
}

// RunVPN runs the vpn agent until ctx ends.
func RunVPN(ctx context.Context, cfg VPNConfig) error {
	if os.Getenv("GOMEMLIMIT") == "" && cfg.MemoryLimitMiB > 0 {
		debug.SetMemoryLimit(int64(cfg.MemoryLimitMiB) << 20)
	}
	var err error
	if cfg.VPN.PrivateKey, err = wg.LoadPrivateKey(cfg.PrivateKeyFile); err != nil {
		return err
	}
	if cfg.VPN.ServerPublicKey, err = wg.ParsePublicKeyArg(cfg.ServerKey); err != nil {
		return fmt.Errorf("--server-public-key: %w", err)
	}
	reg := probe.NewRegistry()
	cfg.VPN.Registry = reg
	dests := cfg.Destinations
	if len(dests) == 0 {
		dests = []string{cfg.VPN.Destination}
	}
	agent, err := vpn.NewSet(cfg.VPN, dests)
	if err != nil {
		return err
	}
	defer agent.Close()
	g, ctx := errgroup.WithContext(ctx)
	if err := probe.Start(ctx, g, cfg.Listeners.Listen, cfg.MetricsAddress, reg, agent.Ready, false); err != nil {
		return err
	}
	g.Go(func() error { return agent.Run(ctx) })
	// The memory of a load back to the system once it is over (idlemem), with the binary's pages
	// the load faulted in (the netstack's and WireGuard's paths), as tendril-server does.
	g.Go(func() error {
		return idlemem.Run(ctx, idlemem.Config{IdleGCPercent: cfg.IdleGCPercent, Released: func() {
			if _, err := idlemem.ReleaseBinaryPages(); err != nil {
				cfg.Log.V(1).Info("Releasing the binary's pages failed (memory only)", "error", err.Error())
			}
		}})
	})
	return g.Wait()
}

// APIServerProxyConfig is the configuration of `tendril-agent apiserver-proxy`.
type APIServerProxyConfig struct {
	// Listeners are the sockets this process inherited (nil: none): a listener whose address
	// is among them is that socket.
	Listeners      *inherit.Listeners
	Proxy          apiserverproxy.Config
	MetricsAddress string
	Log            logr.Logger
}

func parseAPIServerProxy(args []string) (APIServerProxyConfig, error) {
	var cfg APIServerProxyConfig
	fs := flag.NewFlagSet("tendril-agent apiserver-proxy", flag.ContinueOnError)
	var advertised, mode string
	var port uint
	var verbosity int
	fs.StringVar(&advertised, "advertised-address", "", "kube-apiserver's advertised address (the shoot's kubernetes Service endpoint)")
	fs.UintVar(&port, "port", 443, "port in-cluster clients dial on the advertised address")
	fs.StringVar(&cfg.Proxy.Ingress, "ingress", "", "the seed ingress's PROXY/CONNECT listener, host:8443")
	fs.StringVar(&mode, "mode", string(apiserverproxy.ModeProxyProtocol), "how the destination is announced: proxy-protocol or connect")
	fs.StringVar(&cfg.Proxy.Namespace, "namespace", "", "the shoot's namespace in the seed (connect mode: X-Gardener-Destination)")
	fs.StringVar(&cfg.Proxy.Interface, "interface", "tendril-api", `dummy link holding the advertised address (needs NET_ADMIN); "" leaves links alone`)
	fs.IntVar(&cfg.Proxy.MaxConnections, "max-connections", apiserverproxy.DefaultMaxConnections, "in-cluster connections forwarded at once (-1: no cap)")
	fs.IntVar(&cfg.Proxy.MaxConnectionsPerSource, "max-connections-per-source", apiserverproxy.DefaultMaxConnectionsPerSource, "connections of one pod (source address) forwarded at once (-1: no cap)")
	fs.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:16911", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.IntVar(&verbosity, "v", 0, "log verbosity")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	a, err := netip.ParseAddr(advertised)
	if err != nil {
		return cfg, fmt.Errorf("--advertised-address: %w", err)
	}
	if port == 0 || port > 65535 {
		return cfg, errors.New("--port out of range")
	}
	cfg.Proxy.AdvertisedAddress, cfg.Proxy.Port, cfg.Proxy.Mode = a, uint16(port), apiserverproxy.Mode(mode)
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("apiserver-proxy")
	cfg.Proxy.Log = cfg.Log
	return cfg, nil
}

// RunAPIServerProxy runs the node agent until ctx ends.
func RunAPIServerProxy(ctx context.Context, cfg APIServerProxyConfig) error {
	reg := probe.NewRegistry()
	cfg.Proxy.Registry = reg
	agent, err := apiserverproxy.New(cfg.Proxy)
	if err != nil {
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	ready := func() (bool, string) {
		if agent.Ready() {
			return true, ""
		}
		return false, "ingress " + cfg.Proxy.Ingress + " not reachable"
	}
	if err := probe.Start(ctx, g, cfg.Listeners.Listen, cfg.MetricsAddress, reg, ready, false); err != nil {
		return err
	}
	g.Go(func() error { return agent.Run(ctx) })
	return g.Wait()
}
