package ingressdns

import (
	"context"
	"fmt"
	"slices"
	"strings"

	extensionswebhook "github.com/gardener/gardener/extensions/pkg/webhook"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

// ExtensionType is tendril's Extension type (extension.Type; this package's tests check it).
const ExtensionType = "tendril"

// WebhookName and WebhookPath name the DNSRecord webhook inside tendril's
// MutatingWebhookConfiguration (gardener-extension-tendril) and on the webhook server.
const (
	WebhookName = "tendril-dnsrecord"
	WebhookPath = "/tendril-dnsrecord"
)

// webhookObjectSelector: gardenlet labels the shoot's api.* records role=internal and
// role=external (botanist DefaultInternalDNSRecord/DefaultExternalDNSRecord); the API server
// calls the webhook for no other DNSRecord.
var webhookObjectSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
	Key:      v1beta1constants.LabelRole,
	Operator: metav1.LabelSelectorOpIn,
	Values:   []string{v1beta1constants.LabelDNSRecordInternal, v1beta1constants.LabelDNSRecordExternal},
}}}

// WebhookOptions configure NewWebhook.
type WebhookOptions struct {
	// ServiceNamespace and ServiceName are the ingress's LoadBalancer Service (ServiceName
	// when empty).
	ServiceNamespace, ServiceName string
	// Metrics counts the decisions (nil: not counted).
	Metrics *Metrics
}

// NewWebhook builds the mutating webhook on DNSRecords that points the internal and external
// api.* records of shoots using tendril at the shared ingress. It selects namespaces labelled
// extensions.gardener.cloud/tendril=true (gardenlet's label for shoots with the Extension type)
// and the records gardenlet labels role=internal|external, and mutates only
// <shoot>-internal/<shoot>-external while the namespace's tendril Extension exists, is not
// being deleted and has succeeded once: spec.values become the ingress's addresses of the record's type. The record
// type stays gardenlet's: it is immutable (Gardener's DNSRecord validation), and gardenlet
// deletes and recreates a record whose stored type differs from its own. Everything else passes
// unchanged, so gardenlet's next apply restores Istio's address once tendril is gone.
func NewWebhook(mgr manager.Manager, opts WebhookOptions) (*extensionswebhook.Webhook, error) {
	if opts.ServiceNamespace == "" {
		return nil, fmt.Errorf("dnsrecord webhook: no ingress Service namespace")
	}
	if opts.ServiceName == "" {
		opts.ServiceName = ServiceName
	}
	m := &mutator{
		client: mgr.GetClient(), reader: mgr.GetAPIReader(), log: mgr.GetLogger().WithName("dnsrecord-webhook"),
		service: client.ObjectKey{Namespace: opts.ServiceNamespace, Name: opts.ServiceName}, metrics: opts.Metrics,
	}
	wh, err := extensionswebhook.New(mgr, extensionswebhook.Args{
		Name:              WebhookName,
		Path:              WebhookPath,
		Target:            extensionswebhook.TargetSeed,
		NamespaceSelector: extensionswebhook.BuildExtensionTypeNamespaceSelector(ExtensionType, nil),
		ObjectSelector:    webhookObjectSelector,
		Mutators:          map[extensionswebhook.Mutator][]extensionswebhook.Type{m: {{Obj: &extensionsv1alpha1.DNSRecord{}}}},
	})
	if err != nil {
		return nil, fmt.Errorf("dnsrecord webhook: %w", err)
	}
	return wh, nil
}

type mutator struct {
	// client reads the ingress Service from the manager's cache (the Extension controller
	// caches Services already).
	client client.Client
	// reader reads Extensions uncached: one created or deleted a moment ago must count.
	reader  client.Reader
	log     logr.Logger
	service client.ObjectKey
	metrics *Metrics
}

func (m *mutator) Mutate(ctx context.Context, newObj, _ client.Object) error {
	rec, ok := newObj.(*extensionsv1alpha1.DNSRecord)
	if !ok {
		return fmt.Errorf("unexpected object %T", newObj)
	}
	result, err := m.mutate(ctx, rec)
	if err != nil {
		result = ResultError
	}
	m.metrics.count(result)
	if result != ResultPointed && result != ResultNotAPIRecord {
		m.log.V(1).Info("DNSRecord left as it is", "dnsrecord", client.ObjectKeyFromObject(rec), "reason", result)
	}
	return err
}

func (m *mutator) mutate(ctx context.Context, rec *extensionsv1alpha1.DNSRecord) (string, error) {
	if !IsAPIRecord(rec) {
		return ResultNotAPIRecord, nil
	}
	if rec.DeletionTimestamp != nil {
		return ResultDeleting, nil
	}
	ext, err := m.extension(ctx, rec.Namespace)
	if err != nil {
		return "", err
	}
	if ext == nil || ext.DeletionTimestamp != nil {
		return ResultNoExtension, nil
	}
	if !hasSucceeded(ext) {
		// Its route may not exist yet: the names keep Istio's address until a later apply.
		return ResultNotReady, nil
	}
	svc := &corev1.Service{}
	if err := m.client.Get(ctx, m.service, svc); err != nil {
		return "", fmt.Errorf("read ingress service %s: %w", m.service, err)
	}
	values := IngressOf(svc).Values(rec.Spec.RecordType)
	if len(values) == 0 {
		// Istio's address stays: it still serves the shoot, and a record without values
		// would be refused by Gardener's validation.
		return ResultNoAddress, nil
	}
	if !slices.Equal(rec.Spec.Values, values) {
		m.log.Info("Pointing DNSRecord at tendril's ingress", "dnsrecord", client.ObjectKeyFromObject(rec), "name", rec.Spec.Name, "from", rec.Spec.Values, "to", values)
		rec.Spec.Values = values
	}
	return ResultPointed, nil
}

// IsAPIRecord reports whether rec is one of the shoot's api.* records as gardenlet names them:
// <shoot>-internal or <shoot>-external in the shoot's namespace shoot--<project>--<shoot>
// (shoot and project names cannot contain "--"), labelled with the matching role.
func IsAPIRecord(rec *extensionsv1alpha1.DNSRecord) bool {
	i := strings.LastIndex(rec.Namespace, "--")
	if !strings.HasPrefix(rec.Namespace, v1beta1constants.TechnicalIDPrefix) || i < 0 {
		return false
	}
	shoot := rec.Namespace[i+len("--"):]
	for _, role := range []string{v1beta1constants.DNSRecordInternalName, v1beta1constants.DNSRecordExternalName} {
		if rec.Name == shoot+"-"+role && rec.Labels[v1beta1constants.LabelRole] == role {
			return true
		}
	}
	return false
}

// extension returns ns's tendril Extension, or nil.
func (m *mutator) extension(ctx context.Context, ns string) (*extensionsv1alpha1.Extension, error) {
	var list extensionsv1alpha1.ExtensionList
	if err := m.reader.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return nil, fmt.Errorf("list extensions in %s: %w", ns, err)
	}
	for i := range list.Items {
		if list.Items[i].Spec.Type == ExtensionType {
			return &list.Items[i], nil
		}
	}
	return nil, nil
}

// hasSucceeded reports whether the Extension's first reconcile has succeeded (its lastOperation
// is no longer an unfinished Create, as Gardener's GetLastOperationType decides), so the
// shoot's route exists. Later reconciles in progress or failed do not count against it: DNS
// must not flip back to Istio on every reconcile.
func hasSucceeded(ext *extensionsv1alpha1.Extension) bool {
	op := ext.Status.LastOperation
	return op != nil && (op.Type != gardencorev1beta1.LastOperationTypeCreate || op.State == gardencorev1beta1.LastOperationStateSucceeded)
}
