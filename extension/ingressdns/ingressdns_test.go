package ingressdns_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	druidcorev1alpha1 "github.com/gardener/etcd-druid/api/core/v1alpha1"
	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	genericdnsrecord "github.com/gardener/gardener/extensions/pkg/controller/dnsrecord"
	extensionswebhook "github.com/gardener/gardener/extensions/pkg/webhook"
	extensionsvalidation "github.com/gardener/gardener/pkg/api/extensions/validation"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/gardener/gardener/pkg/component/extensions/dnsrecord"
	"github.com/gardener/gardener/pkg/resourcemanager/webhook/extensionvalidation"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/testr"
	"github.com/prometheus/client_golang/prometheus"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/tendril-net/tendril/extension"
	"github.com/tendril-net/tendril/extension/egresswebhook"
	"github.com/tendril-net/tendril/extension/ingressdns"
	"github.com/tendril-net/tendril/internal/testing/kubetest"
	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
)

// The package cannot import extension (the controlplane wires both); its copy must agree.
func TestNamesMatchExtension(t *testing.T) {
	if ingressdns.ExtensionType != extension.Type {
		t.Errorf("ingressdns.ExtensionType %q, extension.Type %q", ingressdns.ExtensionType, extension.Type)
	}
}

func lbService(ns string, ingress ...corev1.LoadBalancerIngress) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: ingressdns.ServiceName, Namespace: ns},
		Spec: corev1.ServiceSpec{
			Type:  corev1.ServiceTypeLoadBalancer,
			Ports: []corev1.ServicePort{{Name: "sni", Port: 443}},
		},
		Status: corev1.ServiceStatus{LoadBalancer: corev1.LoadBalancerStatus{Ingress: ingress}},
	}
}

func TestIngressRecord(t *testing.T) {
	for name, tc := range map[string]struct {
		ingress []corev1.LoadBalancerIngress
		typ     extensionsv1alpha1.DNSRecordType
		values  []string
	}{
		"none":     {nil, "", nil},
		"ipv4":     {[]corev1.LoadBalancerIngress{{IP: "203.0.113.11"}, {IP: "203.0.113.10"}, {IP: "203.0.113.11"}}, "A", []string{"203.0.113.10", "203.0.113.11"}},
		"ipv6":     {[]corev1.LoadBalancerIngress{{IP: "2001:db8::10"}}, "AAAA", []string{"2001:db8::10"}},
		"dual":     {[]corev1.LoadBalancerIngress{{IP: "2001:db8::10"}, {IP: "203.0.113.10"}}, "A", []string{"203.0.113.10"}},
		"hostname": {[]corev1.LoadBalancerIngress{{Hostname: "lb-1.elb.example.com"}, {Hostname: "lb-2.elb.example.com"}}, "CNAME", []string{"lb-1.elb.example.com"}},
		"garbage":  {[]corev1.LoadBalancerIngress{{IP: "not-an-ip"}}, "", nil},
	} {
		t.Run(name, func(t *testing.T) {
			typ, values, ok := ingressdns.IngressOf(lbService("ns", tc.ingress...)).Record()
			if typ != tc.typ || !slices.Equal(values, tc.values) || ok != (tc.typ != "") {
				t.Errorf("Record() = %s %q %v, want %s %q", typ, values, ok, tc.typ, tc.values)
			}
		})
	}
}

func TestIsAPIRecord(t *testing.T) {
	rec := func(ns, name, role string) *extensionsv1alpha1.DNSRecord {
		r := &extensionsv1alpha1.DNSRecord{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
		if role != "" {
			r.Labels = map[string]string{"role": role}
		}
		return r
	}
	for _, tc := range []struct {
		rec  *extensionsv1alpha1.DNSRecord
		want bool
	}{
		{rec("shoot--p--s", "s-internal", "internal"), true},
		{rec("shoot--p--s", "s-external", "external"), true},
		{rec("shoot--p--my-shoot", "my-shoot-external", "external"), true},
		{rec("shoot--p--s", "s-ingress", "ingress"), false},
		{rec("shoot--p--s", "s-internal", ""), false},
		{rec("shoot--p--s", "s-internal", "external"), false},
		{rec("shoot--p--s", "t-internal", "internal"), false},
		{rec("garden", "seed-ingress", ""), false},
		{rec("garden", "garden-internal", "internal"), false},
	} {
		if got := ingressdns.IsAPIRecord(tc.rec); got != tc.want {
			t.Errorf("IsAPIRecord(%s/%s role=%s) = %v", tc.rec.Namespace, tc.rec.Name, tc.rec.Labels["role"], got)
		}
	}
}

// zone stands in for a DNS provider's zone behind Gardener's generic DNSRecord controller,
// which runs for real: it records what the provider would have written.
type zone struct {
	mu      sync.Mutex
	records map[string]extensionsv1alpha1.DNSRecordSpec
	err     error // set when the controller passes a Cluster for a garden record
}

func (z *zone) Reconcile(_ context.Context, _ logr.Logger, r *extensionsv1alpha1.DNSRecord, c *extensionscontroller.Cluster) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	if c != nil {
		z.err = fmt.Errorf("record %s/%s reconciled with a Cluster", r.Namespace, r.Name)
	}
	z.records[r.Spec.Name] = *r.Spec.DeepCopy()
	return nil
}

func (z *zone) Delete(_ context.Context, _ logr.Logger, r *extensionsv1alpha1.DNSRecord, _ *extensionscontroller.Cluster) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	delete(z.records, r.Spec.Name)
	return nil
}

func (z *zone) ForceDelete(ctx context.Context, log logr.Logger, r *extensionsv1alpha1.DNSRecord, c *extensionscontroller.Cluster) error {
	return z.Delete(ctx, log, r, c)
}

func (z *zone) Restore(ctx context.Context, log logr.Logger, r *extensionsv1alpha1.DNSRecord, c *extensionscontroller.Cluster) error {
	return z.Reconcile(ctx, log, r, c)
}

func (z *zone) Migrate(context.Context, logr.Logger, *extensionsv1alpha1.DNSRecord, *extensionscontroller.Cluster) error {
	return nil
}

func (z *zone) get(name string) (extensionsv1alpha1.DNSRecordSpec, bool, error) {
	z.mu.Lock()
	defer z.mu.Unlock()
	s, ok := z.records[name]
	return s, ok, z.err
}

// startManager runs a manager with add's controllers until the test ends (or stop is called).
func startManager(ctx context.Context, t *testing.T, env *kubetest.Env, opts manager.Options, add func(manager.Manager) error) (stop func()) {
	t.Helper()
	opts.Scheme = env.Scheme
	opts.Logger = testr.New(t)
	opts.Metrics = metricsserver.Options{BindAddress: "0"}
	opts.HealthProbeBindAddress = "0"
	// A test starts the same controller again (a restarted tendril-seed).
	opts.Controller = config.Controller{SkipNameValidation: ptr.To(true)}
	mgr, err := manager.New(env.Config, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := add(mgr); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- mgr.Start(mctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("manager: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func mustCreate(ctx context.Context, t *testing.T, c client.Client, obj client.Object) {
	t.Helper()
	if err := c.Create(ctx, obj); err != nil {
		t.Fatalf("create %T %s: %v", obj, obj.GetName(), err)
	}
}

func setLB(ctx context.Context, t *testing.T, c client.Client, svc *corev1.Service, ingress ...corev1.LoadBalancerIngress) {
	t.Helper()
	if err := c.Get(ctx, client.ObjectKeyFromObject(svc), svc); err != nil {
		t.Fatal(err)
	}
	svc.Status.LoadBalancer.Ingress = ingress
	if err := c.Status().Update(ctx, svc); err != nil {
		t.Fatalf("service status: %v", err)
	}
}

const (
	ingressNamespace = "extension-tendril-abcde"
	recordName       = "tendril.aws-eu1.example.com"
	providerType     = "aws-route53"
)

// TestSeedRecord runs the seed DNSRecord controller against a real kube-apiserver, with
// Gardener's generic DNSRecord controller (the provider side, its zone recorded in memory)
// acting on the records it writes in garden, where no Cluster exists.
func TestSeedRecord(t *testing.T) {
	env := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := env.Client
	for _, ns := range []string{ingressdns.GardenNamespace, ingressNamespace} {
		mustCreate(ctx, t, c, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	}

	z := &zone{records: map[string]extensionsv1alpha1.DNSRecordSpec{}}
	startManager(ctx, t, env, manager.Options{}, func(mgr manager.Manager) error {
		return genericdnsrecord.Add(mgr, genericdnsrecord.AddArgs{
			Actuator: z, Type: providerType,
			Predicates: genericdnsrecord.DefaultPredicates(ctx, mgr, false),
		})
	})

	cfg := ingressdns.SeedRecord{
		Name: recordName, Type: providerType, SecretName: "seed-ingress",
		ServiceNamespace: ingressNamespace, Log: testr.New(t),
	}
	seedDNS := func(cfg ingressdns.SeedRecord) func() {
		return startManager(ctx, t, env, manager.Options{Cache: cache.Options{ByObject: ingressdns.CacheByObject(cfg)}}, func(mgr manager.Manager) error {
			return ingressdns.AddSeedRecord(mgr, cfg)
		})
	}
	stop := seedDNS(cfg)

	// No Service, then a Service without an address: no record.
	svc := lbService(ingressNamespace)
	mustCreate(ctx, t, c, svc)
	key := types.NamespacedName{Namespace: ingressdns.GardenNamespace, Name: ingressdns.RecordName}
	time.Sleep(time.Second) // a deadline for a record that must not appear
	if err := c.Get(ctx, key, &extensionsv1alpha1.DNSRecord{}); err == nil {
		t.Fatal("record written before the load balancer has an address")
	}

	// The load balancer gets an IP: an A record, reconciled by the provider.
	setLB(ctx, t, c, svc, corev1.LoadBalancerIngress{IP: "203.0.113.10"})
	rec := waitRecord(ctx, t, c, z, key, "A", "203.0.113.10")
	if rec.Spec.Type != providerType || rec.Spec.SecretRef != (corev1.SecretReference{Name: "seed-ingress", Namespace: "garden"}) ||
		rec.Spec.TTL == nil || *rec.Spec.TTL != 120 || rec.Labels[ingressdns.LabelManagedBy] != ingressdns.ManagedBy {
		t.Errorf("record %+v labels %v", rec.Spec, rec.Labels)
	}
	if errs := extensionsvalidation.ValidateDNSRecord(rec); len(errs) > 0 {
		t.Errorf("Gardener's validation refuses the record: %v", errs.ToAggregate())
	}
	uid := rec.UID

	// The address changes: the record follows, in place.
	setLB(ctx, t, c, svc, corev1.LoadBalancerIngress{IP: "203.0.113.12"}, corev1.LoadBalancerIngress{IP: "203.0.113.11"})
	rec = waitRecord(ctx, t, c, z, key, "A", "203.0.113.11", "203.0.113.12")
	if rec.UID != uid {
		t.Error("an address change recreated the record")
	}

	// Someone else changes the record: repaired.
	rec.Spec.Values = []string{"192.0.2.1"}
	if err := c.Update(ctx, rec); err != nil {
		t.Fatal(err)
	}
	waitRecord(ctx, t, c, z, key, "A", "203.0.113.11", "203.0.113.12")

	// The load balancer loses its status for a moment: the name stays.
	setLB(ctx, t, c, svc)
	time.Sleep(time.Second)
	waitRecord(ctx, t, c, z, key, "A", "203.0.113.11", "203.0.113.12")

	// A host name instead (the record type is immutable): deleted through the provider, then
	// created again as a CNAME.
	setLB(ctx, t, c, svc, corev1.LoadBalancerIngress{Hostname: "lb-1.elb.example.com"})
	rec = waitRecord(ctx, t, c, z, key, "CNAME", "lb-1.elb.example.com")
	if rec.UID == uid {
		t.Error("record type changed in place")
	}

	// Disabled: the next tendril-seed deletes the record, and the provider its entry.
	stop()
	seedDNS(ingressdns.SeedRecord{Log: testr.New(t)})
	testwait.For(t, "record deleted", func() error {
		if err := c.Get(ctx, key, &extensionsv1alpha1.DNSRecord{}); err == nil {
			return errors.New("record still there")
		}
		if _, ok, _ := z.get(recordName); ok {
			return errors.New("zone entry still there")
		}
		return nil
	})
	if _, _, err := z.get(recordName); err != nil {
		t.Error(err)
	}
}

// waitRecord waits until the seed record has the type and values and the provider has
// reconciled exactly that (lastOperation Succeeded, zone entry equal).
func waitRecord(ctx context.Context, t *testing.T, c client.Client, z *zone, key types.NamespacedName, typ extensionsv1alpha1.DNSRecordType, values ...string) *extensionsv1alpha1.DNSRecord {
	t.Helper()
	rec := &extensionsv1alpha1.DNSRecord{}
	testwait.For(t, fmt.Sprintf("record %s %q", typ, values), func() error {
		if err := c.Get(ctx, key, rec); err != nil {
			return err
		}
		if rec.Spec.RecordType != typ || !slices.Equal(rec.Spec.Values, values) || rec.Spec.Name != recordName {
			return fmt.Errorf("record %s %s %q", rec.Spec.Name, rec.Spec.RecordType, rec.Spec.Values)
		}
		if op := rec.Status.LastOperation; op == nil || op.State != "Succeeded" || rec.Status.ObservedGeneration != rec.Generation {
			return fmt.Errorf("not reconciled by the provider: %+v", rec.Status.LastOperation)
		}
		s, ok, err := z.get(recordName)
		if err != nil {
			return err
		}
		if !ok || s.RecordType != typ || !slices.Equal(s.Values, values) {
			return fmt.Errorf("zone has %v %+v", ok, s)
		}
		return nil
	})
	return rec
}

const (
	istioIP   = "198.51.100.7"
	istioIPv6 = "2001:db8:1::7"
	istioHost = "istio-ingressgateway.elb.example.com"
	tendrilIP = "203.0.113.10"
	tendrilV6 = "2001:db8::10"
	tendrilLB = "tendril-ingress.elb.example.com"
)

// TestWebhook registers the DNSRecord webhook beside the egress webhook (one configuration,
// Gardener's webhook library, managed certificates, URL mode on loopback) with a real
// kube-apiserver, and Gardener's resource manager validation of DNSRecords behind it. The
// records are written by gardenlet's own DNSRecord component, as its shoot flow does.
func TestWebhook(t *testing.T) {
	env := kubetest.Start(t)
	if err := druidcorev1alpha1.AddToScheme(env.Scheme); err != nil { // GRM's validation serves Etcd too
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := env.Client
	mustCreate(ctx, t, c, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ingressNamespace}})
	reg := prometheus.NewRegistry()
	startWebhooks(ctx, t, env, reg)

	svc := lbService(ingressNamespace)
	mustCreate(ctx, t, c, svc)
	setLB(ctx, t, c, svc, corev1.LoadBalancerIngress{IP: tendrilV6}, corev1.LoadBalancerIngress{IP: tendrilIP})

	shoot := shootNamespace(ctx, t, c, "s", true, true)
	internal := gardenletRecord(t, c, shoot, "s", "internal", "api.s.p.internal.example.com", istioIP)
	external := gardenletRecord(t, c, shoot, "s", "external", "api.s.example.org", istioIP)
	// Retried until the webhook server has its certificate (failurePolicy Fail: nothing is
	// stored unmutated meanwhile).
	testwait.For(t, "webhook serving", func() error { return internal.Deploy(ctx) })
	if err := external.Deploy(ctx); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"s-internal", "s-external"} {
		checkRecord(ctx, t, c, shoot, name, "A", tendrilIP)
	}

	// gardenlet's next reconcile applies Istio's address again: the record keeps tendril's,
	// no new generation, not recreated.
	before := getRecord(ctx, t, c, shoot, "s-internal")
	for range 2 {
		if err := internal.Deploy(ctx); err != nil {
			t.Fatal(err)
		}
	}
	after := checkRecord(ctx, t, c, shoot, "s-internal", "A", tendrilIP)
	if after.Generation != before.Generation || after.UID != before.UID {
		t.Errorf("gardenlet's re-apply: generation %d→%d, uid %s→%s", before.Generation, after.Generation, before.UID, after.UID)
	}

	// Why the record type stays gardenlet's: Gardener's validation refuses to change it.
	after.Spec.RecordType, after.Spec.Values = "CNAME", []string{tendrilLB}
	if err := c.Update(ctx, after); err == nil || !strings.Contains(err.Error(), "field is immutable") {
		t.Errorf("record type change: %v, want Gardener's validation to refuse it", err)
	}

	// Other records of the shoot are left alone: gardenlet's ingress wildcard record.
	ingressRec := gardenletRecord(t, c, shoot, "s", "ingress", "*.ingress.s.example.org", istioIP)
	if err := ingressRec.Deploy(ctx); err != nil {
		t.Fatal(err)
	}
	checkRecord(ctx, t, c, shoot, "s-ingress", "A", istioIP)

	// An IPv6 Istio address gets the ingress's IPv6 address (AAAA).
	v6 := shootNamespace(ctx, t, c, "v6", true, true)
	if err := gardenletRecord(t, c, v6, "v6", "internal", "api.v6.p.internal.example.com", istioIPv6).Deploy(ctx); err != nil {
		t.Fatal(err)
	}
	checkRecord(ctx, t, c, v6, "v6-internal", "AAAA", tendrilV6)

	// A host name (CNAME) while the ingress has only IPs: left to Istio, not refused; once
	// the ingress has a host name, gardenlet's next apply points it there.
	aws := shootNamespace(ctx, t, c, "aws", true, true)
	awsRec := gardenletRecord(t, c, aws, "aws", "external", "api.aws.example.org", istioHost)
	if err := awsRec.Deploy(ctx); err != nil {
		t.Fatal(err)
	}
	checkRecord(ctx, t, c, aws, "aws-external", "CNAME", istioHost)
	if n := metrictest.Sum(t, reg, "tendril_dnsrecord_webhook_requests_total", map[string]string{"result": ingressdns.ResultNoAddress}); n < 1 {
		t.Errorf("no_ingress_address counted %v times", n)
	}
	setLB(ctx, t, c, svc, corev1.LoadBalancerIngress{IP: tendrilIP, Hostname: tendrilLB})
	testwait.For(t, "CNAME pointed at the ingress", func() error {
		if err := awsRec.Deploy(ctx); err != nil {
			return err
		}
		if r := getRecord(ctx, t, c, aws, "aws-external"); !slices.Equal(r.Spec.Values, []string{tendrilLB}) {
			return fmt.Errorf("values %q", r.Spec.Values)
		}
		return nil
	})

	// tendril just added: until its Extension's first reconcile succeeds the route may be
	// missing, so Istio's address stays; a later failed reconcile does not flip it back.
	fresh := shootNamespace(ctx, t, c, "fresh", true, true)
	setLastOperation(ctx, t, c, fresh, gardencorev1beta1.LastOperationTypeCreate, gardencorev1beta1.LastOperationStateProcessing)
	freshRec := gardenletRecord(t, c, fresh, "fresh", "internal", "api.fresh.p.internal.example.com", istioIP)
	if err := freshRec.Deploy(ctx); err != nil {
		t.Fatal(err)
	}
	checkRecord(ctx, t, c, fresh, "fresh-internal", "A", istioIP)
	for _, op := range []gardencorev1beta1.LastOperationType{gardencorev1beta1.LastOperationTypeCreate, gardencorev1beta1.LastOperationTypeReconcile} {
		state := gardencorev1beta1.LastOperationStateSucceeded
		if op == gardencorev1beta1.LastOperationTypeReconcile {
			state = gardencorev1beta1.LastOperationStateError
		}
		setLastOperation(ctx, t, c, fresh, op, state)
		if err := freshRec.Deploy(ctx); err != nil {
			t.Fatal(err)
		}
		checkRecord(ctx, t, c, fresh, "fresh-internal", "A", tendrilIP)
	}

	// Shoots without tendril: a namespace without gardenlet's extension label (the API
	// server does not call), a labelled one without the Extension.
	for _, tc := range []struct {
		name          string
		label, create bool
	}{{"plain", false, true}, {"noext", true, false}} {
		ns := shootNamespace(ctx, t, c, tc.name, tc.label, tc.create)
		if err := gardenletRecord(t, c, ns, tc.name, "internal", "api."+tc.name+".p.internal.example.com", istioIP).Deploy(ctx); err != nil {
			t.Fatal(err)
		}
		checkRecord(ctx, t, c, ns, tc.name+"-internal", "A", istioIP)
	}

	// tendril is removed from the shoot: while its Extension is being deleted, gardenlet's
	// next apply restores Istio's address.
	ext := &extensionsv1alpha1.Extension{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: shoot, Name: "tendril"}, ext); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, ext); err != nil {
		t.Fatal(err)
	}
	for _, d := range []dnsrecord.Interface{internal, external} {
		if err := d.Deploy(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"s-internal", "s-external"} {
		checkRecord(ctx, t, c, shoot, name, "A", istioIP)
	}

	for result, min := range map[string]float64{ingressdns.ResultPointed: 4, ingressdns.ResultNoExtension: 3, ingressdns.ResultNotReady: 1} {
		if n := metrictest.Sum(t, reg, "tendril_dnsrecord_webhook_requests_total", map[string]string{"result": result}); n < min {
			t.Errorf("%s counted %v times, want at least %v", result, n, min)
		}
	}
	if n := metrictest.Sum(t, reg, "tendril_dnsrecord_webhook_requests_total", map[string]string{"result": ingressdns.ResultNotAPIRecord}); n != 0 {
		t.Errorf("the API server sent %v records the object selector excludes", n)
	}
}

// startWebhooks runs tendril-seed's webhooks as controlplane wires them, plus Gardener's
// resource manager validation of DNSRecords (registered by the test as GRM would register it).
func startWebhooks(ctx context.Context, t *testing.T, env *kubetest.Env, reg prometheus.Registerer) {
	t.Helper()
	port := testnet.ReservePort(t) // the webhook server binds it
	startManager(ctx, t, env, manager.Options{
		WebhookServer: webhook.NewServer(webhook.Options{Host: "127.0.0.1", Port: port, CertDir: t.TempDir()}),
	}, func(mgr manager.Manager) error {
		metrics, err := ingressdns.NewMetrics(reg)
		if err != nil {
			return err
		}
		wh, err := ingressdns.NewWebhook(mgr, ingressdns.WebhookOptions{ServiceNamespace: ingressNamespace, Metrics: metrics})
		if err != nil {
			return err
		}
		if err := egresswebhook.AddToManager(ctx, mgr, egresswebhook.Options{
			Namespace: ingressNamespace, Mode: egresswebhook.ModeURL, URL: fmt.Sprintf("127.0.0.1:%d", port),
			Webhooks: []*extensionswebhook.Webhook{wh},
		}); err != nil {
			return err
		}
		return extensionvalidation.AddToManager(mgr)
	})

	var dns admissionregistrationv1.MutatingWebhook
	testwait.For(t, "webhook configuration", func() error {
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		if err := env.Client.Get(ctx, client.ObjectKey{Name: "gardener-extension-tendril"}, &mwc); err != nil {
			return err
		}
		if len(mwc.Webhooks) != 2 {
			return fmt.Errorf("%d webhooks", len(mwc.Webhooks))
		}
		for _, w := range mwc.Webhooks {
			if len(w.ClientConfig.CABundle) == 0 {
				return errors.New("no CA bundle yet")
			}
			if strings.HasPrefix(w.Name, ingressdns.WebhookName+".") {
				dns = w
			}
		}
		return nil
	})
	if dns.Name == "" || len(dns.Rules) != 1 || !slices.Equal(dns.Rules[0].Resources, []string{"dnsrecords"}) ||
		!slices.Equal(dns.Rules[0].APIGroups, []string{"extensions.gardener.cloud"}) ||
		!slices.Contains(dns.Rules[0].Operations, admissionregistrationv1.Create) || !slices.Contains(dns.Rules[0].Operations, admissionregistrationv1.Update) {
		t.Fatalf("DNSRecord webhook %s rules %+v", dns.Name, dns.Rules)
	}
	if dns.FailurePolicy == nil || *dns.FailurePolicy != admissionregistrationv1.Fail ||
		dns.NamespaceSelector == nil || len(dns.NamespaceSelector.MatchExpressions) != 1 || dns.NamespaceSelector.MatchExpressions[0].Key != "extensions.gardener.cloud/tendril" {
		t.Errorf("DNSRecord webhook failure policy %v, namespace selector %+v", dns.FailurePolicy, dns.NamespaceSelector)
	}

	// GRM's DNSRecord validation behind the mutation, served by the same server.
	fail, none := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone
	url := fmt.Sprintf("https://127.0.0.1:%d%s", port, extensionvalidation.WebhookPathDNSRecord)
	mustCreate(ctx, t, env.Client, &admissionregistrationv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "gardener-resource-manager"},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name:                    "validation.extensions.dnsrecords.resources.gardener.cloud",
			ClientConfig:            admissionregistrationv1.WebhookClientConfig{URL: &url, CABundle: dns.ClientConfig.CABundle},
			Rules:                   []admissionregistrationv1.RuleWithOperations{{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}, Rule: admissionregistrationv1.Rule{APIGroups: []string{"extensions.gardener.cloud"}, APIVersions: []string{"v1alpha1"}, Resources: []string{"dnsrecords"}}}},
			FailurePolicy:           &fail,
			SideEffects:             &none,
			AdmissionReviewVersions: []string{"v1"},
		}},
	})
}

// shootNamespace creates shoot--p--<name>, with gardenlet's extension label and the tendril
// Extension (with tendril's finalizer, so that deleting it leaves it being deleted) as asked.
func shootNamespace(ctx context.Context, t *testing.T, c client.Client, name string, label, ext bool) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shoot--p--" + name}}
	if label {
		ns.Labels = map[string]string{"extensions.gardener.cloud/tendril": "true"}
	}
	mustCreate(ctx, t, c, ns)
	if ext {
		mustCreate(ctx, t, c, &extensionsv1alpha1.Extension{
			ObjectMeta: metav1.ObjectMeta{Name: "tendril", Namespace: ns.Name, Finalizers: []string{"extensions.gardener.cloud/tendril"}},
			Spec:       extensionsv1alpha1.ExtensionSpec{DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: "tendril"}},
		})
		setLastOperation(ctx, t, c, ns.Name, gardencorev1beta1.LastOperationTypeCreate, gardencorev1beta1.LastOperationStateSucceeded)
	}
	return ns.Name
}

// setLastOperation writes the Extension's lastOperation as tendril's generic reconciler does.
func setLastOperation(ctx context.Context, t *testing.T, c client.Client, ns string, typ gardencorev1beta1.LastOperationType, state gardencorev1beta1.LastOperationState) {
	t.Helper()
	ext := &extensionsv1alpha1.Extension{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "tendril"}, ext); err != nil {
		t.Fatal(err)
	}
	ext.Status.LastOperation = &gardencorev1beta1.LastOperation{Type: typ, State: state, Progress: 100, LastUpdateTime: metav1.Now()}
	if err := c.Status().Update(ctx, ext); err != nil {
		t.Fatalf("extension status: %v", err)
	}
}

// gardenletRecord is gardenlet's DNSRecord deployer with the values its botanist gives the
// shoot's internal/external (and ingress) records, pointing at addr (Istio's load balancer).
func gardenletRecord(t *testing.T, c client.Client, ns, shoot, role, dnsName, addr string) dnsrecord.Interface {
	t.Helper()
	ttl := int64(120)
	d := dnsrecord.New(testr.New(t), c, &dnsrecord.Values{
		Name:       shoot + "-" + role,
		SecretName: "dnsrecord-" + shoot + "-" + role,
		Namespace:  ns,
		TTL:        &ttl,
		Type:       providerType,
		DNSName:    dnsName,
		IPStack:    "ipv4",
		Labels:     map[string]string{"role": role, "gardener.cloud/role": "controlplane"},
	}, dnsrecord.DefaultInterval, dnsrecord.DefaultSevereThreshold, dnsrecord.DefaultTimeout, nil)
	recordType := extensionsv1alpha1.DNSRecordTypeCNAME
	if ip := net.ParseIP(addr); ip != nil {
		recordType = extensionsv1alpha1.DNSRecordTypeAAAA
		if ip.To4() != nil {
			recordType = extensionsv1alpha1.DNSRecordTypeA
		}
	}
	d.SetRecordType(recordType)
	d.SetValues([]string{addr})
	return d
}

func getRecord(ctx context.Context, t *testing.T, c client.Client, ns, name string) *extensionsv1alpha1.DNSRecord {
	t.Helper()
	r := &extensionsv1alpha1.DNSRecord{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, r); err != nil {
		t.Fatal(err)
	}
	return r
}

func checkRecord(ctx context.Context, t *testing.T, c client.Client, ns, name string, typ extensionsv1alpha1.DNSRecordType, values ...string) *extensionsv1alpha1.DNSRecord {
	t.Helper()
	r := getRecord(ctx, t, c, ns, name)
	if r.Spec.RecordType != typ || !slices.Equal(r.Spec.Values, values) {
		t.Errorf("%s/%s: %s %q, want %s %q", ns, name, r.Spec.RecordType, r.Spec.Values, typ, values)
	}
	return r
}
