// Package probe serves a tendril binary's Prometheus metrics and its /healthz and /readyz probes
// on one HTTP listener. It decides nothing about readiness itself: the binary says when it is
// ready.
package probe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
)

// Ready is a readiness flag with a reason, safe for concurrent use. The zero value is not ready.
type Ready struct {
	reason atomic.Pointer[string]
	ready  atomic.Bool
}

// Set marks the binary ready.
func (r *Ready) Set() { r.ready.Store(true) }

// Unset marks the binary not ready, saying why.
func (r *Ready) Unset(reason string) {
	r.reason.Store(&reason)
	r.ready.Store(false)
}

// Get reports readiness and, when not ready, why.
func (r *Ready) Get() (bool, string) {
	if r.ready.Load() {
		return true, ""
	}
	if p := r.reason.Load(); p != nil {
		return false, *p
	}
	return false, "starting"
}

// ReadyFunc reports readiness and, when not ready, why. (*Ready).Get is one.
type ReadyFunc func() (bool, string)

// SampleHeap says whether the Go runtime samples allocations for the heap profile; a binary
// calls it in main as soon as its flags say whether it serves the profiler (Handler's
// profiling): what package initialisation allocated before is sampled at the default rate.
// Linking the profiler (this package does) keeps the runtime's default of one sample per 512 KiB
// allocated, and each allocation stack sampled takes a page of the runtime's bucket table
// (179,999 × 8 bytes = 1.4 MB, pages touched at random), and those pages stay in
// tendril-server's resident memory after a load (docs/performance.md, "Memory after a load
// against a settled idle"), for a profile nobody can fetch. Off, the heap profile is empty.
func SampleHeap(profiling bool) {
	if !profiling {
		runtime.MemProfileRate = 0
	}
}

// Handler returns the HTTP handler for /metrics (from g), /healthz and /readyz (from ready), and
// with profiling the Go profiler under /debug/pprof/.
func Handler(g prometheus.Gatherer, ready ReadyFunc, profiling bool) http.Handler {
	mux := http.NewServeMux()
	if profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ok, reason := ready(); !ok {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Serve serves h on l until ctx ends, then shuts the server down.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	err := srv.Serve(l)
	cancel() // Serve failed by itself: release the shutdown goroutine
	wg.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("serve probes on %s: %w", l.Addr(), err)
}

// NewRegistry returns a registry holding the Go runtime's and the process's collectors, which
// every tendril binary exports beside its own metrics.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Start binds addr now with listen (net.Listen when nil; a taken port fails the binary's start)
// and serves Handler(g, ready, profiling) on it in group until ctx ends. An empty addr turns the
// probes off: Start does nothing.
func Start(ctx context.Context, group *errgroup.Group, listen func(network, addr string) (net.Listener, error), addr string, g prometheus.Gatherer, ready ReadyFunc, profiling bool) error {
	if addr == "" {
		return nil
	}
	if listen == nil {
		listen = net.Listen
	}
	l, err := listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	group.Go(func() error { return Serve(ctx, l, Handler(g, ready, profiling)) })
	return nil
}
