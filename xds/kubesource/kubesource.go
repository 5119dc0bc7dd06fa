// Package kubesource is the Kubernetes route source: it watches tendril's Route objects and the
// Services and EndpointSlices they reference, builds the routing model from them (the namespace
// is the shoot), and applies it to the xDS server, as the route file source does without
// Kubernetes. It writes each Route's Programmed condition from what the connected data planes
// acknowledged (Server.ShootStatus; xds/server is the Server).
//
// Events are coalesced (100 ms quiet, at most 500 ms by default) and nothing is published before
// the informers have synced: an empty set published early would withdraw every shoot. A change
// rebuilds only the namespaces it touched, and the server sends only resources whose content
// changed, so an EndpointSlice change sends one load assignment.
package kubesource

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/xds/model"
)

// Server is what the source needs of the xDS server (xds/server.Server is one): it applies the
// route set, is told which data planes must hold it, and reports per shoot what they
// acknowledged.
type Server interface {
	// Apply makes shoots the complete route set, or refuses it and keeps what it had.
	Apply(shoots []model.Shoot) (model.Stats, error)
	// SetExpectedNodes names the data planes (xDS node IDs) a shoot must be held by to be
	// programmed.
	SetExpectedNodes(nodes []string)
	// ShootStatus is the acknowledgement state of one shoot's current resources.
	ShootStatus(name string) model.ShootStatus
	// StatusChanges is signalled when a shoot's status may have changed; TakeStatusChanges
	// then returns those shoots' status.
	StatusChanges() <-chan struct{}
	TakeStatusChanges() []model.ShootStatus
}

// Config configures the source. Server is required; the zero value of every other field works.
type Config struct {
	// Server receives the route set and reports what the data planes acknowledged.
	Server Server
	// Log receives the source's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// Quiet is how long the watched objects must be quiet before the route set is rebuilt. If
	// zero, 100 ms.
	Quiet time.Duration
	// MaxDelay bounds how long a burst of events can hold a rebuild back. If zero, 500 ms.
	MaxDelay time.Duration
	// PendingDelay is how long a route may wait for its acknowledgements before Pending is
	// written to its status; a route acknowledged sooner gets one status write (Programmed)
	// per change. If zero, 2 s.
	PendingDelay time.Duration
	// Services are the names of the Services Routes may name. If set, the manager's cache should
	// hold only their EndpointSlices (CacheByObject), and a Route naming another Service reports
	// NoEndpoints saying so. Empty: any Service.
	Services []string
	// Ingress is the shared ingress's Service. The Pods behind its ready endpoints are the
	// ingress replicas that serve traffic, and a route is Programmed only once each of them
	// (its xDS node ID is its Pod name) acknowledged it (Server.SetExpectedNodes). The manager's
	// cache must hold its EndpointSlices. Zero: the connected replicas only.
	Ingress types.NamespacedName
	// ReconnectGrace holds Pending writes back for this long after the source starts leading:
	// the ingress replicas reconnect to a new leader after a failover, and until they have,
	// their routes are not lost but unconfirmed. Without it, a failover would write Pending and
	// then Programmed again to every Route. If zero, 30 s (tendril-ingress retries at most
	// every 10 s, Envoy's ADS backs off up to 30 s).
	ReconnectGrace time.Duration
}

// CacheByObject narrows a manager's cache to the EndpointSlices of the named Services (nil for
// none: every EndpointSlice). A seed holds an EndpointSlice per Service of every shoot's control
// plane, and pods restarting anywhere in it change them all the time; the route source needs
// only the few Services Routes name. A name that cannot be a Service's is an error.
//
// Secrets are always narrowed: the source reads only the termination Secrets Routes name, which
// carry tendrilv1alpha1.TerminationSecretLabel, never the seed's others.
func CacheByObject(services []string) (map[client.Object]cache.ByObject, error) {
	by := map[client.Object]cache.ByObject{
		&corev1.Secret{}: {Label: labels.SelectorFromSet(labels.Set{tendrilv1alpha1.TerminationSecretLabel: "true"})},
	}
	if len(services) == 0 {
		return by, nil
	}
	req, err := labels.NewRequirement(discoveryv1.LabelServiceName, selection.In, services)
	if err != nil {
		return nil, fmt.Errorf("kubesource: services %v: %w", services, err)
	}
	by[&discoveryv1.EndpointSlice{}] = cache.ByObject{Label: labels.NewSelector().Add(*req)}
	return by, nil
}

// Add adds the source to mgr. It runs on every replica (so that a new leader serves the current
// routes at once) and writes Route status only once mgr has been elected leader. It also adds
// the readiness check "routes", which passes once the first route set was published. mgr's scheme must know core/v1, discovery/v1
// and tendril's v1alpha1.
func Add(mgr manager.Manager, cfg Config) error {
	s, err := New(cfg, mgr.GetCache(), mgr.GetClient(), mgr.Elected())
	if err != nil {
		return err
	}
	for _, obj := range []client.Object{&tendrilv1alpha1.Route{}, &corev1.Service{}, &discoveryv1.EndpointSlice{}} {
		if _, err := mgr.GetClient().GroupVersionKindFor(obj); err != nil {
			return fmt.Errorf("kubesource: the manager's scheme: %w", err)
		}
	}
	if err := mgr.AddReadyzCheck("routes", s.Ready); err != nil {
		return fmt.Errorf("kubesource: readiness check: %w", err)
	}
	return mgr.Add(s)
}

// Ready is a healthz.Checker: it fails until the first route set has been published.
func (s *Source) Ready(*http.Request) error {
	if !s.published.Load() {
		return errors.New("routes not published yet (waiting for the caches to sync)")
	}
	return nil
}

// Source is the running source; it is a manager.Runnable.
type Source struct {
	cfg     Config
	log     logr.Logger
	cache   cache.Cache
	client  client.Client
	elected <-chan struct{}
	metrics *metrics

	mu      sync.Mutex // guards dirty
	dirty   map[string]bool
	changed chan struct{}

	// Owned by the Start goroutine.
	ns      map[string]*namespace // by namespace (shoot) name
	pending map[types.NamespacedName]pendingSince
	reasons map[types.NamespacedName]string // the condition reason of every route, for metrics
	writer  *statusWriter
	leading bool
	// graceUntil is when Pending may be written after the source started leading.
	graceUntil time.Time

	published atomic.Bool // the first route set was applied
}

// pendingSince is when a route was first found Pending for its generation and model; Pending is
// written only after Config.PendingDelay.
type pendingSince struct {
	at         time.Time
	generation int64
	shoot      model.Shoot
}

var (
	_ manager.Runnable               = (*Source)(nil)
	_ manager.LeaderElectionRunnable = (*Source)(nil)
)

// New returns a source reading from c (a started cache) and writing status with w once
// elected is closed (nil: never).
func New(cfg Config, c cache.Cache, w client.Client, elected <-chan struct{}) (*Source, error) {
	if cfg.Server == nil {
		return nil, errors.New("kubesource: Config.Server is required")
	}
	cfg.Quiet = cmp.Or(cfg.Quiet, 100*time.Millisecond)
	cfg.MaxDelay = cmp.Or(cfg.MaxDelay, 500*time.Millisecond)
	cfg.PendingDelay = cmp.Or(cfg.PendingDelay, 2*time.Second)
	cfg.ReconnectGrace = cmp.Or(cfg.ReconnectGrace, 30*time.Second)
	m, err := newMetrics(cfg.Registry)
	if err != nil {
		return nil, err
	}
	return &Source{
		cfg: cfg, log: cfg.Log, cache: c, client: w, elected: elected, metrics: m,
		dirty:   make(map[string]bool),
		changed: make(chan struct{}, 1),
		ns:      make(map[string]*namespace),
		pending: make(map[types.NamespacedName]pendingSince),
		reasons: make(map[types.NamespacedName]string),
	}, nil
}

// NeedLeaderElection is false: every replica keeps its route set current. Status writes wait for
// the election.
func (s *Source) NeedLeaderElection() bool { return false }

// Start runs the source until ctx ends.
func (s *Source) Start(ctx context.Context) error {
	unwatch, err := s.watch(ctx)
	defer unwatch()
	if err != nil {
		return err
	}
	if !s.cache.WaitForCacheSync(ctx) {
		if ctx.Err() != nil {
			return nil
		}
		return errors.New("kubesource: caches did not sync")
	}
	s.log.Info("Caches synced, publishing routes")

	s.writer = newStatusWriter(s.client, s.log, s.metrics)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.writer.run(ctx)
	}()
	defer wg.Wait()

	if err := s.buildAll(ctx); err != nil {
		return err
	}

	elected := s.elected
	var timer *time.Timer
	var timerC <-chan time.Time
	var burst time.Time // when the pending burst's first event came; zero when idle
	// pendingTimer fires when the earliest held-back Pending condition is due (pendingAt).
	var pendingTimer *time.Timer
	var pendingC <-chan time.Time
	var pendingAt time.Time
	due := s.conditions(nil)
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		if pendingTimer != nil {
			pendingTimer.Stop()
		}
	}()
	for {
		if !due.IsZero() && (pendingC == nil || due.Before(pendingAt)) {
			if pendingTimer == nil {
				pendingTimer = time.NewTimer(time.Until(due))
			} else {
				pendingTimer.Reset(time.Until(due))
			}
			pendingC, pendingAt = pendingTimer.C, due
		}
		due = time.Time{}
		select {
		case <-ctx.Done():
			return nil
		case <-elected:
			elected = nil
			s.leading = true
			s.graceUntil = time.Now().Add(s.cfg.ReconnectGrace)
			s.log.Info("Leading: writing Route status")
			due = s.conditions(nil)
		case <-s.changed:
			now := time.Now()
			if burst.IsZero() {
				burst = now
			}
			wait := min(s.cfg.Quiet, time.Until(burst.Add(s.cfg.MaxDelay)))
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			timerC = timer.C
			continue
		case <-timerC:
			timerC, burst = nil, time.Time{}
			s.mu.Lock()
			dirty := s.dirty
			s.dirty = make(map[string]bool)
			s.mu.Unlock()
			if err := s.rebuild(ctx, dirty); err != nil {
				return err
			}
			due = s.conditions(nil)
		case <-s.cfg.Server.StatusChanges():
			var names []string
			for _, st := range s.cfg.Server.TakeStatusChanges() {
				names = append(names, st.Name)
			}
			due = s.conditions(names)
		case <-pendingC:
			pendingC = nil
			due = s.conditions(nil)
		}
	}
}

// watch registers the Source's event handlers on the Route, Service, EndpointSlice and (termination)
// Secret informers;
// unwatch removes those registered (also after an error).
func (s *Source) watch(ctx context.Context) (unwatch func(), err error) {
	var removes []func()
	unwatch = func() {
		for _, r := range removes {
			r()
		}
	}
	for _, obj := range []client.Object{&tendrilv1alpha1.Route{}, &corev1.Service{}, &discoveryv1.EndpointSlice{}, &corev1.Secret{}} {
		inf, err := s.cache.GetInformer(ctx, obj)
		if err != nil {
			return unwatch, fmt.Errorf("kubesource: informer for %T: %w", obj, err)
		}
		reg, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
			AddFunc:    func(o any) { s.touch(o) },
			UpdateFunc: func(_, o any) { s.touch(o) },
			DeleteFunc: func(o any) { s.touch(o) },
		})
		if err != nil {
			return unwatch, fmt.Errorf("kubesource: watch %T: %w", obj, err)
		}
		removes = append(removes, func() { _ = inf.RemoveEventHandler(reg) })
	}
	return unwatch, nil
}

// buildAll is the first build: it covers every namespace with a Route; later ones only touched
// namespaces. What was touched so far is in the caches it reads.
func (s *Source) buildAll(ctx context.Context) error {
	s.mu.Lock()
	clear(s.dirty)
	s.mu.Unlock()
	select {
	case <-s.changed:
	default:
	}
	var all tendrilv1alpha1.RouteList
	if err := s.cache.List(ctx, &all); err != nil {
		return fmt.Errorf("kubesource: list routes: %w", err)
	}
	first := make(map[string]bool)
	for _, r := range all.Items {
		first[r.Namespace] = true
	}
	return s.rebuild(ctx, first)
}

// touch marks the namespace of an added, changed or deleted object for a rebuild.
func (s *Source) touch(o any) {
	if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	obj, ok := o.(metav1.Object)
	if !ok {
		return
	}
	s.mu.Lock()
	s.dirty[obj.GetNamespace()] = true
	s.mu.Unlock()
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// namespace is what one shoot namespace contributes: its Routes, the oldest first, which is the
// one the namespace is routed by.
type namespace struct {
	routes []*route
}

// route is one Route and what became of it.
type route struct {
	obj *tendrilv1alpha1.Route
	// shoot is the model built from it, applied unless the route is Invalid or lost a claim.
	// A route whose upstream has no endpoints is applied (its names stay claimed) but not
	// programmed.
	shoot model.Shoot
	// reason and message explain a route that cannot be programmed whatever the data planes
	// do (Invalid, NoEndpoints); empty otherwise.
	reason, message string
	// claim says which older route holds a server name or the advertised address this one
	// wants (it is then not applied); empty if none.
	claim string
}

// rebuild re-reads the dirty namespaces, resolves claims between namespaces and applies the
// complete set.
func (s *Source) rebuild(ctx context.Context, dirty map[string]bool) error {
	start := time.Now()
	for name := range dirty {
		if err := s.readNamespace(ctx, name); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// A read from the cache fails only for programming errors (an unknown type).
			return err
		}
	}
	if s.cfg.Ingress.Name != "" && (dirty[s.cfg.Ingress.Namespace] || !s.published.Load()) {
		nodes, err := s.ingressReplicas(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		s.cfg.Server.SetExpectedNodes(nodes)
	}
	set := s.resolveClaims()
	if _, err := s.cfg.Server.Apply(set); err != nil {
		// resolveClaims admits only a valid set; a refusal here is a bug, and the server keeps
		// serving the last good set.
		s.metrics.publishes.WithLabelValues("rejected").Inc()
		s.log.Error(err, "Route set refused by the xDS server")
		return nil
	}
	s.metrics.publishes.WithLabelValues("applied").Inc()
	s.published.Store(true)
	s.metrics.buildDuration.Observe(time.Since(start).Seconds())
	s.log.V(1).Info("Routes published", "namespaces", len(dirty), "shoots", len(set))
	return nil
}

// ingressReplicas are the names of the Pods behind the ingress Service's ready endpoints. A Pod
// that is not ready serves no traffic (tendril-ingress and Envoy are ready once configured and
// stay so while the control plane is away); it counts only while it is connected.
func (s *Source) ingressReplicas(ctx context.Context) ([]string, error) {
	var list discoveryv1.EndpointSliceList
	if err := s.cache.List(ctx, &list, client.InNamespace(s.cfg.Ingress.Namespace), client.MatchingLabels{discoveryv1.LabelServiceName: s.cfg.Ingress.Name}); err != nil {
		return nil, fmt.Errorf("kubesource: list EndpointSlices of the ingress %s: %w", s.cfg.Ingress, err)
	}
	var pods []string
	for _, sl := range list.Items {
		for _, e := range sl.Endpoints {
			if ref := e.TargetRef; ptrOr(e.Conditions.Ready, true) && ref != nil && ref.Kind == "Pod" && ref.Name != "" {
				pods = append(pods, ref.Name)
			}
		}
	}
	slices.Sort(pods)
	return slices.Compact(pods), nil
}

// readNamespace rebuilds the routes of one namespace from the cache.
func (s *Source) readNamespace(ctx context.Context, name string) error {
	delete(s.ns, name)
	var list tendrilv1alpha1.RouteList
	if err := s.cache.List(ctx, &list, client.InNamespace(name)); err != nil {
		return fmt.Errorf("kubesource: list routes in %s: %w", name, err)
	}
	var live []*tendrilv1alpha1.Route
	for i := range list.Items {
		r := &list.Items[i]
		if r.DeletionTimestamp != nil {
			continue // being deleted: withdrawn now, as the extension's delete expects
		}
		live = append(live, r)
	}
	if len(live) == 0 {
		return nil
	}
	// The oldest Route programs the namespace; the API type documents this. Creation times
	// have a resolution of one second; within one, the first name wins.
	slices.SortFunc(live, func(a, b *tendrilv1alpha1.Route) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	ns := &namespace{}
	s.ns[name] = ns
	for i, obj := range live {
		r := &route{obj: obj}
		ns.routes = append(ns.routes, r)
		if i > 0 {
			r.reason = tendrilv1alpha1.ReasonInvalid
			r.message = fmt.Sprintf("Namespace %s is routed by Route %s; a namespace has one Route.", name, live[0].Name)
			continue
		}
		if err := s.build(ctx, r); err != nil {
			return err
		}
	}
	return nil
}

// build turns the namespace's active Route into its model, or explains why it cannot be.
func (s *Source) build(ctx context.Context, r *route) error {
	spec := r.obj.Spec
	sh := model.Shoot{Name: r.obj.Namespace, Hosts: slices.Clone(spec.Hostnames)}
	slices.Sort(sh.Hosts)
	if spec.AdvertisedAddress != "" {
		a, err := netip.ParseAddr(spec.AdvertisedAddress)
		if err != nil {
			r.reason, r.message = tendrilv1alpha1.ReasonInvalid, fmt.Sprintf("advertisedAddress %q is not an IP address", spec.AdvertisedAddress)
			return nil
		}
		sh.AdvertisedAddress = a.Unmap()
	}
	if spec.Termination != nil {
		tm, problem, err := s.termination(ctx, r.obj.Namespace, *spec.Termination)
		if err != nil {
			return err
		}
		if problem != "" {
			r.reason, r.message = tendrilv1alpha1.ReasonInvalid, problem
			return nil
		}
		sh.Termination = tm
	}
	if err := sh.Validate(); err != nil {
		r.reason, r.message = tendrilv1alpha1.ReasonInvalid, err.Error()
		return nil
	}
	var problems []string
	eps, _, problem, err := s.endpoints(ctx, r.obj.Namespace, spec.APIServer)
	if err != nil {
		return err
	}
	sh.APIServers = eps
	if problem != "" {
		problems = append(problems, problem)
	}
	if spec.TunnelServer != nil {
		eps, replicas, problem, err := s.endpoints(ctx, r.obj.Namespace, *spec.TunnelServer)
		if err != nil {
			return err
		}
		sh.VPNServers, sh.VPNReplicas = eps, replicas
		if problem != "" {
			problems = append(problems, problem)
		}
	}
	r.shoot = sh
	if len(problems) > 0 {
		r.reason, r.message = tendrilv1alpha1.ReasonNoEndpoints, joinSentences(problems)
	}
	return nil
}

// termination reads a Route's termination Secret; a problem (no such Secret, a missing key) is
// returned as a sentence for the condition.
func (s *Source) termination(ctx context.Context, ns string, t tendrilv1alpha1.RouteTermination) (*model.Termination, string, error) {
	var sec corev1.Secret
	switch err := s.cache.Get(ctx, types.NamespacedName{Namespace: ns, Name: t.SecretName}, &sec); {
	case apierrors.IsNotFound(err):
		return nil, fmt.Sprintf("The termination Secret %s does not exist or lacks the label %s=true.", t.SecretName, tendrilv1alpha1.TerminationSecretLabel), nil
	case err != nil:
		return nil, "", fmt.Errorf("kubesource: get Secret %s/%s: %w", ns, t.SecretName, err)
	}
	var missing []string
	key := func(k string) []byte {
		if len(sec.Data[k]) == 0 {
			missing = append(missing, k)
		}
		return sec.Data[k]
	}
	tm := &model.Termination{
		ServingCert: key(tendrilv1alpha1.TerminationServingCert), ServingKey: key(tendrilv1alpha1.TerminationServingKey),
		ClientCA:       key(tendrilv1alpha1.TerminationClientCA),
		FrontProxyCert: key(tendrilv1alpha1.TerminationFrontProxyCert), FrontProxyKey: key(tendrilv1alpha1.TerminationFrontProxyKey),
		APIServerCA: key(tendrilv1alpha1.TerminationAPIServerCA), APIServerName: t.APIServerName,
	}
	if len(missing) > 0 {
		return nil, fmt.Sprintf("The termination Secret %s lacks %s.", t.SecretName, strings.Join(missing, ", ")), nil
	}
	return tm, "", nil
}

// endpoints resolves a Service port to the ready endpoints of its EndpointSlices, and those of
// them that have a hostname (a StatefulSet's pods under the Service they name as theirs) as
// replicas. The endpoint port is the slice port with the Service port's name, as kube-proxy
// matches them. A problem (no Service, no such port, nothing ready) is returned as a sentence for
// the condition.
func (s *Source) endpoints(ctx context.Context, ns string, ref tendrilv1alpha1.ServiceReference) ([]netip.AddrPort, []model.VPNReplica, string, error) {
	if len(s.cfg.Services) > 0 && !slices.Contains(s.cfg.Services, ref.Name) {
		return nil, nil, fmt.Sprintf("Service %s is not one whose endpoints tendril-seed watches (%s).", ref.Name, strings.Join(s.cfg.Services, ", ")), nil
	}
	var svc corev1.Service
	switch err := s.cache.Get(ctx, client.ObjectKey{Namespace: ns, Name: ref.Name}, &svc); {
	case err == nil:
	case client.IgnoreNotFound(err) == nil:
		return nil, nil, fmt.Sprintf("Service %s not found.", ref.Name), nil
	default:
		return nil, nil, "", fmt.Errorf("kubesource: get Service %s/%s: %w", ns, ref.Name, err)
	}
	portName, found := "", false
	for _, p := range svc.Spec.Ports {
		if p.Port == ref.Port && cmp.Or(p.Protocol, corev1.ProtocolTCP) == corev1.ProtocolTCP {
			portName, found = p.Name, true
			break
		}
	}
	if !found {
		return nil, nil, fmt.Sprintf("Service %s has no TCP port %d.", ref.Name, ref.Port), nil
	}
	var list discoveryv1.EndpointSliceList
	if err := s.cache.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{discoveryv1.LabelServiceName: ref.Name}); err != nil {
		return nil, nil, "", fmt.Errorf("kubesource: list EndpointSlices of %s/%s: %w", ns, ref.Name, err)
	}
	var (
		out      []netip.AddrPort
		replicas []model.VPNReplica
	)
	for _, sl := range list.Items {
		if sl.AddressType != discoveryv1.AddressTypeIPv4 && sl.AddressType != discoveryv1.AddressTypeIPv6 {
			continue // FQDN slices: EDS endpoints must be IPs
		}
		var port int32
		for _, p := range sl.Ports {
			if ptrOr(p.Name, "") == portName && ptrOr(p.Protocol, corev1.ProtocolTCP) == corev1.ProtocolTCP && p.Port != nil {
				port = *p.Port
				break
			}
		}
		if port <= 0 || port > 65535 {
			continue
		}
		for _, e := range sl.Endpoints {
			// A nil ready condition means unknown, which consumers treat as ready (API docs).
			if !ptrOr(e.Conditions.Ready, true) || len(e.Addresses) == 0 {
				continue
			}
			// The addresses of one endpoint are fungible; like kube-proxy, use the first.
			ip, err := netip.ParseAddr(e.Addresses[0])
			if err != nil {
				continue
			}
			ep := netip.AddrPortFrom(ip.Unmap(), uint16(port))
			out = append(out, ep)
			if h := ptrOr(e.Hostname, ""); h != "" {
				replicas = append(replicas, model.VPNReplica{Hostname: h, Endpoint: ep})
			}
		}
	}
	slices.SortFunc(out, netip.AddrPort.Compare)
	out = slices.Compact(out)
	if len(out) == 0 {
		return nil, nil, fmt.Sprintf("Service %s has no ready endpoints.", ref.Name), nil
	}
	model.SortReplicas(replicas)
	// A hostname seen twice (two slices during a change) keeps its first, lowest-sorting entry.
	replicas = slices.CompactFunc(replicas, func(a, b model.VPNReplica) bool { return a.Hostname == b.Hostname })
	return out, replicas, "", nil
}

// resolveClaims assembles the set: every namespace's active route that can be applied, the
// oldest first, each admitted only if no earlier route claimed one of its server names or its
// advertised address. A route that lost a claim is Invalid, and the rest are unaffected.
func (s *Source) resolveClaims() []model.Shoot {
	var cands []*route
	for _, ns := range s.ns {
		r := ns.routes[0]
		if r.reason == tendrilv1alpha1.ReasonInvalid {
			continue
		}
		r.claim = ""
		cands = append(cands, r)
	}
	slices.SortFunc(cands, func(a, b *route) int {
		if c := a.obj.CreationTimestamp.Compare(b.obj.CreationTimestamp.Time); c != 0 {
			return c
		}
		return cmp.Compare(a.obj.Namespace, b.obj.Namespace)
	})
	var claims model.Claims
	set := make([]model.Shoot, 0, len(cands))
	for _, r := range cands {
		if err := claims.Admit(r.shoot); err != nil {
			r.claim = claimMessage(err) + " (by an older Route)."
			continue
		}
		set = append(set, r.shoot)
	}
	model.Sort(set)
	return set
}

// claimMessage says which claim of a route model.Claims.Admit refused (the first), in the
// Route's terms: a shoot is its namespace.
func claimMessage(err error) string {
	var c *model.Conflict
	switch {
	case !errors.As(err, &c):
		return err.Error()
	case c.Host != "":
		return fmt.Sprintf("hostname %s is already routed to namespace %s", c.Host, c.Holder)
	default:
		return fmt.Sprintf("advertisedAddress %s is already routed to namespace %s", c.Advertised, c.Holder)
	}
}

// conditions computes the Programmed condition of the routes of the named shoots (all when
// shoots is nil) and queues the writes that differ from the Routes' status. It returns when the
// earliest held-back Pending write is due (zero if none).
func (s *Source) conditions(shoots []string) time.Time {
	var rs []*route
	if shoots == nil {
		clear(s.reasons)
		for _, ns := range s.ns {
			rs = append(rs, ns.routes...)
		}
	} else {
		for _, name := range shoots {
			if ns := s.ns[name]; ns != nil {
				rs = append(rs, ns.routes...)
			}
		}
	}
	now := time.Now()
	var due time.Time
	for _, r := range rs {
		key := client.ObjectKeyFromObject(r.obj)
		c := s.condition(r)
		s.reasons[key] = c.Reason
		if c.Reason != tendrilv1alpha1.ReasonPending {
			delete(s.pending, key)
		} else {
			// Held back a moment, so that a route acknowledged quickly costs one write per
			// change (Programmed) rather than two.
			p, ok := s.pending[key]
			if !ok || p.generation != r.obj.Generation || !p.shoot.Equal(r.shoot) {
				p = pendingSince{at: now, generation: r.obj.Generation, shoot: r.shoot}
				s.pending[key] = p
			}
			at := p.at.Add(s.cfg.PendingDelay)
			if s.leading && at.Before(s.graceUntil) {
				at = s.graceUntil
			}
			if now.Before(at) {
				if due.IsZero() || at.Before(due) {
					due = at
				}
				continue
			}
		}
		switch {
		case !s.leading:
		case needsWrite(r.obj, c):
			s.writer.enqueue(key, c)
		default:
			s.writer.settled(key)
		}
	}
	if shoots == nil {
		for key := range s.pending {
			if _, ok := s.reasons[key]; !ok {
				delete(s.pending, key)
			}
		}
		s.writer.forget(s.reasons)
	}
	s.metrics.setStates(s.reasons)
	return due
}

// condition is the Programmed condition route r should carry now.
func (s *Source) condition(r *route) metav1.Condition {
	c := metav1.Condition{Type: tendrilv1alpha1.ConditionProgrammed, Status: metav1.ConditionFalse, ObservedGeneration: r.obj.Generation}
	switch {
	case r.reason == tendrilv1alpha1.ReasonInvalid:
		c.Reason, c.Message = r.reason, r.message
		return c
	case r.claim != "":
		c.Reason, c.Message = tendrilv1alpha1.ReasonInvalid, r.claim
		return c
	case r.reason != "":
		c.Reason, c.Message = r.reason, r.message
		return c
	}
	st := s.cfg.Server.ShootStatus(r.obj.Namespace)
	if st.State == model.StateUnknown || !st.Model.Equal(r.shoot) {
		c.Reason, c.Message = tendrilv1alpha1.ReasonPending, "Waiting for the control plane to publish the route."
		return c
	}
	switch st.State {
	case model.StateProgrammed:
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, tendrilv1alpha1.ReasonProgrammed, "Every ingress replica acknowledged the route."
	case model.StateRejected:
		c.Reason, c.Message = tendrilv1alpha1.ReasonRejected, "An ingress replica rejected the route: "+st.Detail
	default:
		// The message must not count replicas: it would change, and be written, per replica.
		c.Reason, c.Message = tendrilv1alpha1.ReasonPending, "Waiting for the ingress replicas to acknowledge the route."
	}
	return c
}

// needsWrite says whether r's status differs from c (ignoring the transition time, which
// meta.SetStatusCondition keeps unless the status flips).
func needsWrite(r *tendrilv1alpha1.Route, c metav1.Condition) bool {
	old := meta.FindStatusCondition(r.Status.Conditions, c.Type)
	return old == nil || old.Status != c.Status || old.Reason != c.Reason || old.Message != c.Message ||
		old.ObservedGeneration != c.ObservedGeneration || r.Status.ObservedGeneration != r.Generation
}

func ptrOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

func joinSentences(s []string) string {
	out := s[0]
	for _, x := range s[1:] {
		out += " " + x
	}
	return out
}
