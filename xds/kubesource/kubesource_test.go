package kubesource_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/kubesource"
	"github.com/tendril-net/tendril/xds/model"
	xdsserver "github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/translate"
)

// seed is one loopback seed on a real API server: the xDS server fed by the Kubernetes source
// in a controller-runtime manager, and an in-process tendril-ingress subscribed to it.
type seed struct {
	t       *testing.T
	env     *kubetest.Env
	ca      *testpki.CA
	sni     string
	xdsReg  *prometheus.Registry
	srcReg  *prometheus.Registry
	ingress *ingress.Ingress
	xds     *xdsserver.Server
	hostIP  netip.Addr
	hostIP6 netip.Addr
	// cache is the manager's cache the source reads.
	cache cache.Cache
}

// watched are the Services the test seed's Routes may name (kubesource.Config.Services).
var watched = []string{"kube-apiserver", "tendril-server"}

// ingressStatus is the xDS server's view of what the ingress acknowledged for shoot ns.
func (s *seed) ingressStatus(ns string) model.State { return s.xds.ShootStatus(ns).State }

// startSeed starts a seed; without an ingress when pendingDelay is set (the test is then about
// routes nothing acknowledges), otherwise with one and a long pending delay.
func startSeed(t *testing.T, pendingDelay time.Duration) *seed {
	t.Helper()
	return startSeedGrace(t, pendingDelay, pendingDelay)
}

// startSeedGrace is startSeed with Config.ReconnectGrace set to grace.
func startSeedGrace(t *testing.T, pendingDelay, grace time.Duration) *seed {
	t.Helper()
	hostIP, hostIP6 := hostAddrs(t)
	env := kubetest.Start(t)
	ca, err := testpki.NewCA("kubesource test CA")
	if err != nil {
		t.Fatal(err)
	}
	s := &seed{t: t, env: env, ca: ca, xdsReg: prometheus.NewRegistry(), srcReg: prometheus.NewRegistry(), hostIP: hostIP, hostIP6: hostIP6}
	log := testr.New(t)
	// controller-runtime's global logger, for what runs outside the manager's; its informers
	// may log after the test, where a testr logger must not be used.
	ctrllog.SetLogger(logr.Discard())
	xs := xdsserver.New(xdsserver.Config{Log: log.WithName("xds"), Registry: s.xdsReg})
	s.xds = xs
	byObject, err := kubesource.CacheByObject(watched)
	if err != nil {
		t.Fatal(err)
	}
	mgr, err := manager.New(env.Config, manager.Options{
		Scheme:                 env.Scheme,
		Logger:                 log.WithName("manager"),
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{ByObject: byObject},
	})
	if err != nil {
		t.Fatal(err)
	}
	s.cache = mgr.GetCache()
	withIngress := pendingDelay == 0
	if withIngress {
		// A long pending delay: a route acknowledged at all is written once, as Programmed,
		// which the test counts.
		pendingDelay = time.Minute
	}
	if err := kubesource.Add(mgr, kubesource.Config{Server: xs, Log: testr.NewWithOptions(t, testr.Options{Verbosity: 1}).WithName("kubesource"), Registry: s.srcReg, PendingDelay: pendingDelay, ReconnectGrace: grace, Services: watched}); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	xl, sl := testnet.Listen(t), testnet.Listen(t)
	s.sni = sl.Addr().String()
	s.ingress = ingress.New(ingress.Config{Listeners: map[string]string{"sni": s.sni}, Log: log.WithName("ingress")})
	runs := map[string]func() error{
		"xds":     func() error { return xs.Serve(ctx, xl) },
		"manager": func() error { return mgr.Start(ctx) },
	}
	if withIngress {
		runs["ingress"] = func() error {
			return s.ingress.Serve(ctx, map[string]net.Listener{"sni": sl}, xdsclient.Config{
				Address: xl.Addr().String(), NodeID: "ingress-0", MinBackoff: 10 * time.Millisecond,
			})
		}
	} else {
		sl.Close()
	}
	for name, run := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(); err != nil && ctx.Err() == nil {
				t.Errorf("%s: %v", name, err)
			}
		}()
	}
	return s
}

// hostAddrs are addresses of this machine that an EndpointSlice may carry, the IPv4 one first:
// the API server refuses loopback and link-local endpoint addresses, so the upstreams listen on
// global ones. The IPv6 one is invalid if there is none.
func hostAddrs(t *testing.T) (v4, v6 netip.Addr) {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil {
			continue
		}
		ip := p.Addr()
		switch {
		case ip.IsLoopback() || ip.IsLinkLocalUnicast():
		case ip.Is4() && !v4.IsValid():
			v4 = ip
		case ip.Is6() && !v6.IsValid():
			v6 = ip
		}
	}
	if !v4.IsValid() {
		t.Skip("no non-loopback IPv4 address for the upstreams (EndpointSlices refuse loopback)")
	}
	return v4, v6
}

// upstream is a TLS server standing in for one kube-apiserver replica: it answers "who" with its
// name.
func (s *seed) upstream(name, host string) netip.AddrPort {
	s.t.Helper()
	return s.upstreamAt(name, host, netip.AddrPortFrom(s.hostIP, 0))
}

// upstreamAt is upstream on a given address.
func (s *seed) upstreamAt(name, host string, addr netip.AddrPort) netip.AddrPort {
	s.t.Helper()
	cert, err := s.ca.Leaf(host)
	if err != nil {
		s.t.Fatal(err)
	}
	l, err := net.Listen("tcp", addr.String())
	if err != nil {
		s.t.Fatal(err)
	}
	tl := tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}})
	testnet.Serve(s.t, tl, func(c net.Conn) {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if line, err := bufio.NewReader(c).ReadString('\n'); err == nil && strings.TrimSpace(line) == "who" {
			fmt.Fprintln(c, name)
		}
	})
	return netip.MustParseAddrPort(l.Addr().String())
}

// who asks through the ingress which upstream a server name reaches, verifying its certificate.
func (s *seed) who(host string) (string, error) {
	c, err := net.DialTimeout("tcp", s.sni, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	tc := tls.Client(c, &tls.Config{ServerName: host, RootCAs: s.ca.Pool})
	if err := tc.Handshake(); err != nil {
		return "", err
	}
	fmt.Fprintln(tc, "who")
	b, err := io.ReadAll(tc)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

const portName = "https"

// shoot creates a shoot namespace with a kube-apiserver Service, an EndpointSlice with the given
// endpoints (as the endpoint-slice controller would write it) and a Route for host.
func (s *seed) shoot(ns, host string, endpoints ...netip.AddrPort) {
	s.t.Helper()
	ctx := context.Background()
	c := s.env.Client
	must(s.t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	must(s.t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "kube-apiserver"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{
			{Name: "metrics", Port: 8080},
			{Name: portName, Port: 443},
		}},
	}))
	for _, es := range endpointSlices(ns, endpoints...) {
		must(s.t, c.Create(ctx, es))
	}
	s.route(ns, "shoot", host, "kube-apiserver", 443)
}

// route creates a Route named name in ns for host, to the Service svc's port.
func (s *seed) route(ns, name, host, svc string, port int32) {
	s.t.Helper()
	must(s.t, s.env.Client.Create(context.Background(), &tendrilv1alpha1.Route{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: tendrilv1alpha1.RouteSpec{
			Hostnames: []string{host},
			APIServer: tendrilv1alpha1.ServiceReference{Name: svc, Port: port},
		},
	}))
}

// endpointSlices are the kube-apiserver Service's slices, one per address family as the
// endpoint-slice controller writes them: the endpoints ready on the named port (all endpoints
// share the port), plus an endpoint that is not ready and a port of another name, which must both
// be ignored.
func endpointSlices(ns string, endpoints ...netip.AddrPort) []*discoveryv1.EndpointSlice {
	var out []*discoveryv1.EndpointSlice
	for _, family := range []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6} {
		es := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: ns, Name: "kube-apiserver-" + strings.ToLower(string(family)),
				Labels: map[string]string{discoveryv1.LabelServiceName: "kube-apiserver", discoveryv1.LabelManagedBy: "endpointslice-controller.k8s.io"},
			},
			AddressType: family,
			Ports: []discoveryv1.EndpointPort{
				{Name: ptr.To("metrics"), Port: ptr.To[int32](1), Protocol: ptr.To(corev1.ProtocolTCP)},
				{Name: ptr.To(portName), Port: ptr.To(int32(endpoints[0].Port())), Protocol: ptr.To(corev1.ProtocolTCP)},
			},
		}
		for _, e := range endpoints {
			if e.Addr().Is4() == (family == discoveryv1.AddressTypeIPv4) {
				es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{e.Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}})
			}
		}
		if len(es.Endpoints) == 0 {
			continue
		}
		unready := "192.0.2.254"
		if family == discoveryv1.AddressTypeIPv6 {
			unready = "2001:db8::fe"
		}
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{unready}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(false)}})
		out = append(out, es)
	}
	return out
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// programmed checks the Route's Programmed condition and observedGeneration.
func (s *seed) condition(ns string) (*tendrilv1alpha1.Route, *metav1.Condition, error) {
	var r tendrilv1alpha1.Route
	if err := s.env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "shoot"}, &r); err != nil {
		return nil, nil, err
	}
	return &r, meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed), nil
}

func (s *seed) waitCondition(ns, reason string) *tendrilv1alpha1.Route {
	s.t.Helper()
	var route *tendrilv1alpha1.Route
	testwait.For(s.t, ns+" "+reason, func() error {
		r, c, err := s.condition(ns)
		switch {
		case err != nil:
			return err
		case c == nil:
			return errors.New("no Programmed condition")
		case c.Reason != reason || c.ObservedGeneration != r.Generation || r.Status.ObservedGeneration != r.Generation:
			return fmt.Errorf("condition %+v, observedGeneration %d, generation %d", c, r.Status.ObservedGeneration, r.Generation)
		}
		route = r
		return nil
	})
	return route
}

// TestRoutesFromKubernetes drives the whole Kubernetes path against a real API server: Routes,
// Services and EndpointSlices in two shoot namespaces → kubesource → xDS → tendril-ingress → each
// shoot's own TLS upstream; Programmed conditions; an EndpointSlice change that sends one
// assignment; a Route without its Service; a deleted Route.
func TestRoutesFromKubernetes(t *testing.T) {
	s := startSeed(t, 0)
	ctx := context.Background()
	alpha, beta := "shoot--t--alpha", "shoot--t--beta"
	s.shoot(alpha, "api.alpha.test", s.upstream("alpha-0", "api.alpha.test"))
	// beta has two kube-apiserver replicas on the same port, one per address family (this
	// machine has one address of each), and so two EndpointSlices.
	betaEndpoints := []netip.AddrPort{s.upstream("beta-0", "api.beta.test")}
	if s.hostIP6.IsValid() {
		betaEndpoints = append(betaEndpoints, s.upstreamAt("beta-1", "api.beta.test", netip.AddrPortFrom(s.hostIP6, betaEndpoints[0].Port())))
	}
	s.shoot(beta, "api.beta.test", betaEndpoints...)

	for host, want := range map[string][]string{"api.alpha.test": {"alpha-0"}, "api.beta.test": {"beta-0", "beta-1"}} {
		testwait.For(t, host+" reaches its upstream", func() error {
			got, err := s.who(host)
			if err != nil {
				return err
			}
			for _, w := range want {
				if got == w {
					return nil
				}
			}
			return fmt.Errorf("reached %q, want one of %v", got, want)
		})
	}
	s.waitCondition(alpha, tendrilv1alpha1.ReasonProgrammed)
	s.waitCondition(beta, tendrilv1alpha1.ReasonProgrammed)
	if got := metrictest.Sum(t, s.srcReg, "tendril_kubesource_routes", map[string]string{"state": tendrilv1alpha1.ReasonProgrammed}); got != 2 {
		t.Errorf("routes gauge: %v programmed, want 2", got)
	}

	// Both replicas of beta are used (round robin across the assignment's endpoints).
	seen := map[string]bool{}
	testwait.For(t, "every beta replica reached", func() error {
		got, err := s.who("api.beta.test")
		if err != nil {
			return err
		}
		seen[got] = true
		if len(seen) < len(betaEndpoints) {
			return fmt.Errorf("reached only %v", seen)
		}
		return nil
	})

	// Move alpha to a new replica: traffic follows, exactly one assignment is sent and nothing
	// else, and the Route's status is not written (its generation did not change and it is
	// programmed again as soon as the ingress ACKs).
	writes := metrictest.Sum(t, s.srcReg, "tendril_kubesource_status_writes_total", map[string]string{"outcome": "written"})
	sent := func(typ string) float64 {
		return metrictest.Sum(t, s.xdsReg, "tendril_xds_resources_sent_total", map[string]string{"protocol": "delta", "type": typ})
	}
	clusters, assignments := sent("type.googleapis.com/envoy.config.cluster.v3.Cluster"), sent("type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment")
	var es discoveryv1.EndpointSlice
	must(t, s.env.Client.Get(ctx, client.ObjectKey{Namespace: alpha, Name: "kube-apiserver-ipv4"}, &es))
	next := endpointSlices(alpha, s.upstream("alpha-1", "api.alpha.test"))[0]
	es.Endpoints, es.Ports = next.Endpoints, next.Ports
	must(t, s.env.Client.Update(ctx, &es))
	testwait.For(t, "alpha moved to its new replica", func() error {
		got, err := s.who("api.alpha.test")
		if err != nil || got != "alpha-1" {
			return fmt.Errorf("reached %q (%v), want alpha-1", got, err)
		}
		return nil
	})
	testwait.For(t, "the ingress ACKed the move", func() error {
		if st := s.ingressStatus(alpha); st != model.StateProgrammed {
			return fmt.Errorf("server state %s", st)
		}
		return nil
	})
	if got := sent("type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment") - assignments; got != 1 {
		t.Errorf("the EndpointSlice change sent %v assignments, want 1", got)
	}
	if got := sent("type.googleapis.com/envoy.config.cluster.v3.Cluster") - clusters; got != 0 {
		t.Errorf("the EndpointSlice change sent %v clusters, want 0", got)
	}
	s.waitCondition(alpha, tendrilv1alpha1.ReasonProgrammed)
	if got := metrictest.Sum(t, s.srcReg, "tendril_kubesource_status_writes_total", map[string]string{"outcome": "written"}) - writes; got != 0 {
		t.Errorf("the EndpointSlice change wrote %v statuses, want 0", got)
	}

	// A spec change (one more server name) is one status write: Programmed at the new generation.
	writes = metrictest.Sum(t, s.srcReg, "tendril_kubesource_status_writes_total", map[string]string{"outcome": "written"})
	var r tendrilv1alpha1.Route
	must(t, s.env.Client.Get(ctx, client.ObjectKey{Namespace: beta, Name: "shoot"}, &r))
	r.Spec.Hostnames = append(r.Spec.Hostnames, "api2.beta.test")
	must(t, s.env.Client.Update(ctx, &r))
	testwait.For(t, "beta's new name routed", func() error {
		got, err := s.whoInsecure("api2.beta.test")
		if err != nil || !strings.HasPrefix(got, "beta-") {
			return fmt.Errorf("reached %q (%v)", got, err)
		}
		return nil
	})
	if got := s.waitCondition(beta, tendrilv1alpha1.ReasonProgrammed); got.Generation != 2 {
		t.Errorf("beta generation %d after one spec change", got.Generation)
	}
	// The counter moves right after the write returns, which may be after the status is visible.
	var written float64
	testwait.For(t, "status write counted", func() error {
		if written = metrictest.Sum(t, s.srcReg, "tendril_kubesource_status_writes_total", map[string]string{"outcome": "written"}) - writes; written < 1 {
			return errors.New("not yet")
		}
		return nil
	})
	if written != 1 {
		t.Errorf("the spec change wrote %v statuses, want 1", written)
	}

	// A second Route in beta's namespace is Invalid; the first keeps routing it. (Creation
	// times have a resolution of a second; within one, the name decides, hence "x-".)
	s.route(beta, "x-second", "api3.beta.test", "kube-apiserver", 443)
	testwait.For(t, "second Route in a namespace invalid", func() error {
		var r tendrilv1alpha1.Route
		if err := s.env.Client.Get(ctx, client.ObjectKey{Namespace: beta, Name: "x-second"}, &r); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed); c == nil || c.Reason != tendrilv1alpha1.ReasonInvalid || !strings.Contains(c.Message, "routed by Route shoot") {
			return fmt.Errorf("condition %+v", c)
		}
		return nil
	})
	if _, c, _ := s.condition(beta); c == nil || c.Reason != tendrilv1alpha1.ReasonProgrammed {
		t.Errorf("beta's first Route after a second one: %+v", c)
	}

	// A Route whose Service does not exist: NoEndpoints with the reason; the others still route.
	gamma := "shoot--t--gamma"
	must(t, s.env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: gamma}}))
	s.route(gamma, "shoot", "api.gamma.test", "kube-apiserver", 443)
	s.waitCondition(gamma, tendrilv1alpha1.ReasonNoEndpoints)
	if _, c, _ := s.condition(gamma); c == nil || !strings.Contains(c.Message, "Service kube-apiserver not found") {
		t.Errorf("gamma condition %+v, want the missing Service named", c)
	}
	if _, err := s.who("api.gamma.test"); err == nil {
		t.Error("a Route without endpoints accepted a connection")
	}
	// A Route claiming a server name another, older Route has is Invalid; the older keeps it.
	delta := "shoot--t--delta"
	must(t, s.env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: delta}}))
	s.route(delta, "shoot", "api.alpha.test", "kube-apiserver", 443)
	s.waitCondition(delta, tendrilv1alpha1.ReasonInvalid)
	if got, err := s.who("api.alpha.test"); err != nil || got != "alpha-1" {
		t.Errorf("alpha after a conflicting Route: %q (%v)", got, err)
	}

	// Deleting alpha's Route withdraws its route: new connections are refused.
	must(t, s.env.Client.Delete(ctx, &tendrilv1alpha1.Route{ObjectMeta: metav1.ObjectMeta{Namespace: alpha, Name: "shoot"}}))
	testwait.For(t, "alpha withdrawn", func() error {
		if got, err := s.who("api.alpha.test"); err == nil {
			// delta's Route may now win the name; it has no endpoints, so nothing answers.
			return fmt.Errorf("still reached %q", got)
		}
		return nil
	})
	// The name is free: delta's Route now holds it (and has no Service).
	s.waitCondition(delta, tendrilv1alpha1.ReasonNoEndpoints)
	if got, err := s.who("api.beta.test"); err != nil || !strings.HasPrefix(got, "beta-") {
		t.Errorf("beta after alpha's removal: %q (%v)", got, err)
	}
}

// whoInsecure is who for a name the upstream's certificate does not carry.
func (s *seed) whoInsecure(host string) (string, error) {
	c, err := net.DialTimeout("tcp", s.sni, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	tc := tls.Client(c, &tls.Config{ServerName: host, InsecureSkipVerify: true, VerifyConnection: func(cs tls.ConnectionState) error {
		_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: s.ca.Pool})
		return err
	}})
	if err := tc.Handshake(); err != nil {
		return "", err
	}
	fmt.Fprintln(tc, "who")
	b, _ := io.ReadAll(tc)
	return strings.TrimSpace(string(b)), nil
}

// TestPendingWithoutIngress: with no data plane connected a route is not programmed; after the
// pending delay that is written as Pending.
func TestPendingWithoutIngress(t *testing.T) {
	s := startSeed(t, 100*time.Millisecond)
	s.shoot("shoot--t--alpha", "api.alpha.test", s.upstream("alpha-0", "api.alpha.test"))
	s.waitCondition("shoot--t--alpha", tendrilv1alpha1.ReasonPending)
	if _, c, _ := s.condition("shoot--t--alpha"); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "ingress replicas") {
		t.Errorf("condition %+v, want False waiting for the ingress replicas", c)
	}
}

// TestPendingAfterReconnectGrace: a source that has just started leading writes Pending only
// once the ingress replicas had ReconnectGrace to come back, not after PendingDelay.
func TestPendingAfterReconnectGrace(t *testing.T) {
	const grace = 4 * time.Second
	s := startSeedGrace(t, 100*time.Millisecond, grace)
	s.shoot("shoot--t--alpha", "api.alpha.test", s.upstream("alpha-0", "api.alpha.test"))
	r := s.waitCondition("shoot--t--alpha", tendrilv1alpha1.ReasonPending)
	_, c, err := s.condition("shoot--t--alpha")
	if err != nil {
		t.Fatal(err)
	}
	// The manager leads from its start, before the Route was created; the condition's time has
	// a resolution of one second.
	if d := c.LastTransitionTime.Sub(r.CreationTimestamp.Time); d < grace-time.Second {
		t.Errorf("Pending written %v after the Route was created, within the grace of %v", d, grace)
	}
}

// TestWatchesOnlyNamedServices: the cache holds the EndpointSlices of the Services Routes may
// name and no others, and a Route naming another Service says why it has no endpoints.
func TestWatchesOnlyNamedServices(t *testing.T) {
	s := startSeed(t, time.Minute)
	ctx := context.Background()
	ns := "shoot--t--slices"
	must(t, s.env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	slice := func(service string) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: service + "-x", Labels: map[string]string{discoveryv1.LabelServiceName: service}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{s.hostIP.String()}}},
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("x"), Port: ptr.To[int32](2379), Protocol: ptr.To(corev1.ProtocolTCP)}},
		}
	}
	// etcd's slice first: one informer delivers in order, so once kube-apiserver's (created
	// after it) is in the cache, etcd's would be too if it were watched.
	must(t, s.env.Client.Create(ctx, slice("etcd-main")))
	must(t, s.env.Client.Create(ctx, slice("kube-apiserver")))
	count := func(c client.Reader, service string) int {
		var list discoveryv1.EndpointSliceList
		must(t, c.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{discoveryv1.LabelServiceName: service}))
		return len(list.Items)
	}
	testwait.For(t, "kube-apiserver's slice in the cache", func() error {
		if n := count(s.cache, "kube-apiserver"); n != 1 {
			return fmt.Errorf("%d slices", n)
		}
		return nil
	})
	if n, inAPI := count(s.cache, "etcd-main"), count(s.env.Client, "etcd-main"); n != 0 || inAPI != 1 {
		t.Errorf("etcd-main's slices: %d cached, %d in the API server; want none cached", n, inAPI)
	}

	s.route(ns, "shoot", "api.slices.test", "etcd-main", 2379)
	s.waitCondition(ns, tendrilv1alpha1.ReasonNoEndpoints)
	if _, c, _ := s.condition(ns); c == nil || !strings.Contains(c.Message, "Service etcd-main is not one whose endpoints tendril-seed watches (kube-apiserver, tendril-server)") {
		t.Errorf("condition %+v, want the unwatched Service named", c)
	}
}

// TestConfig: a Server is required, a source is not ready before it published, and the
// watched Services must be valid names.
func TestConfig(t *testing.T) {
	if _, err := kubesource.New(kubesource.Config{}, nil, nil, nil); err == nil {
		t.Error("a source without a Server was created")
	}
	s, err := kubesource.New(kubesource.Config{Server: xdsserver.New(xdsserver.Config{})}, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Ready(nil); err == nil {
		t.Error("ready before the first publish")
	}
	// The Service names come from a flag: one that cannot be a label value is an error.
	if _, err := kubesource.CacheByObject([]string{"kube-apiserver", "not a service!"}); err == nil {
		t.Error("an invalid Service name made a cache selector")
	}
	by, err := kubesource.CacheByObject(nil)
	if err != nil || len(by) != 1 {
		t.Fatalf("no Services: %v, %v; want every EndpointSlice and only labelled Secrets", by, err)
	}
	for obj, b := range by {
		if _, ok := obj.(*corev1.Secret); !ok || b.Label.String() != tendrilv1alpha1.TerminationSecretLabel+"=true" {
			t.Errorf("no Services: %T narrowed by %v; want only Secrets, by their termination label", obj, b.Label)
		}
	}
}

// TestTunnelReplicas: the endpoints of the tunnel Service that carry a hostname (an HA shoot's
// tendril-server StatefulSet pods) become a cluster each, named as the pod, beside the
// Service-wide one; an endpoint without a hostname and one not ready become none.
func TestTunnelReplicas(t *testing.T) {
	s := startSeed(t, time.Minute)
	ctx := context.Background()
	ns := "shoot--t--ha"
	s.shoot(ns, "api.ha.test", s.upstream("ha-0", "api.ha.test"))
	must(t, s.env.Client.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tendril-server"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "tunnel", Port: 1194}}},
	}))
	ep := func(ip, host string, ready bool) discoveryv1.Endpoint {
		e := discoveryv1.Endpoint{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready)}}
		if host != "" {
			e.Hostname = ptr.To(host)
		}
		return e
	}
	ip := func(last byte) string { a := s.hostIP.As4(); a[3] = last; return netip.AddrFrom4(a).String() }
	must(t, s.env.Client.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: "tendril-server-x", Labels: map[string]string{discoveryv1.LabelServiceName: "tendril-server"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("tunnel"), Port: ptr.To[int32](1194), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   []discoveryv1.Endpoint{ep(ip(201), "tendril-server-1", true), ep(ip(200), "tendril-server-0", true), ep(ip(202), "", true), ep(ip(203), "tendril-server-2", false)},
	}))
	var r tendrilv1alpha1.Route
	must(t, s.env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "shoot"}, &r))
	r.Spec.TunnelServer = &tendrilv1alpha1.ServiceReference{Name: "tendril-server", Port: 1194}
	must(t, s.env.Client.Update(ctx, &r))
	want := []string{translate.TendrilServerReplicaWireName(ns, "tendril-server-0"), translate.TendrilServerReplicaWireName(ns, "tendril-server-1"), translate.TendrilServerWireName(ns)}
	testwait.For(t, "the replicas' clusters", func() error {
		var got []string
		for _, c := range s.xds.Resources(resourcev3.ClusterType) {
			if strings.Contains(c, "1194||tendril-server") && strings.Contains(c, ns) {
				got = append(got, c)
			}
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("clusters %q, want %q", got, want)
		}
		return nil
	})
	endpoints := s.xds.Resources(resourcev3.EndpointType)
	for _, h := range []string{"tendril-server-0", "tendril-server-1"} {
		if !slices.Contains(endpoints, translate.VPNReplicaService(ns, h)) {
			t.Errorf("no assignment %s in %q", translate.VPNReplicaService(ns, h), endpoints)
		}
	}
}
