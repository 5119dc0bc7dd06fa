// Package controlplane runs tendril's seed control plane on Kubernetes in one
// controller-runtime manager: the Extension controller (provisioning per shoot), the
// control-plane webhook pointing kube-apiserver's egress at tendril-server, the seed-level
// DNSRecord of the shared ingress and the webhook pointing tendril shoots' api.* DNSRecords at
// it, the health checks
// and heartbeat Gardener expects of every extension, and the xDS server the shared ingress
// connects to, fed by the Kubernetes route source (Routes and EndpointSlices). It wires
// components together and holds no logic of its own; cmd/tendril-seed fills its Config from
// flags. The route-file mode without Kubernetes is not here.
package controlplane

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"

	"github.com/gardener/gardener/extensions/pkg/controller/heartbeat"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/ingressdns"
	"github.com/tendril-net/tendril/internal/kubescheme"
	"github.com/tendril-net/tendril/xds/kubesource"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

// Config configures the control plane. Zero values are the defaults noted per field.
type Config struct {
	// REST is the seed's API server.
	REST *rest.Config
	// XDSAddress is where the ADS server listens (":18000" when empty).
	XDSAddress string
	// XDSListener, when set, is used instead of listening on XDSAddress (Run closes it).
	XDSListener net.Listener
	// MetricsAddress serves /metrics ("0" disables; ":8080" when empty).
	MetricsAddress string
	// HealthAddress serves /healthz and /readyz ("0" disables; ":8081" when empty).
	HealthAddress string
	// LeaderElection makes only one replica run the controllers; every replica serves xDS.
	LeaderElection bool
	// LeaderElectionID and LeaderElectionNamespace name the election's Lease.
	LeaderElectionID        string
	LeaderElectionNamespace string
	// HeartbeatNamespace is where the gardener-extension-heartbeat Lease is renewed (the
	// extension's own namespace); empty disables the heartbeat.
	HeartbeatNamespace string
	// HeartbeatInterval is the renewal period in seconds (30 when 0).
	HeartbeatInterval int32
	// Extension configures the Extension controller.
	Extension extension.AddOptions
	// Health configures the health checks (Gardener's defaults when zero).
	Health extension.HealthOptions
	// Webhook configures the control-plane webhook that points kube-apiserver's egress at
	// tendril-server. WebhookPort 0 is 10250; a negative port disables the webhook.
	Webhook     egresswebhook.Options
	WebhookPort int
	// WebhookCertDir is where the webhook server reads its certificate (a temp default).
	WebhookCertDir string
	// SeedDNS is the seed-level DNSRecord of the shared ingress (disabled when its Name or
	// Type is empty: a record written earlier is deleted). Its ServiceNamespace defaults to
	// Extension.IngressNamespace; the DNSRecord webhook reads the same Service.
	SeedDNS ingressdns.SeedRecord
	// LBProxyProtocol: the seed's load balancer prepends a PROXY header to every connection.
	LBProxyProtocol bool
	// RouteServices are the Services Routes may name; only their EndpointSlices are cached
	// (kubesource.Config.Services). Empty: every EndpointSlice of the seed.
	RouteServices []string
	// Log is the logger; the zero value discards.
	Log logr.Logger
	// Clock is for the heartbeat; nil means the real clock.
	Clock clock.Clock
}

// cacheOptions narrows the manager's cache to what the extension and the route source read.
func cacheOptions(routeServices []string, seedDNS ingressdns.SeedRecord) (cache.Options, error) {
	opts := extension.CacheOptions()
	endpointSlices, err := kubesource.CacheByObject(routeServices)
	if err != nil {
		return cache.Options{}, fmt.Errorf("route services: %w", err)
	}
	maps.Copy(opts.ByObject, endpointSlices)
	maps.Copy(opts.ByObject, ingressdns.CacheByObject(seedDNS))
	return opts, nil
}

// Run runs the control plane until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.REST == nil {
		return errors.New("no Kubernetes configuration")
	}
	if cfg.XDSAddress == "" {
		cfg.XDSAddress = ":18000"
	}
	if cfg.MetricsAddress == "" {
		cfg.MetricsAddress = ":8080"
	}
	if cfg.HealthAddress == "" {
		cfg.HealthAddress = ":8081"
	}
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = 30
	}
	if cfg.LeaderElectionID == "" {
		cfg.LeaderElectionID = "tendril-seed-leader-election"
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.SeedDNS.ServiceNamespace == "" {
		cfg.SeedDNS.ServiceNamespace = cfg.Extension.IngressNamespace
	}
	if cfg.SeedDNS.Log.GetSink() == nil {
		cfg.SeedDNS.Log = cfg.Log.WithName("seed-dns")
	}
	ctrl.SetLogger(cfg.Log)
	cacheOpts, err := cacheOptions(cfg.RouteServices, cfg.SeedDNS)
	if err != nil {
		return err
	}
	mgr, err := manager.New(cfg.REST, manager.Options{
		Scheme:                  kubescheme.New(),
		Logger:                  cfg.Log,
		Cache:                   cacheOpts,
		Client:                  client.Options{Cache: &client.CacheOptions{DisableFor: extension.Uncached()}},
		Metrics:                 metricsserver.Options{BindAddress: cfg.MetricsAddress},
		HealthProbeBindAddress:  cfg.HealthAddress,
		LeaderElection:          cfg.LeaderElection,
		LeaderElectionID:        cfg.LeaderElectionID,
		LeaderElectionNamespace: cfg.LeaderElectionNamespace,
		WebhookServer:           webhook.NewServer(egresswebhook.ServerOptions(max(cfg.WebhookPort, 0), cfg.WebhookCertDir)),
		// Release the lease on shutdown so a rolling update hands over without waiting
		// for the lease to expire.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return fmt.Errorf("manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	xs := server.New(server.Config{
		Log:      cfg.Log.WithName("xds"),
		Registry: crmetrics.Registry.(prometheus.Registerer),
		Options:  translate.Options{LBProxyProtocol: cfg.LBProxyProtocol},
	})
	if err := mgr.Add(xdsRunnable{xs: xs, address: cfg.XDSAddress, listener: cfg.XDSListener, log: cfg.Log}); err != nil {
		return err
	}
	// The route source runs on every replica (each serves its own ingress connections);
	// only the leader writes the Routes' status.
	if err := kubesource.Add(mgr, kubesource.Config{
		Server: xs, Log: cfg.Log.WithName("routes"), Registry: crmetrics.Registry.(prometheus.Registerer),
		Services: cfg.RouteServices,
	}); err != nil {
		return fmt.Errorf("route source: %w", err)
	}
	if err := extension.Add(ctx, mgr, cfg.Extension); err != nil {
		return fmt.Errorf("extension controller: %w", err)
	}
	if err := ingressdns.AddSeedRecord(mgr, cfg.SeedDNS); err != nil {
		return fmt.Errorf("seed DNS record controller: %w", err)
	}
	if cfg.WebhookPort >= 0 {
		if cfg.Webhook.Image == "" {
			cfg.Webhook.Image = cfg.Extension.Image // the egress relay sidecar ships in the tendril image
		}
		if cfg.SeedDNS.ServiceNamespace != "" {
			metrics, err := ingressdns.NewMetrics(crmetrics.Registry)
			if err != nil {
				return fmt.Errorf("dnsrecord webhook metrics: %w", err)
			}
			wh, err := ingressdns.NewWebhook(mgr, ingressdns.WebhookOptions{
				ServiceNamespace: cfg.SeedDNS.ServiceNamespace, ServiceName: cfg.SeedDNS.ServiceName, Metrics: metrics,
			})
			if err != nil {
				return err
			}
			cfg.Webhook.Webhooks = append(cfg.Webhook.Webhooks, wh)
		}
		if err := egresswebhook.AddToManager(ctx, mgr, cfg.Webhook); err != nil {
			return fmt.Errorf("egress webhook: %w", err)
		}
	}
	if err := extension.AddHealthCheck(mgr, cfg.Health); err != nil {
		return fmt.Errorf("health check controller: %w", err)
	}
	if cfg.HeartbeatNamespace != "" {
		if err := heartbeat.Add(mgr, heartbeat.AddArgs{
			ExtensionName:        extension.Type,
			Namespace:            cfg.HeartbeatNamespace,
			RenewIntervalSeconds: cfg.HeartbeatInterval,
			Clock:                cfg.Clock,
		}); err != nil {
			return fmt.Errorf("heartbeat controller: %w", err)
		}
	}
	return mgr.Start(ctx)
}

// xdsRunnable serves xDS on every replica, leader or not: each ingress replica may connect
// to any control-plane replica.
type xdsRunnable struct {
	xs       *server.Server
	address  string
	listener net.Listener
	log      logr.Logger
}

func (r xdsRunnable) NeedLeaderElection() bool { return false }

func (r xdsRunnable) Start(ctx context.Context) error {
	l := r.listener
	if l == nil {
		var err error
		if l, err = net.Listen("tcp", r.address); err != nil {
			return fmt.Errorf("xDS listener: %w", err)
		}
	}
	r.log.Info("Serving xDS", "address", l.Addr().String())
	return r.xs.Serve(ctx, l)
}
