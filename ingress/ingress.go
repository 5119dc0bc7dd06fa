// Package ingress is tendril-ingress, the embedded data plane: it subscribes to tendril's xDS
// resources over delta ADS, keeps them as one immutable configuration swapped atomically on every
// change, and serves the listeners they describe — today the SNI passthrough listener, which
// routes a TLS connection by its ClientHello's server name without terminating TLS. It serves
// exactly the subset of Envoy's API that tendril generates and NACKs anything else. It knows
// nothing of Kubernetes or Gardener.
package ingress

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/ingress/xdsclient"
)

// Config configures an Ingress. The zero value serves nothing until listeners are given.
type Config struct {
	// Listeners maps a listener name from xDS ("sni") to the address it is served on. A listener
	// the server sends without an address here is accepted and not served.
	Listeners map[string]string
	// Log receives the ingress's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// TrustedProxies are the load balancers whose own PROXY header (a listener's required
	// proxy_protocol filter) is believed; from anyone else it is not read, and a second header
	// behind an inner one is refused. A listener with such a filter is refused (NACK) while this
	// is empty.
	TrustedProxies []netip.Prefix
	// MaxPending bounds connections still in their handshake (PROXY header, ClientHello,
	// CONNECT request) across all listeners, so a flood of slow clients costs a bounded amount
	// of memory. At the limit a new connection evicts the oldest pending one of the fullest
	// listener (counted as "pending_evicted"). If zero, DefaultMaxPending (10,000 × 16 KiB
	// worst-case buffers = 160 MiB).
	MaxPending int
	// MaxPendingPerListener bounds one listener's pending connections; at the limit a new
	// connection evicts the listener's oldest pending one. If zero, DefaultMaxPendingPerListener.
	MaxPendingPerListener int
	// MaxPendingPerSource bounds the pending connections of one source address (an IPv6 /64)
	// across all listeners; beyond it its new connections are refused (counted as
	// "pending_source_limit"). Trusted proxies are exempt. If zero, DefaultMaxPendingPerSource.
	MaxPendingPerSource int
}

// Ingress serves the listeners of the configuration it is given.
type Ingress struct {
	cfg     Config
	log     logr.Logger
	metrics *metrics
	current atomic.Pointer[config]
	ready   atomic.Bool
	// active counts connections per cluster across configurations, for the circuit breaker.
	activeMu sync.Mutex
	active   map[string]*atomic.Int64
	pending  *pendingSet
	refusals *rateLimitedLog
}

// New returns an Ingress with an empty configuration.
func New(cfg Config) *Ingress {
	if cfg.MaxPending == 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.MaxPendingPerListener == 0 {
		cfg.MaxPendingPerListener = DefaultMaxPendingPerListener
	}
	if cfg.MaxPendingPerSource == 0 {
		cfg.MaxPendingPerSource = DefaultMaxPendingPerSource
	}
	in := &Ingress{
		cfg:      cfg,
		log:      cfg.Log,
		metrics:  newMetrics(cfg.Registry),
		active:   make(map[string]*atomic.Int64),
		refusals: newRateLimitedLog(cfg.Log, 10, time.Second),
	}
	in.pending = newPendingSet(cfg.MaxPending, cfg.MaxPendingPerListener, cfg.MaxPendingPerSource, in.trusted)
	in.current.Store(&config{
		listeners: map[string]*listenerConfig{},
		clusters:  map[string]*clusterConfig{},
		endpoints: map[string][]netip.AddrPort{},
	})
	return in
}

// Types are the resource types the ingress subscribes to: clusters before endpoints before
// listeners, so a listener never points at a cluster that is about to arrive.
var Types = []string{resourcev3.ClusterType, resourcev3.EndpointType, resourcev3.ListenerType}

// Ready reports whether a first configuration with listeners has been applied.
func (in *Ingress) Ready() bool { return in.ready.Load() }

// Apply applies one xDS response: it builds the new configuration for its type and swaps it in,
// or returns an error and keeps the current one. It is an xdsclient.Handler.
func (in *Ingress) Apply(u xdsclient.Update) error {
	err := in.apply(u.TypeURL, u.Resources, u.Removed)
	if err != nil {
		in.metrics.xdsUpdates.WithLabelValues(u.TypeURL, "nack").Inc()
		return err
	}
	in.metrics.xdsUpdates.WithLabelValues(u.TypeURL, "ack").Inc()
	in.metrics.xdsVersion.DeletePartialMatch(prometheus.Labels{"type": u.TypeURL})
	in.metrics.xdsVersion.WithLabelValues(u.TypeURL, u.Version).Set(1)
	return nil
}

func (in *Ingress) apply(typeURL string, resources []*discoveryv3.Resource, removed []string) error {
	old := in.current.Load()
	next := *old
	switch typeURL {
	case resourcev3.ListenerType:
		m := maps.Clone(old.listeners)
		for _, n := range removed {
			delete(m, n)
		}
		for _, r := range resources {
			if _, served := in.cfg.Listeners[r.GetName()]; !served {
				// Not served here (no address given): accepted as is, so a replica that serves
				// a subset of the listeners never NACKs the others.
				delete(m, r.GetName())
				continue
			}
			l, err := unpack(r.GetResource(), &listenerv3.Listener{})
			if err != nil {
				return fmt.Errorf("listener %s: %w", r.GetName(), err)
			}
			lc, err := parseListener(l)
			if err != nil {
				return fmt.Errorf("listener %s: %w", r.GetName(), err)
			}
			if lc.lbProxyProtocol && len(in.cfg.TrustedProxies) == 0 {
				return fmt.Errorf("listener %s reads the load balancer's PROXY header, but no trusted proxy CIDR is configured (--trusted-proxy-cidr)", r.GetName())
			}
			m[lc.name] = lc
		}
		next.listeners = m
	case resourcev3.ClusterType:
		m := maps.Clone(old.clusters)
		for _, n := range removed {
			delete(m, n)
		}
		for _, r := range resources {
			c, err := unpack(r.GetResource(), &clusterv3.Cluster{})
			if err != nil {
				return fmt.Errorf("cluster %s: %w", r.GetName(), err)
			}
			cc, err := parseCluster(c)
			if err != nil {
				return err
			}
			m[cc.name] = cc
		}
		next.clusters = m
	case resourcev3.EndpointType:
		m := maps.Clone(old.endpoints)
		for _, n := range removed {
			delete(m, n)
		}
		for _, r := range resources {
			la, err := unpack(r.GetResource(), &endpointv3.ClusterLoadAssignment{})
			if err != nil {
				return fmt.Errorf("assignment %s: %w", r.GetName(), err)
			}
			eps, err := parseAssignment(la)
			if err != nil {
				return fmt.Errorf("assignment %s: %w", r.GetName(), err)
			}
			m[la.GetClusterName()] = eps
		}
		next.endpoints = m
	default:
		return fmt.Errorf("type %s is not supported", typeURL)
	}
	in.current.Store(&next)
	in.metrics.xdsResources.WithLabelValues(resourcev3.ListenerType).Set(float64(len(next.listeners)))
	in.metrics.xdsResources.WithLabelValues(resourcev3.ClusterType).Set(float64(len(next.clusters)))
	in.metrics.xdsResources.WithLabelValues(resourcev3.EndpointType).Set(float64(len(next.endpoints)))
	if typeURL == resourcev3.ListenerType && len(next.listeners) > 0 {
		in.ready.Store(true)
	}
	return nil
}

// Run subscribes to the xDS server at xdsAddress as nodeID and serves the configured listeners
// until ctx ends. Listener addresses are bound before anything else, so a taken port fails at once.
func (in *Ingress) Run(ctx context.Context, xds xdsclient.Config) error {
	lns := make(map[string]net.Listener, len(in.cfg.Listeners))
	for name, addr := range in.cfg.Listeners {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			for _, o := range lns {
				o.Close()
			}
			return fmt.Errorf("listener %s on %s: %w", name, addr, err)
		}
		lns[name] = l
		in.log.Info("Listening", "listener", name, "address", l.Addr().String())
	}
	return in.Serve(ctx, lns, xds)
}

// Serve is Run with the listeners already bound (tests bind 127.0.0.1:0).
func (in *Ingress) Serve(ctx context.Context, lns map[string]net.Listener, xds xdsclient.Config) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, len(lns)+1)
	if xds.Types == nil {
		xds.Types = Types
	}
	if xds.Log.GetSink() == nil {
		xds.Log = in.log.WithName("xds")
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		errc <- xdsclient.Run(ctx, xds, in.Apply)
	}()
	for name, l := range lns {
		s := &server{in: in, name: name, l: l}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errc <- s.serve(ctx)
		}()
	}
	var first error
	select {
	case <-ctx.Done():
	case first = <-errc:
		cancel()
	}
	wg.Wait()
	if first != nil && !errors.Is(first, context.Canceled) {
		return first
	}
	return nil
}

// trusted reports whether a is one of the trusted load balancers.
func (in *Ingress) trusted(a netip.Addr) bool {
	for _, p := range in.cfg.TrustedProxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// acquire takes a connection slot of cluster, or reports that its circuit breaker is open.
func (in *Ingress) acquire(cluster string, limit int64) (release func(), ok bool) {
	in.activeMu.Lock()
	n, found := in.active[cluster]
	if !found {
		n = new(atomic.Int64)
		in.active[cluster] = n
	}
	in.activeMu.Unlock()
	if n.Add(1) > limit {
		n.Add(-1)
		return nil, false
	}
	return func() { n.Add(-1) }, true
}
