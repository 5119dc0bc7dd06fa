// Package ingress is tendril-ingress, the embedded data plane: it subscribes to tendril's xDS
// resources over delta ADS, keeps them as one immutable configuration swapped atomically on every
// change, and serves the listeners they describe — today the SNI passthrough listener, which
// routes a TLS connection by its ClientHello's server name without terminating TLS, the PROXY
// listener and HTTP CONNECT. It serves exactly the subset of Envoy's API that tendril generates
// and NACKs anything else. It knows nothing of Kubernetes or Gardener.
//
// Connections run on edge/loops's event loops from accept to close: the loops read the
// listener filters' bytes, a shake (one per connection, called on the loop) parses them and
// picks the route, the loops dial and relay. Only a CONNECT request is read in a goroutine.
package ingress

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/edge/loops"
	"github.com/tendril-net/tendril/ingress/xdsclient"
)

// Config configures an Ingress. The zero value serves nothing until listeners are given.
type Config struct {
	// Listeners maps a listener name from xDS ("sni") to the address it is served on. A listener
	// the server sends without an address here is accepted and not served.
	Listeners map[string]string
	// Listen binds a listener's address (net.Listen when nil); tendril-ingress passes one that
	// returns the sockets it inherited.
	Listen func(network, address string) (net.Listener, error)
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
	// DrainDelay is how long the ingress goes on accepting, while its readiness already fails,
	// once Serve's context ends: the time a load balancer needs to notice and stop sending new
	// connections (Envoy's and Contour's shutdown managers wait the same way before draining).
	// Connections accepted meanwhile are proxied and drained like the others. If zero, the
	// listeners close at once.
	DrainDelay time.Duration
	// TerminateNetHTTP2 serves terminating shoots' HTTP/2 clients with net/http's server
	// instead of h2relay, frame by frame (the default).
	TerminateNetHTTP2 bool
	// DrainTimeout is how long established connections may go on after the listeners close;
	// then the rest are closed (counted by listener) and Serve returns. Serve returns as soon as
	// the last one ends by itself. If zero, they are closed at once.
	DrainTimeout time.Duration
	// Loops is the number of relay event loops (loops.LoopsConfig). If zero, GOMAXPROCS when
	// Serve starts; a binary that changes GOMAXPROCS while it runs sets its maximum here.
	Loops int
}

// Ingress serves the listeners of the configuration it is given.
type Ingress struct {
	cfg     Config
	log     logr.Logger
	metrics *metrics
	current atomic.Pointer[config]
	ready   atomic.Bool
	// draining is set once Serve's context has ended: readiness fails from then on.
	draining atomic.Bool
	// active counts connections per cluster across configurations, for the circuit breaker.
	activeMu sync.Mutex
	active   map[string]*atomic.Int64
	pending  *pendingSet
	// refusals logs refused connections, at most 10 lines a second (all are counted).
	refusals *accept.LimitedLog
	// servers are Serve's listeners' servers, for Open.
	servers atomic.Pointer[[]*server]
	// terms serve the terminating shoots' internal listeners.
	terms *terminators
}

// New returns an Ingress with an empty configuration.
func New(cfg Config) *Ingress {
	cfg.MaxPending = cmp.Or(cfg.MaxPending, DefaultMaxPending)
	cfg.MaxPendingPerListener = cmp.Or(cfg.MaxPendingPerListener, DefaultMaxPendingPerListener)
	cfg.MaxPendingPerSource = cmp.Or(cfg.MaxPendingPerSource, DefaultMaxPendingPerSource)
	in := &Ingress{
		cfg:      cfg,
		log:      cfg.Log,
		metrics:  newMetrics(cfg.Registry),
		active:   make(map[string]*atomic.Int64),
		refusals: &accept.LimitedLog{Log: cfg.Log},
		terms:    newTerminators(cfg.Log.WithName("terminate"), cfg.TerminateNetHTTP2),
	}
	if cfg.Registry != nil {
		cfg.Registry.MustRegister(newTerminateCollector(in.terms))
	}
	in.pending = newPendingSet(cfg.MaxPending, cfg.MaxPendingPerListener, cfg.MaxPendingPerSource, in.trusted)
	in.current.Store(&config{
		listeners:  map[string]*listenerConfig{},
		clusters:   map[string]*clusterConfig{},
		endpoints:  map[string][]netip.AddrPort{},
		terminates: map[string]*terminateConfig{},
		secrets:    map[string]*secretConfig{},
	})
	return in
}

// Types are the resource types the ingress subscribes to: secrets before clusters before
// endpoints before listeners, so a listener never points at a cluster or secret that is about
// to arrive.
var Types = []string{resourcev3.SecretType, resourcev3.ClusterType, resourcev3.EndpointType, resourcev3.ListenerType}

// Ready reports whether a first configuration with listeners has been applied and the ingress is
// not draining.
func (in *Ingress) Ready() bool { return in.ready.Load() && !in.draining.Load() }

// Draining reports whether the ingress is shutting down: its readiness fails, and its listeners
// close (after DrainDelay) while established connections finish (within DrainTimeout).
func (in *Ingress) Draining() bool { return in.draining.Load() }

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
	var err error
	switch typeURL {
	case resourcev3.ListenerType:
		// A listener not served here (no address given) is accepted as is and dropped, so a
		// replica that serves a subset of the listeners never NACKs the others.
		// Internal listeners (terminating shoots', named by their clusters, not bound to an
		// address) are kept apart.
		served := make([]*discoveryv3.Resource, 0, len(resources))
		var internal []*discoveryv3.Resource
		removedServed := slices.Clip(removed) // the update's own slice stays as it is
		for _, r := range resources {
			switch l, err := unpack(r.GetResource(), &listenerv3.Listener{}); {
			case err == nil && internalListener(l):
				internal = append(internal, r)
				removedServed = append(removedServed, r.GetName())
				continue
			case err != nil:
				return fmt.Errorf("listener %s: %w", r.GetName(), err)
			}
			if _, ok := in.cfg.Listeners[r.GetName()]; ok {
				served = append(served, r)
			} else {
				removedServed = append(removedServed, r.GetName())
			}
		}
		removedInternal := slices.Clip(removed)
		for _, r := range served {
			removedInternal = append(removedInternal, r.GetName())
		}
		next.terminates, err = applyDelta(old.terminates, internal, removedInternal, "listener", func(l *listenerv3.Listener) (string, *terminateConfig, error) {
			tc, err := parseTerminateListener(l)
			if err != nil {
				return "", nil, fmt.Errorf("listener %s: %w", l.GetName(), err)
			}
			return tc.name, tc, nil
		})
		if err != nil {
			return err
		}
		removed = removedServed
		next.listeners, err = applyDelta(old.listeners, served, removed, "listener", func(l *listenerv3.Listener) (string, *listenerConfig, error) {
			lc, err := parseListener(l)
			if err != nil {
				return "", nil, fmt.Errorf("listener %s: %w", l.GetName(), err)
			}
			if lc.lbProxyProtocol && len(in.cfg.TrustedProxies) == 0 {
				return "", nil, fmt.Errorf("listener %s reads the load balancer's PROXY header, but no trusted proxy CIDR is configured (--trusted-proxy-cidr)", l.GetName())
			}
			return lc.name, lc, nil
		})
	case resourcev3.ClusterType:
		next.clusters, err = applyDelta(old.clusters, resources, removed, "cluster", func(c *clusterv3.Cluster) (string, *clusterConfig, error) {
			cc, err := parseCluster(c)
			if err != nil {
				return "", nil, err
			}
			return cc.name, cc, nil
		})
	case resourcev3.EndpointType:
		next.endpoints, err = applyDelta(old.endpoints, resources, removed, "assignment", func(la *endpointv3.ClusterLoadAssignment) (string, []netip.AddrPort, error) {
			eps, _, err := parseAssignment(la, false)
			if err != nil {
				return "", nil, fmt.Errorf("assignment %s: %w", la.GetClusterName(), err)
			}
			return la.GetClusterName(), eps, nil
		})
	case resourcev3.SecretType:
		next.secrets, err = applyDelta(old.secrets, resources, removed, "secret", func(s *tlsv3.Secret) (string, *secretConfig, error) {
			sc, err := parseSecret(s)
			if err != nil {
				return "", nil, err
			}
			return s.GetName(), sc, nil
		})
	default:
		return fmt.Errorf("type %s is not supported", typeURL)
	}
	if err != nil {
		return err
	}
	in.current.Store(&next)
	in.terms.sync(&next)
	in.metrics.xdsResources.WithLabelValues(resourcev3.SecretType).Set(float64(len(next.secrets)))
	in.metrics.xdsResources.WithLabelValues(resourcev3.ListenerType).Set(float64(len(next.listeners)))
	in.metrics.xdsResources.WithLabelValues(resourcev3.ClusterType).Set(float64(len(next.clusters)))
	in.metrics.xdsResources.WithLabelValues(resourcev3.EndpointType).Set(float64(len(next.endpoints)))
	if typeURL == resourcev3.ListenerType && len(next.listeners) > 0 {
		in.ready.Store(true)
	}
	return nil
}

// applyDelta is old with the removed names deleted and resources added: each is unpacked (an
// error names it as what) and parse gives the key it is stored under and its value.
func applyDelta[M proto.Message, V any](old map[string]V, resources []*discoveryv3.Resource, removed []string, what string, parse func(M) (string, V, error)) (map[string]V, error) {
	m := maps.Clone(old)
	for _, n := range removed {
		delete(m, n)
	}
	for _, r := range resources {
		var zero M
		msg, err := unpack(r.GetResource(), zero.ProtoReflect().New().Interface().(M))
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", what, r.GetName(), err)
		}
		k, v, err := parse(msg)
		if err != nil {
			return nil, err
		}
		m[k] = v
	}
	return m, nil
}

// Run subscribes to the xDS server at xdsAddress as nodeID and serves the configured listeners
// until ctx ends. Listener addresses are bound before anything else, so a taken port fails at once.
func (in *Ingress) Run(ctx context.Context, xds xdsclient.Config) error {
	lns := make(map[string]net.Listener, len(in.cfg.Listeners))
	listen := in.cfg.Listen
	if listen == nil {
		listen = net.Listen
	}
	for name, addr := range in.cfg.Listeners {
		// No keepalive configuration here: the relay loops accept, and loops.Listen sets the
		// accepted connections' options on the listening socket (clientKeepAlive).
		l, err := listen("tcp", addr)
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

// clientKeepAlive keeps TCP keepalive on clients' connections, so a client that vanished without
// a FIN is found, but probes an idle connection after 5 minutes (the kernel's interval and count
// after that) rather than Go's 15 s: a replica holding 100,000 idle watches would otherwise send
// 6,667 probes a second. Set on the listening socket, it costs no system call per connection.
const clientKeepAlive = 5 * time.Minute

// Serve is Run with the listeners already bound (tests bind 127.0.0.1:0). When ctx ends, Serve
// drains (drain) and returns once the last connection has ended or been closed. The xDS client
// runs until then, so a connection accepted during DrainDelay is routed with the current
// configuration. An error of the xDS client ends everything at once, without a drain.
func (in *Ingress) Serve(ctx context.Context, lns map[string]net.Listener, xds xdsclient.Config) error {
	// stopCtx ends the xDS client and every connection: after the drain, or on an error.
	stopCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	errc := make(chan error, len(lns)+1)
	if xds.Types == nil {
		xds.Types = Types
	}
	if xds.Log.GetSink() == nil {
		xds.Log = in.log.WithName("xds")
	}
	// Established connections move to the relay loops: an idle one then holds its two sockets
	// and nothing else (no goroutine, pipe or buffer).
	loops, err := loops.NewLoops(loops.LoopsConfig{Loops: in.cfg.Loops})
	if err != nil {
		for _, l := range lns {
			l.Close()
		}
		return fmt.Errorf("relay loops: %w", err)
	}
	defer loops.Close()
	servers := make([]*server, 0, len(lns))
	for name, l := range lns {
		s, err := newServer(in, name, l, loops)
		if err != nil {
			for _, l := range lns {
				l.Close() // the ones taken over are closed already
			}
			for _, s := range servers {
				s.stopAccepting()
			}
			return err
		}
		servers = append(servers, s)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		errc <- xdsclient.Run(stopCtx, xds, in.Apply)
	}()
	// served ends once every listener is closed and its connections have ended.
	var served sync.WaitGroup
	for _, s := range servers {
		served.Add(1)
		go func() {
			defer served.Done()
			errc <- s.serve(stopCtx)
		}()
	}
	allServed := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		served.Wait()
		close(allServed)
	}()
	in.servers.Store(&servers)
	var first error
	select {
	case <-ctx.Done():
		in.drain(servers, allServed)
	case first = <-errc:
	}
	stop()
	wg.Wait()
	in.terms.close()
	if first != nil && !errors.Is(first, context.Canceled) {
		return first
	}
	return nil
}

// MemoryReleased counts a return of the process's free heap to the system (internal/idlemem's
// Released, run by the binary), as tendril_ingress_memory_releases_total.
func (in *Ingress) MemoryReleased() { in.metrics.memoryReleases.Inc() }

// ProcsChanged counts a change of GOMAXPROCS (internal/procscale's Changed, run by the binary), as
// tendril_ingress_procs_changes_total.
func (in *Ingress) ProcsChanged() { in.metrics.procsChanges.Inc() }

// Open reports how many clients' connections the ingress holds, in their handshake or relayed.
func (in *Ingress) Open() int {
	servers := in.servers.Load()
	if servers == nil {
		return 0
	}
	n := 0
	for _, s := range *servers {
		n += s.downstreams()
	}
	return n
}

// drain shuts the ingress down without dropping what it can finish: readiness fails at once;
// after DrainDelay the listeners close (new connections are refused by the kernel from then on);
// established connections, and those still in their handshake, go on for up to DrainTimeout;
// then the rest are closed and counted by listener. It returns when served is closed (every
// connection has ended) or the rest have been closed.
//
// Why a delay before closing: a load balancer (kube-proxy syncing a terminating pod's endpoint
// away, a cloud load balancer's health check) keeps sending new connections for a while after
// the pod is told to stop. Closed listeners would refuse (RST) those, and connections in the
// accept queue are reset when the listener closes; a listener that stays open while readiness
// fails takes them until the load balancer has noticed.
func (in *Ingress) drain(servers []*server, served <-chan struct{}) {
	in.draining.Store(true)
	start := time.Now()
	open := map[string]int{}
	for _, s := range servers {
		open[s.name] = s.downstreams()
		in.metrics.drainClosed.WithLabelValues(s.name).Add(0) // the series exists before a drain closes any
	}
	in.log.Info("Draining", "delay", in.cfg.DrainDelay.String(), "timeout", in.cfg.DrainTimeout.String(), "open", open)
	if in.cfg.DrainDelay > 0 {
		delay := time.NewTimer(in.cfg.DrainDelay)
		select {
		case <-delay.C:
		case <-served: // every listener was closed under it: nothing left to wait for
			delay.Stop()
		}
	}
	for _, s := range servers {
		s.stopAccepting()
	}
	// Terminated connections are HTTP: idle ones can close now, HTTP/2 ones go away.
	in.terms.drain()
	if in.cfg.DrainDelay > 0 {
		for _, s := range servers {
			open[s.name] = s.downstreams()
		}
		in.log.Info("Listeners closed", "open", open)
	}
	timeout := time.NewTimer(in.cfg.DrainTimeout)
	defer timeout.Stop()
	closed := map[string]int{}
	for _, s := range servers {
		closed[s.name] = 0
	}
	select {
	case <-served:
	case <-timeout.C:
		for _, s := range servers {
			n := s.closeAll()
			closed[s.name] = n
			in.metrics.drainClosed.WithLabelValues(s.name).Add(float64(n))
		}
	}
	in.log.Info("Drained", "took", time.Since(start).Round(time.Millisecond).String(), "closed", closed)
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
