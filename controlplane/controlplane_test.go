package controlplane_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
	"github.com/tendril-net/tendril/controlplane"
	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/ingressdns"
	"github.com/tendril-net/tendril/ingress"
	"github.com/tendril-net/tendril/ingress/xdsclient"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// TestControlPlane runs the whole control plane against a real API server with tendril-ingress
// subscribed to it: a shoot's Extension ends in a Route that the route source reports on
// (Programmed=False, NoEndpoints, until kube-apiserver has a ready endpoint), then, with an
// EndpointSlice, Programmed=True and the ingress routes the shoot's name to its API server;
// the gardener-extension-heartbeat Lease is created and renewed, as gardenlet expects.
func TestControlPlane(t *testing.T) {
	env := kubetest.Start(t)
	c := env.Client
	ctx, cancel := context.WithCancel(context.Background())
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "extension-tendril"}}))
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "garden"}}))
	xl, sl := listen(t, "127.0.0.1:0"), listen(t, "127.0.0.1:0")
	// The API server's own informers watch Secrets and ConfigMaps too; the control plane's
	// watches are what it adds to these.
	baseline := apiserverWatches(t, env.Config)
	done := make(chan error, 2)
	go func() {
		done <- controlplane.Run(ctx, controlplane.Config{
			REST:               env.Config,
			XDSListener:        xl,
			MetricsAddress:     "0",
			HealthAddress:      "0",
			HeartbeatNamespace: "extension-tendril",
			HeartbeatInterval:  1,
			WebhookPort:        -1, // the webhook has its own envtest in extension/egresswebhook
			RouteServices:      []string{"kube-apiserver", "tendril-server"},
			Extension:          extension.AddOptions{Config: extension.Config{Image: "example.org/tendril:test", Ingress: "ingress.example.org"}},
			SeedDNS:            ingressdns.SeedRecord{Name: "tendril.seed.example.org", Type: "local", SecretName: "seed-ingress", ServiceNamespace: "extension-tendril"},
			XDSSecrets:         controlplane.XDSSecrets{Namespace: "extension-tendril"},
			Log:                testr.New(t),
		})
	}()
	// The shared ingress, subscribed to the control plane's xDS over mutual TLS with the client
	// certificate the control plane published, as the chart mounts it.
	ing := ingress.New(ingress.Config{Listeners: map[string]string{"sni": sl.Addr().String()}, Log: testr.New(t).WithName("ingress")})
	xdsTLS := xdsClientTLS(t, c, "extension-tendril")
	go func() {
		done <- ing.Serve(ctx, map[string]net.Listener{"sni": sl}, xdsclient.Config{Address: xl.Addr().String(), NodeID: "tendril-ingress-0", TLS: xdsTLS, MinBackoff: 10 * time.Millisecond})
	}()
	t.Cleanup(func() {
		cancel()
		for range 2 {
			if err := <-done; err != nil && ctx.Err() == nil {
				t.Errorf("control plane or ingress: %v", err)
			}
		}
	})
	ns := "shoot--local--alpha"
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{"gardener.cloud/role": "shoot"}}}))
	must(t, c.Create(ctx, &extensionsv1alpha1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: ns},
		Spec: extensionsv1alpha1.ClusterSpec{
			CloudProfile: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"CloudProfile"}`)},
			Seed:         &runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Seed"}`)},
			Shoot: runtime.RawExtension{Raw: []byte(`{"apiVersion":"core.gardener.cloud/v1beta1","kind":"Shoot",
				"metadata":{"name":"alpha","namespace":"garden-local"},
				"spec":{"dns":{"domain":"alpha.local.example.org"},"networking":{"nodes":"10.250.0.0/16","pods":"100.64.0.0/12","services":"100.104.0.0/13"}}}`)},
		},
	}))
	must(t, c.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver", Namespace: ns},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "kube-apiserver", Port: 443}}},
	}))
	must(t, c.Create(ctx, &extensionsv1alpha1.Extension{
		ObjectMeta: metav1.ObjectMeta{Name: "tendril", Namespace: ns},
		Spec:       extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: extension.Type}},
	}))
	testwait.For(t, "route reported on", func() error {
		r := &tendrilv1alpha1.Route{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril"}, r); err != nil {
			return err
		}
		cond := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed)
		if cond == nil || r.Status.ObservedGeneration != r.Generation {
			return fmt.Errorf("route status %+v", r.Status)
		}
		if cond.Status != metav1.ConditionFalse || cond.Reason != tendrilv1alpha1.ReasonNoEndpoints {
			return fmt.Errorf("Programmed %s/%s: %s", cond.Status, cond.Reason, cond.Message)
		}
		return nil
	})

	// kube-apiserver and tendril-server get ready endpoints, as the endpoint-slice controller
	// would publish them: the route is programmed into the ingress, which now reaches the
	// shoot's API server by SNI.
	ca, err := testpki.NewCA("controlplane test CA")
	must(t, err)
	host := "api.alpha.local.example.org"
	leaf, err := ca.Leaf(host)
	must(t, err)
	upstream := tls.NewListener(listen(t, netip.AddrPortFrom(hostIPv4(t), 0).String()), &tls.Config{Certificates: []tls.Certificate{leaf}})
	testnet.Serve(t, upstream, func(c net.Conn) { fmt.Fprintln(c, "alpha") })
	up := netip.MustParseAddrPort(upstream.Addr().String())
	must(t, c.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: "kube-apiserver-1", Labels: map[string]string{discoveryv1.LabelServiceName: "kube-apiserver"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("kube-apiserver"), Port: ptr.To(int32(up.Port())), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{up.Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}))
	// tendril-server's endpoint (the route's tunnel upstream; nothing dials it in this test).
	must(t, c.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: "tendril-server-1", Labels: map[string]string{discoveryv1.LabelServiceName: "tendril-server"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("tunnel"), Port: ptr.To[int32](1194), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{up.Addr().String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}))
	testwait.For(t, "route programmed", func() error {
		r := &tendrilv1alpha1.Route{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril"}, r); err != nil {
			return err
		}
		if cond := meta.FindStatusCondition(r.Status.Conditions, tendrilv1alpha1.ConditionProgrammed); cond == nil || cond.Status != metav1.ConditionTrue || r.Status.ObservedGeneration != r.Generation {
			return fmt.Errorf("route status %+v", r.Status)
		}
		return nil
	})
	testwait.For(t, "TLS through the ingress by SNI", func() error { return probeSNI(sl.Addr().String(), host, ca) })

	// The extension reconciled the shoot (its secrets manager listed and wrote Secrets), yet the
	// control plane watches no ConfigMaps and Secrets only once, the route source's watch of
	// termination Secrets, by label (kubesource.CacheByObject; TestTerminationFromSecret shows
	// an unlabelled one is not cached): a cache of all would hold every shoot's credentials in
	// the seed. Its Deployments watch shows the metric counts watches at all.
	watches := apiserverWatches(t, env.Config)
	for r, allowed := range map[string]float64{"secrets": 1, "configmaps": 0} {
		if n := watches[r] - baseline[r]; n > allowed {
			t.Errorf("the control plane opened %v watches on %s, want at most %v; the extension must read them uncached", n, r, allowed)
		}
	}
	if watches["deployments"] <= baseline["deployments"] {
		t.Errorf("no watch on deployments counted (%v): the check above proves nothing", watches)
	}

	// The seed-level DNSRecord follows the ingress Service's load balancer (its cache is
	// limited to garden, where it lives).
	ingressSvc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: ingressdns.ServiceName, Namespace: "extension-tendril"},
		Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Ports: []corev1.ServicePort{{Name: "sni", Port: 443}}},
	}
	must(t, c.Create(ctx, ingressSvc))
	ingressSvc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: "203.0.113.10"}}
	must(t, c.Status().Update(ctx, ingressSvc))
	testwait.For(t, "seed DNS record", func() error {
		r := &extensionsv1alpha1.DNSRecord{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: "garden", Name: ingressdns.RecordName}, r); err != nil {
			return err
		}
		if r.Spec.Name != "tendril.seed.example.org" || r.Spec.Type != "local" || r.Spec.RecordType != "A" || !slices.Equal(r.Spec.Values, []string{"203.0.113.10"}) {
			return fmt.Errorf("record %+v", r.Spec)
		}
		return nil
	})

	var first time.Time
	testwait.For(t, "heartbeat renewed twice", func() error {
		l := &coordinationv1.Lease{}
		if err := c.Get(ctx, client.ObjectKey{Namespace: "extension-tendril", Name: "gardener-extension-heartbeat"}, l); err != nil {
			return err
		}
		if l.Spec.RenewTime == nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != extension.Type {
			return fmt.Errorf("lease %+v", l.Spec)
		}
		if first.IsZero() {
			first = l.Spec.RenewTime.Time
			return fmt.Errorf("first renewal seen at %s", first)
		}
		if !l.Spec.RenewTime.After(first) {
			return fmt.Errorf("renewTime %s not after %s", l.Spec.RenewTime.Time, first)
		}
		return nil
	})
}

func listen(t *testing.T, addr string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	must(t, err)
	return l
}

// hostIPv4 is a non-loopback address of this machine: the API server refuses loopback
// endpoint addresses.
func hostIPv4(t *testing.T) netip.Addr {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	must(t, err)
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Is4() && !p.Addr().IsLoopback() && !p.Addr().IsLinkLocalUnicast() {
			return p.Addr()
		}
	}
	t.Fatal("no non-loopback IPv4 address for the upstream (EndpointSlices refuse loopback)")
	return netip.Addr{}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// apiserverWatches reads the API server's open watches per resource from its own metrics
// (apiserver_longrunning_requests, verb WATCH).
func apiserverWatches(t *testing.T, cfg *rest.Config) map[string]float64 {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	raw, err := cs.RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	must(t, err)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(raw))
	must(t, err)
	out := map[string]float64{}
	for _, m := range families["apiserver_longrunning_requests"].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["verb"] == "WATCH" {
			out[labels["resource"]] += m.GetGauge().GetValue()
		}
	}
	return out
}

// xdsClientTLS waits for the ingress's xDS client Secret in ns, writes its files as the kubelet
// mounts them, and returns the client configuration tendril-ingress makes of them (--xds-cert-file,
// --xds-key-file, --xds-ca-file) for the server name the xDS Service in ns has.
func xdsClientTLS(t *testing.T, c client.Client, ns string) *tls.Config {
	t.Helper()
	sec := &corev1.Secret{}
	testwait.For(t, "the xDS client Secret", func() error {
		return c.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: controlplane.XDSSecretClient}, sec)
	})
	dir := t.TempDir()
	f := &tlsreload.Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}
	for name, key := range map[string]string{f.Cert: controlplane.DataKeyCert, f.Key: controlplane.DataKeyKey, f.CA: controlplane.DataKeyCA} {
		must(t, os.WriteFile(name, sec.Data[key], 0o600))
	}
	return tlsreload.ClientConfig(f, "tendril-xds."+ns+".svc")
}
