// Command tendril-seed is tendril's seed-side control plane: it serves the shoots' routes to the
// shared ingress over xDS. On Kubernetes (the default) it also runs the Extension controller
// that provisions each shoot; without Kubernetes it reads routes from a route file (--routes).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"
	ctrl "sigs.k8s.io/controller-runtime"
	crconfig "sigs.k8s.io/controller-runtime/pkg/client/config"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension/manifest"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
	"github.com/tendril-net/tendril/internal/proc/logging"
	"github.com/tendril-net/tendril/internal/proc/probe"
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
	// Ingress are the seed-wide choices of the ingress's listeners: the load balancer's PROXY
	// header, Gardener's VPN relay, the legacy port.
	Ingress translate.Options
	// XDSCertFile, XDSKeyFile and XDSCAFile are the xDS server's certificate, key and the CA
	// bundle client certificates must chain to, re-read when they change. Required in route-file
	// mode unless XDSInsecure; in Kubernetes mode they replace the secrets manager's.
	XDSCertFile, XDSKeyFile, XDSCAFile string
	// XDSInsecure serves xDS in plaintext, unauthenticated (local use).
	XDSInsecure bool
	Log         logr.Logger
	// Kubernetes configures the control plane on Kubernetes, used when Routes is empty.
	Kubernetes controlplane.Config
	// Listeners are the sockets this process inherited (nil: none), in route-file mode: a
	// listener whose address is among them is that socket.
	Listeners *inherit.Listeners
}

func main() {
	var cfg Config
	// Our own flag set: Gardener's dependencies register dozens of unrelated flags on the global one.
	fs := flag.NewFlagSet("tendril-seed", flag.ExitOnError)
	crconfig.RegisterFlags(fs) // --kubeconfig, read by ctrl.GetConfig
	var verbosity int
	k := &cfg.Kubernetes
	fs.StringVar(&cfg.Routes, "routes", "", "route file (YAML: shoots: [{name, hosts, apiserver, advertisedAddress, vpnServer}]); re-read when it changes")
	fs.StringVar(&cfg.XDSAddress, "xds-address", "127.0.0.1:18000", "address the xDS (ADS) gRPC server listens on")
	fs.StringVar(&cfg.MetricsAddress, "metrics-address", "127.0.0.1:18080", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.StringVar(&cfg.XDSCertFile, "xds-cert-file", "", "xDS over mutual TLS: the server certificate (PEM chain), re-read when it changes (Kubernetes mode: default the secrets manager's)")
	fs.StringVar(&cfg.XDSKeyFile, "xds-key-file", "", "xDS over mutual TLS: the server certificate's key")
	fs.StringVar(&cfg.XDSCAFile, "xds-ca-file", "", "xDS over mutual TLS: the CA bundle client certificates must chain to")
	fs.BoolVar(&cfg.XDSInsecure, "xds-insecure", false, "serve xDS in plaintext, unauthenticated (local use only): any client may read every route and claim any node ID")
	fs.StringVar(&k.XDSSecrets.ServiceName, "xds-service", "tendril-xds", "Kubernetes mode: the xDS Service in --leader-election-namespace, whose names the secrets manager's server certificate carries")
	fs.StringVar(&k.XDSSecrets.ClientSecret, "xds-client-secret", "tendril-xds-client", "Kubernetes mode: the Secret in --ingress-namespace that receives the ingress's xDS client certificate, key and CA bundle (tls.crt, tls.key, ca.crt)")
	fs.StringVar(&k.XDSSecrets.ClientName, "xds-client-name", "tendril-ingress", "Kubernetes mode: common name of the ingress's xDS client certificate: the node IDs it may use are this name and this name followed by a dash")
	fs.Func("gardener-gateway", "host:port of Gardener's istio ingress gateway's unified port (its Service, e.g. istio-ingressgateway.istio-ingress.svc.cluster.local:8443): the ingress relays the CONNECTs only Gardener's gateway serves (X-Gardener-Destination vpn-seed-server[-N], <ns>--kube-apiserver-socket) there, request and all (empty: refused with 503)", func(v string) error {
		hp, err := parseHostPort(v)
		cfg.Ingress.GardenerGateway = hp
		return err
	})
	fs.BoolVar(&cfg.Ingress.ProxyProtocol, "proxy-protocol", false, "the unified port (8443) also reads PROXY headers and routes them by destination (an advertised address on 443): GEP-8's first in-cluster path, which Gardener removed in v1.123; for apiserver-proxies in proxy-protocol mode")
	fs.BoolVar(&cfg.Ingress.RemoveHTTPProxyLegacyPort, "remove-http-proxy-legacy-port", false, "serve no legacy tunnel listener (8132, Reversed-VPN), as Gardener's RemoveHTTPProxyLegacyPort gate removes its gateway's; tendril's agents use the unified port 8443")
	fs.BoolVar(&cfg.Ingress.LBProxyProtocol, "lb-proxy-protocol", false, "the seed's load balancer prepends its own PROXY header to every connection: every listener reads it first (tendril-ingress needs --trusted-proxy-cidr)")
	fs.BoolVar(&cfg.Profiling, "profiling", false, "serve the Go profiler under /debug/pprof/ on the metrics address")
	// Kubernetes mode; flag names follow Gardener's extensions (--kubeconfig is registered by
	// controller-runtime and read through ctrl.GetConfig).
	fs.StringVar(&k.HealthAddress, "health-bind-address", ":8081", "Kubernetes mode: address for /healthz and /readyz (0: off)")
	fs.BoolVar(&k.LeaderElection, "leader-election", true, "Kubernetes mode: run the controllers and serve xDS on one replica only (the others keep the routes current to take over)")
	fs.StringVar(&k.LeaderElectionID, "leader-election-id", "tendril-seed-leader-election", "Kubernetes mode: name of the leader election Lease")
	fs.StringVar(&k.LeaderElectionNamespace, "leader-election-namespace", "", "Kubernetes mode: namespace of the leader election Lease (default: the pod's)")
	fs.StringVar(&k.Pod.Name, "pod-name", "", "Kubernetes mode: this replica's Pod in --leader-election-namespace; the leader labels it "+tendrilv1alpha1.XDSLeaderLabel+"=true (and no other Pod) for the xDS Service to select (empty: no label)")
	fs.StringVar(&k.HeartbeatNamespace, "heartbeat-namespace", "", "Kubernetes mode: namespace of the gardener-extension-heartbeat Lease, the extension's own (empty: no heartbeat)")
	fs.Func("heartbeat-renew-interval-seconds", "Kubernetes mode: heartbeat renewal period (default 30)", func(v string) error {
		n, err := strconv.ParseInt(v, 10, 32)
		k.HeartbeatInterval = int32(n)
		return err
	})
	fs.BoolVar(&k.Extension.IgnoreOperationAnnotation, "ignore-operation-annotation", false, "Kubernetes mode: reconcile on every change, not only when gardenlet asks (development)")
	fs.IntVar(&k.Extension.MaxConcurrentReconciles, "max-concurrent-reconciles", 5, "Kubernetes mode: shoots reconciled at once")
	fs.StringVar(&k.Extension.Image, "image", "", "Kubernetes mode: the tendril image the shoots' tendril-server and agents run")
	fs.StringVar(&k.Extension.Ingress, "ingress-address", "", "Kubernetes mode: the seed ingress's host name or IP the shoot agents dial")
	fs.StringVar(&k.Extension.IngressNamespace, "ingress-namespace", "garden", "Kubernetes mode: namespace of the seed ingress pods (tendril-server's Service selects it for Gardener's NetworkPolicies)")
	k.RouteServices = []string{manifest.KubeAPIServerName, manifest.ServerName}
	fs.Func("route-services", fmt.Sprintf("Kubernetes mode: comma-separated Services that Routes may name; only their EndpointSlices are watched (empty: every EndpointSlice of the seed) (default %q)", strings.Join(k.RouteServices, ",")), func(v string) error {
		k.RouteServices = nil
		for n := range strings.SplitSeq(v, ",") {
			if n = strings.TrimSpace(n); n != "" {
				k.RouteServices = append(k.RouteServices, n)
			}
		}
		return nil
	})
	fs.StringVar(&k.SeedDNS.ServiceName, "ingress-service", "tendril-ingress", "Kubernetes mode: the seed ingress's LoadBalancer Service in --ingress-namespace, whose address the DNS records get")
	fs.StringVar(&k.SeedDNS.Name, "dns-record-name", "", "Kubernetes mode: name (FQDN) of the seed-level DNSRecord for the ingress, outside the seed's *.<ingress domain> (empty: no record; one written earlier is deleted)")
	fs.StringVar(&k.SeedDNS.Type, "dns-provider-type", "", "Kubernetes mode: DNS provider type of the seed-level DNSRecord, the seed's spec.dns.provider.type (empty: no record)")
	fs.StringVar(&k.SeedDNS.SecretName, "dns-secret-name", "seed-ingress", "Kubernetes mode: the DNS provider's credentials for the seed-level DNSRecord (gardenlet's copy of the seed's is seed-ingress in garden)")
	fs.StringVar(&k.SeedDNS.SecretNamespace, "dns-secret-namespace", "garden", "Kubernetes mode: namespace of --dns-secret-name")
	fs.StringVar(&k.SeedDNS.Zone, "dns-zone", "", "Kubernetes mode: hosted zone of the seed-level DNSRecord (empty: the provider's longest matching zone)")
	fs.Int64Var(&k.SeedDNS.TTL, "dns-ttl", 120, "Kubernetes mode: TTL in seconds of the seed-level DNSRecord")
	fs.StringVar(&k.Webhook.Namespace, "webhook-namespace", "", "Kubernetes mode: tendril-seed's namespace, where the webhook's CA and certificate live and its Service runs (empty: self-signed, development only)")
	fs.Func("goaway-chance", "Kubernetes mode: the seed's default kube-apiserver --goaway-chance (above 0, at most 0.02) for every shoot balanced per connection whose providerConfig sets none (its kubeAPIServer.goAwayChance \"0\" opts out); empty: none", func(v string) error {
		if v != "" && !tendrilv1alpha1.ValidGoAwayChance(v) {
			return fmt.Errorf("want a decimal above 0 and at most %g", tendrilv1alpha1.MaxGoAwayChance)
		}
		k.Webhook.GoAwayChance = v
		return nil
	})
	fs.IntVar(&k.WebhookPort, "webhook-port", 10250, "Kubernetes mode: port of the control-plane webhook server (-1: off)")
	fs.StringVar(&k.WebhookCertDir, "webhook-cert-dir", "", "Kubernetes mode: directory for the webhook server's certificate (default: a temp dir)")
	fs.IntVar(&verbosity, "v", 0, "log verbosity")
	version := fs.Bool("version", false, "print the version and exit")
	_ = fs.Parse(os.Args[1:]) // ExitOnError
	probe.SampleHeap(cfg.Profiling)
	if *version {
		fmt.Println(buildinfo.String("tendril-seed"))
		return
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "tendril-seed: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	cfg.Log = logging.New(os.Stderr, verbosity).WithName("tendril-seed")
	// Sockets a parent bound and handed over (tests, tendril-bench, tendril-local); not for
	// the processes this one starts.
	inherited, err := inherit.Parse(os.Getenv(inherit.EnvVar))
	os.Unsetenv(inherit.EnvVar)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tendril-seed:", err)
		os.Exit(2)
	}
	cfg.Listeners = inherited
	if cfg.Routes == "" {
		rc, err := ctrl.GetConfig()
		if err != nil {
			fmt.Fprintf(os.Stderr, "tendril-seed: no route file (--routes) and no Kubernetes configuration: %v\n", err)
			os.Exit(2)
		}
		k.REST, k.XDSAddress, k.Listeners, k.Log = rc, cfg.XDSAddress, cfg.Ingress, cfg.Log
		k.XDSInsecure = cfg.XDSInsecure
		k.MetricsAddress = cfg.MetricsAddress // /metrics only: health is on --health-bind-address
		if k.MetricsAddress == "" {
			k.MetricsAddress = "0"
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := Run(ctx, cfg); err != nil {
		cfg.Log.Error(err, "Exiting")
		os.Exit(1)
	}
}

// Run serves the routes until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	files, err := xdsFiles(cfg)
	if err != nil {
		return err
	}
	if cfg.Routes == "" {
		if files != nil {
			cfg.Kubernetes.XDSCerts = files
		}
		return controlplane.Run(ctx, cfg.Kubernetes)
	}
	if files == nil && !cfg.XDSInsecure {
		return errors.New("xDS runs over mutual TLS: give --xds-cert-file, --xds-key-file and --xds-ca-file (or --xds-insecure for local use)")
	}
	reg := probe.NewRegistry()
	scfg := server.Config{Log: cfg.Log.WithName("xds"), Registry: reg, Options: cfg.Ingress}
	if files != nil {
		scfg.TLS, scfg.Authorize = tlsreload.ServerConfig(files), server.NodeOfCertificate
	} else {
		cfg.Log.Info("Serving xDS in plaintext, unauthenticated (--xds-insecure)")
	}
	xs := server.New(scfg)
	var ready probe.Ready

	xl, err := cfg.Listeners.Listen("tcp", cfg.XDSAddress)
	if err != nil {
		return fmt.Errorf("xDS listener: %w", err)
	}
	var ml net.Listener
	if cfg.MetricsAddress != "" {
		if ml, err = cfg.Listeners.Listen("tcp", cfg.MetricsAddress); err != nil {
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

// xdsFiles is the xDS server's certificate files, nil when none is given. They are read once
// here, so that a wrong path fails at start.
func xdsFiles(cfg Config) (*tlsreload.Files, error) {
	f := &tlsreload.Files{Cert: cfg.XDSCertFile, Key: cfg.XDSKeyFile, CA: cfg.XDSCAFile, Log: cfg.Log.WithName("xds-tls")}
	switch {
	case f.Cert == "" && f.Key == "" && f.CA == "":
		return nil, nil
	case cfg.XDSInsecure:
		return nil, errors.New("--xds-insecure and --xds-cert-file/--xds-key-file/--xds-ca-file exclude each other")
	case f.Cert == "" || f.Key == "" || f.CA == "":
		return nil, errors.New("--xds-cert-file, --xds-key-file and --xds-ca-file go together")
	}
	if _, err := f.Material(); err != nil {
		return nil, fmt.Errorf("xDS server certificate: %w", err)
	}
	return f, nil
}

// parseHostPort reads host:port with a non-zero port; empty is unset.
func parseHostPort(v string) (translate.HostPort, error) {
	if v == "" {
		return translate.HostPort{}, nil
	}
	host, port, err := net.SplitHostPort(v)
	if err != nil {
		return translate.HostPort{}, err
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 || host == "" {
		return translate.HostPort{}, fmt.Errorf("%q: want host:port with a port of 1 to 65535", v)
	}
	return translate.HostPort{Host: host, Port: uint16(p)}, nil
}
