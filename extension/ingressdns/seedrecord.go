package ingressdns

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/gardener/gardener/pkg/extensions"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// LabelManagedBy marks the seed-level DNSRecord as tendril-seed's: only such a record is
// deleted when the record is disabled.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "tendril-seed"
)

// recreateWait is how long the controller waits for the DNS provider to finish deleting the
// record before looking again (gardenlet's dnsrecord.DefaultInterval).
const recreateWait = 5 * time.Second

// SeedRecord configures the seed-level DNSRecord that gives the shared ingress a name of its
// own, outside the seed's wildcard *.<ingress domain> (gardenlet points that at Istio, behind
// which nginx runs). Without Name or Type the record is disabled: the controller deletes the
// one it wrote earlier, if any.
type SeedRecord struct {
	// Name is the record's fully qualified name, e.g. tendril.<seed domain>.
	Name string
	// Type is the DNS provider type (the Seed's spec.dns.provider.type, e.g. aws-route53).
	Type string
	// SecretName and SecretNamespace name the provider's credentials; gardenlet keeps a copy
	// of the seed DNS provider's as Secret seed-ingress in garden. SecretNamespace defaults to
	// Namespace.
	SecretName, SecretNamespace string
	// Zone is the hosted zone (empty: the provider finds the longest suffix, DNS-02).
	Zone string
	// TTL in seconds (0: DefaultTTL).
	TTL int64
	// ServiceNamespace and ServiceName are the ingress's LoadBalancer Service (ServiceName
	// when empty).
	ServiceNamespace, ServiceName string
	// Namespace holds the DNSRecord (GardenNamespace when empty).
	Namespace string
	// Log is the logger; the zero value discards.
	Log logr.Logger
}

// Enabled reports whether the record is to exist.
func (s SeedRecord) Enabled() bool { return s.Name != "" && s.Type != "" }

func (s SeedRecord) withDefaults() SeedRecord {
	s.Namespace = cmp.Or(s.Namespace, GardenNamespace)
	s.SecretNamespace = cmp.Or(s.SecretNamespace, s.Namespace)
	s.ServiceName = cmp.Or(s.ServiceName, ServiceName)
	s.TTL = cmp.Or(s.TTL, DefaultTTL)
	return s
}

// CacheByObject narrows the manager's cache of DNSRecords to the seed-level record (the
// webhook reads none): a seed has two or three per shoot.
func CacheByObject(s SeedRecord) map[client.Object]cache.ByObject {
	s = s.withDefaults()
	return map[client.Object]cache.ByObject{
		&extensionsv1alpha1.DNSRecord{}: {
			Namespaces: map[string]cache.Config{s.Namespace: {}},
			Field:      fields.OneTermEqualSelector("metadata.name", RecordName),
		},
	}
}

// AddSeedRecord adds the controller that keeps the seed-level DNSRecord: created from the
// ingress Service's load-balancer address, updated when it changes, repaired when someone
// else changes or deletes it, and deleted while the record is disabled. It runs on the leader.
func AddSeedRecord(mgr manager.Manager, s SeedRecord) error {
	s = s.withDefaults()
	if s.Enabled() && s.ServiceNamespace == "" {
		return fmt.Errorf("seed DNS record %s: no ingress Service namespace", s.Name)
	}
	if s.Enabled() && s.SecretName == "" {
		return fmt.Errorf("seed DNS record %s: no provider secret", s.Name)
	}
	r := &seedRecordReconciler{client: mgr.GetClient(), cfg: s}
	key := types.NamespacedName{Namespace: s.Namespace, Name: RecordName}
	toRecord := handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: key}}
	})
	return builder.ControllerManagedBy(mgr).
		Named("tendril-seed-dnsrecord").
		Watches(&extensionsv1alpha1.DNSRecord{}, toRecord, builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			return o.GetNamespace() == key.Namespace && o.GetName() == key.Name
		}))).
		Watches(&corev1.Service{}, toRecord, builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			return o.GetNamespace() == s.ServiceNamespace && o.GetName() == s.ServiceName
		}))).
		// One key. The caches' initial listings start it, so a disabled record is deleted at
		// start-up.
		Complete(r)
}

type seedRecordReconciler struct {
	client client.Client
	cfg    SeedRecord
}

func (r *seedRecordReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	log := r.cfg.Log.WithValues("dnsrecord", req.NamespacedName)
	cur := &extensionsv1alpha1.DNSRecord{}
	err := r.client.Get(ctx, req.NamespacedName, cur)
	switch {
	case apierrors.IsNotFound(err):
		cur = nil
	case err != nil:
		return reconcile.Result{}, fmt.Errorf("read dnsrecord %s: %w", req.NamespacedName, err)
	}

	if !r.cfg.Enabled() {
		if cur == nil || cur.Labels[LabelManagedBy] != ManagedBy || cur.DeletionTimestamp != nil {
			return reconcile.Result{}, nil
		}
		log.Info("Seed DNS record disabled: deleting it")
		if err := extensions.DeleteExtensionObject(ctx, r.client, cur); err != nil {
			return reconcile.Result{}, fmt.Errorf("delete dnsrecord %s: %w", req.NamespacedName, err)
		}
		return reconcile.Result{}, nil
	}

	svc := &corev1.Service{}
	if err := r.client.Get(ctx, client.ObjectKey{Namespace: r.cfg.ServiceNamespace, Name: r.cfg.ServiceName}, svc); err != nil {
		if apierrors.IsNotFound(err) {
			// The record stays as it is: the Service's creation triggers the next round.
			log.Info("Ingress Service not found; the record waits for it", "service", r.cfg.ServiceNamespace+"/"+r.cfg.ServiceName)
			return reconcile.Result{}, nil
		}
		return reconcile.Result{}, fmt.Errorf("read service %s/%s: %w", r.cfg.ServiceNamespace, r.cfg.ServiceName, err)
	}
	recordType, values, ok := IngressOf(svc).Record()
	if !ok {
		// A load balancer briefly without status must not take the name out of DNS.
		log.Info("Ingress Service has no load-balancer address yet; the record waits for it")
		return reconcile.Result{}, nil
	}
	want := r.spec(recordType, values)

	if cur == nil {
		rec := &extensionsv1alpha1.DNSRecord{ObjectMeta: metav1.ObjectMeta{
			Name: req.Name, Namespace: req.Namespace, Labels: map[string]string{LabelManagedBy: ManagedBy},
		}, Spec: want}
		requestReconcile(rec)
		if err := r.client.Create(ctx, rec); err != nil {
			return reconcile.Result{}, fmt.Errorf("create dnsrecord %s: %w", req.NamespacedName, err)
		}
		log.Info("Seed DNS record created", "name", want.Name, "recordType", want.RecordType, "values", want.Values)
		return reconcile.Result{}, nil
	}
	if cur.DeletionTimestamp != nil {
		return reconcile.Result{RequeueAfter: recreateWait}, nil // the provider is still removing it
	}
	if cur.Spec.Type != want.Type || cur.Spec.Name != want.Name || cur.Spec.RecordType != want.RecordType {
		// Immutable fields (Gardener's DNSRecord validation): delete and create again, as
		// gardenlet does when a record's type changes.
		log.Info("Seed DNS record's provider, name or record type changed: recreating it",
			"from", []string{cur.Spec.Type, cur.Spec.Name, string(cur.Spec.RecordType)}, "to", []string{want.Type, want.Name, string(want.RecordType)})
		if err := extensions.DeleteExtensionObject(ctx, r.client, cur); err != nil {
			return reconcile.Result{}, fmt.Errorf("delete dnsrecord %s: %w", req.NamespacedName, err)
		}
		return reconcile.Result{RequeueAfter: recreateWait}, nil
	}
	if specEqual(cur.Spec, want) && cur.Labels[LabelManagedBy] == ManagedBy {
		return reconcile.Result{}, nil
	}
	patch := client.MergeFrom(cur.DeepCopy())
	cur.Spec = want
	metav1.SetMetaDataLabel(&cur.ObjectMeta, LabelManagedBy, ManagedBy)
	requestReconcile(cur)
	if err := r.client.Patch(ctx, cur, patch); err != nil {
		return reconcile.Result{}, fmt.Errorf("update dnsrecord %s: %w", req.NamespacedName, err)
	}
	log.Info("Seed DNS record updated", "name", want.Name, "recordType", want.RecordType, "values", want.Values)
	return reconcile.Result{}, nil
}

func (r *seedRecordReconciler) spec(t extensionsv1alpha1.DNSRecordType, values []string) extensionsv1alpha1.DNSRecordSpec {
	s := extensionsv1alpha1.DNSRecordSpec{
		DefaultSpec: extensionsv1alpha1.DefaultSpec{Type: r.cfg.Type},
		SecretRef:   corev1.SecretReference{Name: r.cfg.SecretName, Namespace: r.cfg.SecretNamespace},
		Name:        r.cfg.Name,
		RecordType:  t,
		Values:      values,
		TTL:         ptr.To(r.cfg.TTL),
	}
	if r.cfg.Zone != "" {
		s.Zone = ptr.To(r.cfg.Zone)
	}
	return s
}

// specEqual compares what the controller sets; the provider's fields (Region, Class) are left
// as they are.
func specEqual(a, b extensionsv1alpha1.DNSRecordSpec) bool {
	return a.Type == b.Type && a.SecretRef == b.SecretRef && a.Name == b.Name && a.RecordType == b.RecordType &&
		slices.Equal(a.Values, b.Values) && ptr.Equal(a.TTL, b.TTL) && ptr.Equal(a.Zone, b.Zone)
}

// requestReconcile asks the provider's DNSRecord controller to act: Gardener's extension
// controllers reconcile only objects carrying the operation annotation (gardenlet's dnsrecord
// component sets it with a timestamp the same way).
func requestReconcile(rec *extensionsv1alpha1.DNSRecord) {
	if rec.Annotations == nil {
		rec.Annotations = map[string]string{}
	}
	maps.Copy(rec.Annotations, map[string]string{
		v1beta1constants.GardenerOperation: v1beta1constants.GardenerOperationReconcile,
		v1beta1constants.GardenerTimestamp: time.Now().UTC().Format(time.RFC3339Nano),
	})
}
