package realseed

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"

	extensionscontroller "github.com/gardener/gardener/extensions/pkg/controller"
	"github.com/gardener/gardener/extensions/pkg/controller/dnsrecord"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/go-logr/logr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/tendril-net/tendril/internal/kube/kubescheme"
)

// DNSProviderType is the DNS provider of this seed: DNSRecords of this type are served by the
// cluster's CoreDNS, as provider-local serves them in Gardener's local setup.
const DNSProviderType = "local"

// dnsRecordsFile is the hosts file CoreDNS's hosts plugin serves (re-read every second), in the
// state directory, mounted into the CoreDNS pod.
func (c *Cluster) dnsRecordsDir() string { return c.path("dns") }

// hostsActuator is a DNSRecord actuator for Gardener's dnsrecord controller: it writes each
// record's addresses into the hosts file. A CNAME cannot be a hosts entry and is refused.
type hostsActuator struct {
	path string
	mu   sync.Mutex
	// records are name → addresses.
	records map[string][]string
}

func (a *hostsActuator) Reconcile(_ context.Context, _ logr.Logger, dns *extensionsv1alpha1.DNSRecord, _ *extensionscontroller.Cluster) error {
	switch dns.Spec.RecordType {
	case extensionsv1alpha1.DNSRecordTypeA, extensionsv1alpha1.DNSRecordTypeAAAA:
	default:
		return fmt.Errorf("DNSRecord %s/%s: record type %s: the local provider serves A and AAAA only", dns.Namespace, dns.Name, dns.Spec.RecordType)
	}
	for _, v := range dns.Spec.Values {
		if _, err := netip.ParseAddr(v); err != nil {
			return fmt.Errorf("DNSRecord %s/%s: value %q is not an address", dns.Namespace, dns.Name, v)
		}
	}
	return a.set(dns.Spec.Name, dns.Spec.Values)
}

func (a *hostsActuator) Delete(_ context.Context, _ logr.Logger, dns *extensionsv1alpha1.DNSRecord, _ *extensionscontroller.Cluster) error {
	return a.set(dns.Spec.Name, nil)
}

func (a *hostsActuator) ForceDelete(ctx context.Context, log logr.Logger, dns *extensionsv1alpha1.DNSRecord, c *extensionscontroller.Cluster) error {
	return a.Delete(ctx, log, dns, c)
}

func (a *hostsActuator) Restore(ctx context.Context, log logr.Logger, dns *extensionsv1alpha1.DNSRecord, c *extensionscontroller.Cluster) error {
	return a.Reconcile(ctx, log, dns, c)
}

func (a *hostsActuator) Migrate(context.Context, logr.Logger, *extensionsv1alpha1.DNSRecord, *extensionscontroller.Cluster) error {
	return nil
}

// set makes name resolve to addrs (none: removes it) and rewrites the file.
func (a *hostsActuator) set(name string, addrs []string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(addrs) == 0 {
		delete(a.records, name)
	} else {
		a.records[name] = slices.Clone(addrs)
	}
	var b strings.Builder
	b.WriteString("# DNSRecords of type " + DNSProviderType + " (realseed's local DNS provider)\n")
	names := make([]string, 0, len(a.records))
	for n := range a.records {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		for _, ip := range a.records[n] {
			fmt.Fprintf(&b, "%s %s\n", ip, n)
		}
	}
	return writeIfChanged(a.path, []byte(b.String()), 0o644)
}

// prepareDNSRecords makes the hosts file CoreDNS serves, empty.
func (c *Cluster) prepareDNSRecords() error {
	if err := os.MkdirAll(c.dnsRecordsDir(), 0o755); err != nil {
		return err
	}
	c.dnsActuator = &hostsActuator{path: c.dnsRecordsDir() + "/hosts", records: map[string][]string{}}
	return c.dnsActuator.set("", nil)
}

// startDNSProvider runs Gardener's dnsrecord controller with the hosts actuator for type local
// (after Gardener's CRDs are installed).
func (c *Cluster) startDNSProvider(ctx context.Context) error {
	act := c.dnsActuator
	mgr, err := manager.New(c.REST, manager.Options{
		Scheme:                 kubescheme.New(),
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 logr.Discard(),
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		return err
	}
	// No gardenlet annotates the records here: reconcile every change.
	if err := dnsrecord.Add(mgr, dnsrecord.AddArgs{
		Actuator:                  act,
		Type:                      DNSProviderType,
		IgnoreOperationAnnotation: true,
		Predicates:                dnsrecord.DefaultPredicates(ctx, mgr, true),
		ControllerOptions:         controller.Options{MaxConcurrentReconciles: 1},
	}); err != nil {
		return fmt.Errorf("dnsrecord controller: %w", err)
	}
	c.background("local DNS provider", mgr)
	return nil
}
