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
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/gardener/gardener/extensions/pkg/controller/heartbeat"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/ingressdns"
	"github.com/tendril-net/tendril/internal/kube/kubescheme"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
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
	// xDS is served over mutual TLS with node IDs bound to the client certificate
	// (server.NodeOfCertificate): with XDSCerts when set (e.g. tlsreload.Files), else with
	// certificates the leader generates (XDSSecrets). XDSInsecure serves plaintext instead, for
	// local use.
	XDSCerts    tlsreload.Source
	XDSSecrets  XDSSecrets
	XDSInsecure bool
	// MetricsAddress serves /metrics ("0" disables; ":8080" when empty).
	MetricsAddress string
	// HealthAddress serves /healthz and /readyz ("0" disables; ":8081" when empty).
	HealthAddress string
	// LeaderElection makes only one replica run the controllers and serve xDS
	// (docs/design-notes/programmed.md); the others keep their route set current to take over.
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
	// Listeners are the seed-wide choices of the ingress's listeners (translate.Options): the
	// load balancer's PROXY header, Gardener's VPN relay, the legacy port.
	Listeners translate.Options
	// Pod, when its Name is set, is this replica's Pod. The leader, once it serves xDS, labels
	// it tendrilv1alpha1.XDSLeaderLabel=true and takes the label off every other Pod of its namespace, so that
	// the xDS Service, which selects the label, leads to the leader only. Its Namespace defaults
	// to LeaderElectionNamespace.
	Pod types.NamespacedName
	// RouteServices are the Services Routes may name; only their EndpointSlices are cached
	// (kubesource.Config.Services). Empty: every EndpointSlice of the seed.
	RouteServices []string
	// Registry receives the metrics; nil means controller-runtime's, which the manager serves.
	Registry prometheus.Registerer
	// SkipControllerNameValidation lets several control planes run in one process (tests):
	// controller-runtime refuses a controller name used before in the process.
	SkipControllerNameValidation bool
	// Log is the logger; the zero value discards.
	Log logr.Logger
	// Clock is for the heartbeat; nil means the real clock.
	Clock clock.Clock
}

// cacheOptions narrows the manager's cache to what the extension and the route source read.
func cacheOptions(routeServices []string, seedDNS ingressdns.SeedRecord, ingress types.NamespacedName) (cache.Options, error) {
	opts := extension.CacheOptions()
	if len(routeServices) > 0 && ingress.Name != "" {
		// The ingress Service's EndpointSlices name the ingress replicas (kubesource.Config.Ingress).
		routeServices = append(slices.Clone(routeServices), ingress.Name)
	}
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
	cfg, err := cfg.withDefaults()
	if err != nil {
		return err
	}
	// The ingress replicas that must acknowledge a route: the Pods behind the ingress Service.
	var ingress types.NamespacedName
	if cfg.SeedDNS.ServiceNamespace != "" {
		ingress = types.NamespacedName{Namespace: cfg.SeedDNS.ServiceNamespace, Name: cmp.Or(cfg.SeedDNS.ServiceName, ingressdns.ServiceName)}
	}
	ctrl.SetLogger(cfg.Log)
	cacheOpts, err := cacheOptions(cfg.RouteServices, cfg.SeedDNS, ingress)
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
		Controller:                    config.Controller{SkipNameValidation: ptr.To(cfg.SkipControllerNameValidation)},
	})
	if err != nil {
		return fmt.Errorf("manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	scfg, certs, err := xdsServerConfig(cfg, mgr.GetClient())
	if err != nil {
		return err
	}
	xs := server.New(scfg)
	if err := mgr.Add(xdsRunnable{
		xs: xs, address: cfg.XDSAddress, listener: cfg.XDSListener, log: cfg.Log.WithName("xds"),
		client: mgr.GetClient(), reader: mgr.GetAPIReader(), pod: cfg.Pod, certs: certs,
	}); err != nil {
		return err
	}
	// The route source runs on every replica, so that a new leader serves the current route
	// set at once; only the leader serves it and writes the Routes' status.
	if err := kubesource.Add(mgr, kubesource.Config{
		Server: xs, Log: cfg.Log.WithName("routes"), Registry: cfg.Registry,
		Services: cfg.RouteServices, Ingress: ingress,
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
		if err := addWebhooks(ctx, mgr, cfg); err != nil {
			return err
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

// withDefaults fills in what cfg leaves empty.
func (cfg Config) withDefaults() (Config, error) {
	cfg.XDSAddress = cmp.Or(cfg.XDSAddress, ":18000")
	cfg.MetricsAddress = cmp.Or(cfg.MetricsAddress, ":8080")
	cfg.HealthAddress = cmp.Or(cfg.HealthAddress, ":8081")
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, 30)
	cfg.LeaderElectionID = cmp.Or(cfg.LeaderElectionID, "tendril-seed-leader-election")
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.SeedDNS.ServiceNamespace = cmp.Or(cfg.SeedDNS.ServiceNamespace, cfg.Extension.IngressNamespace)
	if cfg.SeedDNS.Log.GetSink() == nil {
		cfg.SeedDNS.Log = cfg.Log.WithName("seed-dns")
	}
	if cfg.Registry == nil {
		cfg.Registry = crmetrics.Registry
	}
	if cfg.Pod.Name != "" {
		if cfg.Pod.Namespace = cmp.Or(cfg.Pod.Namespace, cfg.LeaderElectionNamespace); cfg.Pod.Namespace == "" {
			return cfg, fmt.Errorf("pod %s: no namespace", cfg.Pod.Name)
		}
	}
	return cfg, nil
}

// xdsServerConfig is the xDS server's configuration: plaintext (--xds-insecure), cfg.XDSCerts,
// or certificates of the secrets manager's (certs, which the xDS runnable keeps current).
func xdsServerConfig(cfg Config, c client.Client) (server.Config, *xdsCerts, error) {
	scfg := server.Config{
		Log:      cfg.Log.WithName("xds"),
		Registry: cfg.Registry,
		Options:  cfg.Listeners,
	}
	var certs *xdsCerts
	switch {
	case cfg.XDSInsecure:
		cfg.Log.Info("Serving xDS in plaintext, unauthenticated (--xds-insecure)")
	case cfg.XDSCerts != nil:
		scfg.TLS, scfg.Authorize = tlsreload.ServerConfig(cfg.XDSCerts), server.NodeOfCertificate
	default:
		sec := cfg.XDSSecrets.withDefaults(cmp.Or(cfg.Pod.Namespace, cfg.LeaderElectionNamespace), cfg.Extension.IngressNamespace)
		if sec.Namespace == "" {
			return scfg, nil, errors.New("xDS certificates: no namespace for the secrets manager (--leader-election-namespace)")
		}
		certs = &xdsCerts{cfg: sec, client: c, clock: cfg.Clock, log: cfg.Log.WithName("xds-secrets")}
		scfg.TLS, scfg.Authorize = tlsreload.ServerConfig(&certs.store), server.NodeOfCertificate
	}
	return scfg, certs, nil
}

// addWebhooks adds the egress webhook, with the DNSRecord webhook when the ingress Service's
// namespace is known.
func addWebhooks(ctx context.Context, mgr manager.Manager, cfg Config) error {
	if cfg.Webhook.Image == "" {
		cfg.Webhook.Image = cfg.Extension.Image // the egress relay sidecar ships in the tendril image
	}
	if cfg.SeedDNS.ServiceNamespace != "" {
		metrics, err := ingressdns.NewMetrics(cfg.Registry)
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
	return nil
}

// xdsRunnable serves xDS on the leader only: the Routes' Programmed condition is what the
// ingress replicas connected to the leader acknowledged, so every replica must be connected
// there (docs/design-notes/programmed.md). A replica that is not leading does not listen: a
// data plane that reaches it is refused at once and tries again, keeping what it serves.
type xdsRunnable struct {
	xs       *server.Server
	address  string
	listener net.Listener
	log      logr.Logger
	// client writes and reader reads the Pods: pod is labelled tendrilv1alpha1.XDSLeaderLabel, the others of
	// its namespace not (nothing when its Name is empty).
	client client.Client
	reader client.Reader
	pod    types.NamespacedName
	// certs, when set, generates the xDS certificates: before the listener opens, then renewed.
	certs *xdsCerts
}

func (r xdsRunnable) NeedLeaderElection() bool { return true }

func (r xdsRunnable) Start(ctx context.Context) error {
	// The renewal and label goroutines end with Start, also when serving fails.
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	if r.certs != nil {
		if err := r.certs.syncRetrying(ctx); err != nil {
			return nil // ctx ended
		}
		wg.Go(func() { r.certs.renew(ctx) })
	}
	l := r.listener
	if l == nil {
		var err error
		if l, err = net.Listen("tcp", r.address); err != nil {
			return fmt.Errorf("xDS listener: %w", err)
		}
	}
	r.log.Info("Leading: serving xDS", "address", l.Addr().String(), "tls", r.xs.TLS())
	if r.pod.Name != "" {
		// Labelled only once this replica listens, so the Service never leads to a leader
		// that refuses.
		wg.Go(func() { r.label(ctx) })
	}
	return r.xs.Serve(ctx, l)
}

// labelRetry is the wait before a failed label write is tried again.
const labelRetry = time.Second

// label makes this replica's Pod the only one labelled tendrilv1alpha1.XDSLeaderLabel, trying until it succeeds
// or ctx ends: a leader no data plane can reach programs nothing. A Pod keeps its labels across
// container restarts, so an earlier leader's Pod can still carry it.
func (r xdsRunnable) label(ctx context.Context) {
	for {
		err := r.labelOnce(ctx)
		if err == nil {
			r.log.Info("The xDS Service leads here", "pod", r.pod)
			return
		}
		if ctx.Err() != nil {
			return
		}
		r.log.Error(err, "Labelling this replica's Pod as the xDS leader, retrying", "pod", r.pod)
		select {
		case <-ctx.Done():
			return
		case <-time.After(labelRetry):
		}
	}
}

func (r xdsRunnable) labelOnce(ctx context.Context) error {
	set := []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:"true"}}}`, tendrilv1alpha1.XDSLeaderLabel))
	// This Pod first, then the others: the Service never selects no Pod meanwhile.
	self := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: r.pod.Namespace, Name: r.pod.Name}}
	if err := r.client.Patch(ctx, self, client.RawPatch(types.MergePatchType, set)); err != nil {
		return fmt.Errorf("label pod %s: %w", r.pod, err)
	}
	var pods corev1.PodList
	// From the API server: the manager's cache holds no Pods of this namespace.
	if err := r.reader.List(ctx, &pods, client.InNamespace(r.pod.Namespace), client.HasLabels{tendrilv1alpha1.XDSLeaderLabel}); err != nil {
		return fmt.Errorf("list pods labelled %s: %w", tendrilv1alpha1.XDSLeaderLabel, err)
	}
	unset := []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, tendrilv1alpha1.XDSLeaderLabel))
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.Name == r.pod.Name {
			continue
		}
		if err := r.client.Patch(ctx, p, client.RawPatch(types.MergePatchType, unset)); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("unlabel pod %s: %w", p.Name, err)
		}
		r.log.Info("Took the xDS leader label off an earlier leader's Pod", "pod", p.Name)
	}
	return nil
}
