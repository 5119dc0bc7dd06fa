package kubesource

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	tendrilv1alpha1 "github.com/tendril-net/tendril/apis/tendril/v1alpha1"
)

// retryDelay is the wait before a failed status write is tried again.
const retryDelay = time.Second

// statusWriter writes Route status off the source's loop, so a slow API server never holds the
// route set back. Its queue holds the latest wanted condition per Route (newer replaces older),
// so it is bounded by the number of Routes.
type statusWriter struct {
	client  client.Client
	log     logr.Logger
	metrics *metrics

	mu     sync.Mutex
	queue  map[types.NamespacedName]metav1.Condition
	signal chan struct{}
	// written is the last condition written per Route until the cache reflects it, so that
	// the write is not queued again meanwhile.
	written map[types.NamespacedName]metav1.Condition
}

func newStatusWriter(c client.Client, log logr.Logger, m *metrics) *statusWriter {
	return &statusWriter{
		client: c, log: log, metrics: m,
		queue:   make(map[types.NamespacedName]metav1.Condition),
		signal:  make(chan struct{}, 1),
		written: make(map[types.NamespacedName]metav1.Condition),
	}
}

// enqueue asks for c to be written to the Route key, unless it was just written.
func (w *statusWriter) enqueue(key types.NamespacedName, c metav1.Condition) {
	w.mu.Lock()
	if last, ok := w.written[key]; ok && sameCondition(last, c) {
		w.mu.Unlock()
		return
	}
	w.queue[key] = c
	w.mu.Unlock()
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// settled says the cache shows key's wanted status.
func (w *statusWriter) settled(key types.NamespacedName) {
	w.mu.Lock()
	delete(w.written, key)
	w.mu.Unlock()
}

// forget drops the memory of Routes that are gone.
func (w *statusWriter) forget(live map[types.NamespacedName]string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for key := range w.written {
		if _, ok := live[key]; !ok {
			delete(w.written, key)
		}
	}
}

func (w *statusWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.signal:
		}
		w.mu.Lock()
		batch := w.queue
		w.queue = make(map[types.NamespacedName]metav1.Condition)
		w.mu.Unlock()
		for _, key := range slices.SortedFunc(maps.Keys(batch), compareKeys) {
			if ctx.Err() != nil {
				return
			}
			c := batch[key]
			// Remembered before the write, so that a condition computed from the cache while
			// the write is in flight is not queued again.
			w.mu.Lock()
			w.written[key] = c
			w.mu.Unlock()
			wrote, err := w.write(ctx, key, c)
			if err != nil {
				w.metrics.statusWrites.WithLabelValues("failed").Inc()
				if apierrors.IsConflict(err) {
					// The cache was behind the Route; the retry reads it again.
					w.log.V(1).Info("Route status write conflicted, retrying", "route", key)
				} else {
					w.log.Error(err, "Writing Route status", "route", key)
				}
				w.mu.Lock()
				delete(w.written, key)
				w.mu.Unlock()
				w.retry(ctx, key, c)
				continue
			}
			if wrote {
				w.metrics.statusWrites.WithLabelValues("written").Inc()
				w.log.V(1).Info("Route status written", "route", key, "generation", c.ObservedGeneration, "reason", c.Reason)
			}
		}
	}
}

// retry queues c again after retryDelay, unless a newer condition was queued meanwhile.
func (w *statusWriter) retry(ctx context.Context, key types.NamespacedName, c metav1.Condition) {
	time.AfterFunc(retryDelay, func() {
		if ctx.Err() != nil {
			return
		}
		w.mu.Lock()
		if _, newer := w.queue[key]; !newer {
			w.queue[key] = c
		}
		w.mu.Unlock()
		select {
		case w.signal <- struct{}{}:
		default:
		}
	})
}

// write patches the Route's status: observedGeneration and the Programmed condition, keeping
// its transition time unless the status flips. It reports whether it wrote: a Route that is
// gone, changed since (the source computes its condition again) or already carries c needs
// nothing.
func (w *statusWriter) write(ctx context.Context, key types.NamespacedName, c metav1.Condition) (bool, error) {
	var r tendrilv1alpha1.Route
	if err := w.client.Get(ctx, key, &r); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	if r.Generation != c.ObservedGeneration || !needsWrite(&r, c) {
		return false, nil
	}
	base := r.DeepCopy()
	r.Status.ObservedGeneration = c.ObservedGeneration
	meta.SetStatusCondition(&r.Status.Conditions, c)
	// An optimistic lock: a status computed from an older resource version must not win.
	err := w.client.Status().Patch(ctx, &r, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}))
	return err == nil, client.IgnoreNotFound(err)
}

func sameCondition(a, b metav1.Condition) bool {
	return a.Status == b.Status && a.Reason == b.Reason && a.Message == b.Message && a.ObservedGeneration == b.ObservedGeneration
}

func compareKeys(a, b types.NamespacedName) int {
	return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
}

type metrics struct {
	publishes     *prometheus.CounterVec
	buildDuration prometheus.Histogram
	routes        *prometheus.GaugeVec
	statusWrites  *prometheus.CounterVec
}

// states are the reasons of the Programmed condition, each a value of the routes gauge's label.
var states = []string{
	tendrilv1alpha1.ReasonProgrammed, tendrilv1alpha1.ReasonPending, tendrilv1alpha1.ReasonInvalid,
	tendrilv1alpha1.ReasonNoEndpoints, tendrilv1alpha1.ReasonRejected,
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		publishes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_kubesource_publishes_total", Help: "Route sets built from Kubernetes and applied to the xDS server, by outcome (applied, rejected).",
		}, []string{"outcome"}),
		buildDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_kubesource_build_seconds", Help: "Time to rebuild the touched namespaces and apply the route set.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
		routes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_kubesource_routes", Help: "Route objects by the reason of their Programmed condition.",
		}, []string{"state"}),
		statusWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_kubesource_status_writes_total", Help: "Route status writes, by outcome (written, failed).",
		}, []string{"outcome"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.publishes, m.buildDuration, m.routes, m.statusWrites} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) setStates(reasons map[types.NamespacedName]string) {
	counts := make(map[string]int, len(states))
	for _, r := range reasons {
		counts[r]++
	}
	for _, st := range states {
		m.routes.WithLabelValues(st).Set(float64(counts[st]))
	}
}
