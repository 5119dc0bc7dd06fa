package controlplane_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/ingressdns"
	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// TestHighAvailability runs two control-plane instances (leader election on) and two ingress
// replicas on one API server. The ingress Service names both replicas, so a route is
// Programmed only once both acknowledged it: while one replica is held at the instance that
// is not leading (refused there), the route is served by the other yet not Programmed. The
// leader labels its Pod, which the xDS Service selects; when it stops, the other instance
// takes over, moves the label to its own Pod, both replicas reconnect, and the new leader
// writes status.
// Throughout the failover both replicas route the shoot by SNI without a single failure.
func TestHighAvailability(t *testing.T) {
	env := kubetest.Start(t)
	c := env.Client
	ctx := context.Background()
	const sys = "extension-tendril"
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: sys}}))
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "garden"}}))
	hostIP := hostIPv4(t)

	// The ingress Service and its ready endpoints, as the endpoint-slice controller publishes
	// them for two ingress Pods.
	must(t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: ingressdns.ServiceName, Namespace: sys},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "sni", Port: 443}}},
	}))
	var eps []discoveryv1.Endpoint
	for i := range 2 {
		eps = append(eps, discoveryv1.Endpoint{
			Addresses:  []string{hostIP.String()},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: sys, Name: fmt.Sprintf("ingress-%d", i)},
		})
	}
	must(t, c.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: sys, Name: "tendril-ingress-1", Labels: map[string]string{discoveryv1.LabelServiceName: ingressdns.ServiceName}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("sni"), Port: ptr.To[int32](443), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   eps,
	}))

	// A shoot with its Route, Service and a ready upstream.
	ns := "shoot--local--alpha"
	host := "api.alpha.local.example.org"
	ca, err := testpki.NewCA("controlplane HA test CA")
	must(t, err)
	leaf, err := ca.Leaf(host, "api2.alpha.local.example.org")
	must(t, err)
	upstream := tls.NewListener(listen(t, netip.AddrPortFrom(hostIP, 0).String()), &tls.Config{Certificates: []tls.Certificate{leaf}})
	testnet.Serve(t, upstream, func(c net.Conn) { fmt.Fprintln(c, "alpha") })
	up := netip.MustParseAddrPort(upstream.Addr().String())
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	must(t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "kube-apiserver", Port: 443}}},
	}))
	must(t, c.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: "kube-apiserver-1", Labels: map[string]string{discoveryv1.LabelServiceName: "kube-apiserver"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("kube-apiserver"), Port: ptr.To(int32(up.Port())), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{up.Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}))
	route := &tendrilv1alpha1.Route{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tendril"},
		Spec:       tendrilv1alpha1.RouteSpec{Hostnames: []string{host}, APIServer: tendrilv1alpha1.ServiceReference{Name: "kube-apiserver", Port: 443}},
	}
	must(t, c.Create(ctx, route))

	// Two control-plane instances, as two tendril-seed Pods would run.
	type instance struct {
		pod, addr string
		cancel    context.CancelFunc
		done      chan error
	}
	start := func(name string) *instance {
		// Its Pod, which the leader labels (no kubelet runs it: it stays Pending).
		must(t, c.Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: sys, Name: name},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "tendril-seed", Image: "example.org/tendril:test"}}},
		}))
		// An address, not a listener: an instance listens only while it leads. The port is
		// reserved for it (testnet.Reserve: refused until it listens).
		addr := testnet.Reserve(t, hostIP.String())
		ictx, cancel := context.WithCancel(context.Background())
		in := &instance{pod: name, addr: addr, cancel: cancel, done: make(chan error, 1)}
		go func() {
			in.done <- controlplane.Run(ictx, controlplane.Config{
				REST:                         env.Config,
				XDSAddress:                   addr,
				Pod:                          types.NamespacedName{Name: name},
				MetricsAddress:               "0",
				HealthAddress:                "0",
				LeaderElection:               true,
				LeaderElectionNamespace:      sys,
				WebhookPort:                  -1,
				RouteServices:                []string{"kube-apiserver", "tendril-server"},
				Extension:                    extension.AddOptions{Config: extension.Config{Image: "example.org/tendril:test", Ingress: "ingress.example.org"}},
				SeedDNS:                      ingressdns.SeedRecord{ServiceNamespace: sys},
				XDSSecrets:                   controlplane.XDSSecrets{ClientName: "ingress"}, // the replicas' node IDs are ingress-0 and ingress-1
				Registry:                     prometheus.NewRegistry(),
				SkipControllerNameValidation: true,
				Log:                          testr.New(t).WithName(name),
			})
		}()
		t.Cleanup(func() {
			cancel()
			if err := <-in.done; err != nil {
				t.Errorf("control plane %s: %v", name, err)
			}
		})
		return in
	}
	cps := []*instance{start("cp-a"), start("cp-b")}

	// The xDS Service as kube-proxy implements it: each new connection goes to a Pod the
	// Service selects at that moment (the one labelled as the xDS leader). pinned overrides it
	// for one ingress replica.
	addrOf := map[string]string{cps[0].pod: cps[0].addr, cps[1].pod: cps[1].addr}
	leader := func() (string, error) {
		var pods corev1.PodList
		if err := c.List(ctx, &pods, client.InNamespace(sys), client.MatchingLabels{tendrilv1alpha1.XDSLeaderLabel: "true"}); err != nil {
			return "", err
		}
		if len(pods.Items) != 1 {
			var names []string
			for _, p := range pods.Items {
				names = append(names, p.Name)
			}
			return "", fmt.Errorf("pods labelled as the xDS leader: %v", names)
		}
		return addrOf[pods.Items[0].Name], nil
	}
	var first string
	testwait.For(t, "the leader labels its Pod", func() (err error) {
		first, err = leader()
		return err
	})
	var lead, other *instance
	for _, in := range cps {
		if in.addr == first {
			lead = in
		} else {
			other = in
		}
	}
	if lead == nil {
		t.Fatalf("the xDS Service leads to %q, neither instance (%s, %s)", first, cps[0].addr, cps[1].addr)
	}
	if conn, err := net.Dial("tcp", other.addr); err == nil {
		conn.Close()
		t.Fatalf("the instance that is not leading accepts xDS connections")
	}

	// ingress-0 reaches xDS through the Service; ingress-1 is held at the other instance, as a
	// Service selecting every tendril-seed Pod would send it.
	var pinned atomic.Pointer[string]
	pinned.Store(&other.addr)
	svc0 := serviceProxy(t, leader)
	svc1 := serviceProxy(t, func() (string, error) {
		if p := pinned.Load(); p != nil {
			return *p, nil
		}
		return leader()
	})
	sni := make([]string, 2)
	xdsTLS := xdsClientTLS(t, c, sys) // one certificate for both replicas, as for a Deployment
	ictx, icancel := context.WithCancel(context.Background())
	idone := make(chan error, 2)
	for i, svc := range []string{svc0, svc1} {
		sl := listen(t, "127.0.0.1:0")
		sni[i] = sl.Addr().String()
		ing := ingress.New(ingress.Config{Listeners: map[string]string{"sni": sni[i]}, Log: testr.New(t).WithName(fmt.Sprintf("ingress-%d", i))})
		go func() {
			idone <- ing.Serve(ictx, map[string]net.Listener{"sni": sl}, xdsclient.Config{
				Address: svc, NodeID: fmt.Sprintf("ingress-%d", i), TLS: xdsTLS, MinBackoff: 10 * time.Millisecond, MaxBackoff: 500 * time.Millisecond,
			})
		}()
	}
	t.Cleanup(func() {
		icancel()
		for range 2 {
			if err := <-idone; err != nil {
				t.Errorf("ingress: %v", err)
			}
		}
	})

	testwait.For(t, "ingress-0 routes the shoot", func() error { return probeSNI(sni[0], host, ca) })
	if err := probeSNI(sni[1], host, ca); err == nil {
		t.Fatal("ingress-1 routes the shoot, yet it never reached the leader")
	}
	// ingress-0 acknowledged the route; ingress-1, which the ingress Service names, did not:
	// not Programmed, for longer than the leader needs to write what it knows (it writes
	// Programmed at once, Pending after a delay).
	for range 30 {
		if cond := programmed(t, c, ns); cond != nil && cond.Status == metav1.ConditionTrue {
			t.Fatalf("Programmed while ingress-1 holds nothing: %+v", cond)
		}
		time.Sleep(100 * time.Millisecond)
	}

	pinned.Store(nil)
	testwait.For(t, "ingress-1 routes the shoot", func() error { return probeSNI(sni[1], host, ca) })
	waitProgrammed(t, c, ns)

	// Both replicas are probed by SNI without pause while the leader stops.
	var probes, failures atomic.Int64
	// afterStop counts, per replica, the probes that began once the old leader had stopped:
	// the probes must span the failover, however quickly it goes.
	var afterStop [2]atomic.Int64
	var stopped atomic.Bool
	var lastErr atomic.Pointer[string]
	pctx, pstop := context.WithCancel(context.Background())
	var pwg sync.WaitGroup
	for i, addr := range sni {
		pwg.Go(func() {
			for pctx.Err() == nil {
				probes.Add(1)
				if stopped.Load() {
					afterStop[i].Add(1)
				}
				if err := probeSNI(addr, host, ca); err != nil {
					failures.Add(1)
					msg := err.Error()
					lastErr.Store(&msg)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	lead.cancel()
	if err := <-lead.done; err != nil {
		t.Errorf("stopping the leader: %v", err)
	}
	lead.done <- nil // for its cleanup
	stopped.Store(true)
	// Its Pod stays, labelled, as after a container restart: the new leader takes the label off.
	testwait.For(t, "the other instance takes over the xDS Service", func() error {
		addr, err := leader()
		if err != nil {
			return err
		}
		if addr != other.addr {
			return fmt.Errorf("the xDS Service leads to %s, not %s", addr, other.addr)
		}
		return nil
	})
	// A change after the failover reaches both replicas, and the new leader reports it.
	must(t, c.Get(ctx, client.ObjectKeyFromObject(route), route))
	route.Spec.Hostnames = append(route.Spec.Hostnames, "api2.alpha.local.example.org")
	must(t, c.Update(ctx, route))
	for i := range sni {
		testwait.For(t, fmt.Sprintf("ingress-%d routes the new name", i), func() error {
			return probeSNI(sni[i], "api2.alpha.local.example.org", ca)
		})
	}
	waitProgrammed(t, c, ns)
	pstop()
	pwg.Wait()
	if n := failures.Load(); n > 0 {
		t.Errorf("%d of %d SNI probes failed during the failover, the last: %s", n, probes.Load(), *lastErr.Load())
	}
	for i := range afterStop {
		if afterStop[i].Load() == 0 {
			t.Errorf("ingress-%d was not probed after the leader stopped", i)
		}
	}
	t.Logf("%d SNI probes through the two replicas during the failover, %d failed", probes.Load(), failures.Load())
}

// programmed is the Route tendril in ns's Programmed condition, if it is about its generation.
func programmed(t *testing.T, c client.Client, ns string) *metav1.Condition {
	t.Helper()
	r := &tendrilv1alpha1.Route{}
	must(t, c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "tendril"}, r))
	if r.Status.ObservedGeneration != r.Generation {
		return nil
	}
	cond := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed)
	if cond == nil || cond.ObservedGeneration != r.Generation {
		return nil
	}
	return cond
}

func waitProgrammed(t *testing.T, c client.Client, ns string) {
	t.Helper()
	testwait.For(t, "route programmed", func() error {
		if cond := programmed(t, c, ns); cond == nil || cond.Status != metav1.ConditionTrue {
			return fmt.Errorf("condition %+v", cond)
		}
		return nil
	})
}

// probeSNI opens TLS to name through the ingress's SNI listener and reads the upstream's answer.
func probeSNI(addr, name string, ca *testpki.CA) error {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{ServerName: name, RootCAs: ca.Pool})
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(conn)
	if err != nil {
		return err
	}
	if strings.TrimSpace(string(b)) != "alpha" {
		return fmt.Errorf("upstream said %q", b)
	}
	return nil
}

// serviceProxy plays kube-proxy for one Service: it forwards each connection to the address
// target names when the connection arrives, and closes it when there is none or it refuses.
func serviceProxy(t *testing.T, target func() (string, error)) string {
	t.Helper()
	return testnet.Forward(t, func() (net.Conn, error) {
		addr, err := target()
		if err != nil {
			return nil, err
		}
		return net.DialTimeout("tcp", addr, 5*time.Second)
	}, splice)
}

// splice copies src to dst, then closes both: a backend that goes away ends the client's
// connection too, as it does through kube-proxy.
func splice(dst, src net.Conn) {
	_, _ = io.Copy(dst, src) // either side ending is the normal end here
	dst.Close()
	src.Close()
}
