// Package idlemem gives the memory of a load back to the system once the load is over.
//
// Go returns freed heap to the system only slowly on its own: garbage is found by a GC, which an
// idle process that allocates nothing does not start before its forced GC every 2 minutes; the
// sync.Pools of copy buffers (edge/loops, server's read-ahead and gRPC buffers, gVisor's
// buffer chunks) drop their contents only over two GCs; and the background scavenger returns
// free pages at a bounded rate, keeping some for the next allocations. After a dial-rate run
// tendril-server and tendril-agent stayed near their peak for minutes (docs/performance.md,
// "Dial stalls and memory after a load"). A seed runs one tendril-server per shoot, so memory
// that stays after a load adds up.
//
// What stays live is not its business: a release returns only free pages. The pools it lets
// empty are bounded by the load that filled them (each buffer in a sync.Pool was in use at once:
// up to two 128 KiB relay buffers per connection through a netstack moving bytes at once,
// bounded by the server's dials in flight and the agent's Forward.MaxInFlight plus its open
// connections; idle connections hold none).
//
// Run watches the allocation rate and, once an interval allocated next to nothing after one that
// did (the load is over), runs debug.FreeOSMemory (a GC, then every free page back to the system)
// and once more an interval later, when the pools' victim caches from the first GC are garbage
// too. Under load it does nothing: pages handed back would fault in again at once. With
// Config.IdleGCPercent it also keeps the heap of an idle process near what is live: GOGC lets
// garbage grow to the live heap again (at least 4 MiB) before a GC, which an idle process reaches
// only slowly, so its RSS carries up to that much garbage for minutes.
// ReleaseBinaryPages drops the code pages a load (or start-up) faulted in; Held drops the pages
// of buffers a reader keeps for good (wireguard-go's) once its reads are small; TunnelSoftLimitMiB
// is the soft memory limit that bounds a load's peak in the tunnel's processes.
package idlemem

import (
	"cmp"
	"context"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

const (
	// DefaultEvery is how often Config.Every checks: two idle intervals after a load fit into the
	// goal of being back at the idle RSS within 60 s of the load's end, with a margin for the
	// interval in which the load ended.
	DefaultEvery = 10 * time.Second
	// DefaultIdleAllocs is the allocation (bytes per interval) below which an interval counts as
	// idle: an idle server's heartbeats, WireGuard keepalives and metrics scrapes allocate well
	// under 1 MiB in 10 s; one dial through the tunnel allocates 50–100 KiB, so 4 MiB is a few
	// dials per second.
	DefaultIdleAllocs = 4 << 20
	// DefaultLoadAllocs is how much must have been allocated since the last release for a
	// release to be worth a GC: less cannot have grown the heap by much.
	DefaultLoadAllocs = 16 << 20
)

// TunnelSoftLimitMiB is the soft memory limit (runtime/debug.SetMemoryLimit, GOMEMLIMIT) that
// tendril-server and tendril-agent set by default. It bounds the peak of a load, which Run does
// not: without it the Go heap grows to twice what is live (GOGC 100) before a GC, and a load's
// live data is mostly bytes in flight, bounded by the inner TCP windows (up to 8 MiB received
// per bulk connection, tunnel/netstack) and the relays' 128 KiB buffers. Under tendril-bench
// tunnel's load, 32 MiB brings both peaks down to the low end of konnectivity's under the same
// load with no more CPU per MB than without a limit (docs/performance.md, "kube-apiserver's
// gRPC egress over one connection, and the tunnel's peak memory"), so the live data of that
// load is below 32 MiB and the limit only takes the GC's slack away. Live data beyond the limit
// is not refused: the GC runs more often, and Go caps its CPU at half the process's.
const TunnelSoftLimitMiB = 32

// Config tunes Run; the zero value takes the defaults.
type Config struct {
	// Every is the interval between checks. 0 means DefaultEvery.
	Every time.Duration
	// IdleAllocs: an interval that allocated less is idle. 0 means DefaultIdleAllocs.
	IdleAllocs uint64
	// LoadAllocs: a release follows only if this much was allocated since the last one. 0 means
	// DefaultLoadAllocs.
	LoadAllocs uint64
	// Released, if set, is called after every release (metrics, tests).
	Released func()
	// Held, if set, reports how much of a load the process still holds, such as the ingress's
	// open connections. Their memory becomes garbage when they end, with nothing allocated to
	// show it, so a drop of Held to half of its peak since the last release, and by at least
	// HeldDrop, asks for a release at once, idle or not.
	Held func() int
	// HeldDrop is the least drop of Held that asks for a release. 0 means DefaultHeldDrop.
	HeldDrop int
	// IdleGCPercent, if above 0 and below the GC percent in effect (GOGC), is the GC percent
	// while the process is idle: from the first idle interval until a tenth of an interval
	// allocates a tenth of IdleAllocs (checked every Every/10 while idle), then the percent in
	// effect before. 0 leaves the GC percent alone.
	IdleGCPercent int
}

// TunnelIdleGCPercent is the idle GC percent of tendril-server and tendril-agent. An idle
// tendril-server's live heap is 2–3 MB; with GOGC 100 the heap grows to twice that, and at least
// to the runtime's 4 MiB minimum, before a GC: up to ~3 MB of garbage in the RSS of every idle
// server of a seed, which its idle allocation (heartbeats, keepalives and a metrics scrape every
// 15 s: ~15 KB a second) reaches in about four minutes, and the GC's freed pages stay resident
// until the scavenger takes them. At 25 the garbage stays under a quarter of the live heap,
// 0.6–0.75 MB, and the minimum is 1 MiB (4 MiB × 25 / 100): a GC every ~45 s at that rate, each
// marking ~3 MB, well under a millisecond of CPU. Under a load the percent is back within a
// second (Every/10): a lower percent under load costs dials (docs/performance.md, "An idle
// server's garbage").
const TunnelIdleGCPercent = 25

// DefaultHeldDrop is Config.HeldDrop's default: the ingress's 1,000 connections are about 1 MiB
// of heap (≈ 1.1 KiB each, e2e/TestIdleConnectionsThroughTheIngress), the least worth a GC.
const DefaultHeldDrop = 1000

// Run releases memory after each load (see the package comment) until ctx ends; it returns nil.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Every <= 0 {
		cfg.Every = DefaultEvery
	}
	cfg.IdleAllocs = cmp.Or(cfg.IdleAllocs, DefaultIdleAllocs)
	cfg.LoadAllocs = cmp.Or(cfg.LoadAllocs, DefaultLoadAllocs)
	cfg.HeldDrop = cmp.Or(cfg.HeldDrop, DefaultHeldDrop)
	held := func() int {
		if cfg.Held == nil {
			return 0
		}
		return cfg.Held()
	}
	tick := time.NewTicker(cfg.Every)
	defer tick.Stop()
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	allocated := func() uint64 { // bytes allocated on the heap since the process started
		metrics.Read(sample)
		return sample[0].Value.Uint64()
	}
	w := watcher{cfg: cfg, last: allocated()}
	w.sinceRelease = w.last
	// While idle: the idle GC percent, and a poll every tenth of an interval for a load's start.
	var gc idleGC
	defer gc.leave()
	var polled uint64 // allocated at the last poll
	// A poll saw a load begin in this interval: the interval may still count as idle (less than
	// IdleAllocs in all), but the idle percent waits for the next one.
	var polledLoad bool
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-gc.polls():
			now := allocated()
			if now-polled >= cfg.IdleAllocs/10 {
				gc.leave()
				polledLoad = true
			}
			polled = now
		case <-tick.C:
			if w.check(allocated(), held()) {
				debug.FreeOSMemory()
				w.released(allocated(), held())
				if cfg.Released != nil {
					cfg.Released()
				}
			}
			switch {
			case !w.idle:
				gc.leave()
			case polledLoad:
			case gc.enter(cfg.IdleGCPercent, cfg.Every/10):
				polled = allocated()
			}
			polledLoad = false
		}
	}
}

// idleGC sets the idle GC percent, with a poll ticker, and puts the percent in effect before back.
type idleGC struct {
	before int          // the percent in effect before enter
	poll   *time.Ticker // non-nil while the idle percent is in effect
}

// enter sets the GC percent to idle and starts the poll, if idle is above 0 and below the percent
// in effect and the idle percent is not in effect yet; it reports whether enter started it.
func (g *idleGC) enter(idle int, poll time.Duration) bool {
	if g.poll != nil || idle <= 0 || gcPercent() <= idle {
		return false
	}
	g.before = debug.SetGCPercent(idle)
	g.poll = time.NewTicker(poll)
	return true
}

// polls is the poll ticker's channel while the idle percent is in effect, else nil (never ready).
func (g *idleGC) polls() <-chan time.Time {
	if g.poll == nil {
		return nil
	}
	return g.poll.C
}

// leave stops the poll and puts the percent in effect before enter back.
func (g *idleGC) leave() {
	if g.poll != nil {
		g.poll.Stop()
		g.poll = nil
		debug.SetGCPercent(g.before)
	}
}

// gcPercent is the GC percent in effect (GOGC; off reads as -1).
func gcPercent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(int32(s[0].Value.Uint64()))
}

// watcher decides on releases from the cumulative allocation count; it holds no clock, so that
// its decisions are tested without one.
type watcher struct {
	cfg          Config
	last         uint64 // allocated at the previous check
	sinceRelease uint64 // allocated right after the last release (or at the start)
	again        bool   // one more release is due at the next idle interval
	peak         int    // the most Held since the last release
	idle         bool   // the last interval checked allocated less than IdleAllocs
}

// check reports whether to release now, given the allocation count and Held now.
func (w *watcher) check(now uint64, held int) bool {
	delta := now - w.last
	w.last = now
	w.peak = max(w.peak, held)
	w.idle = delta < w.cfg.IdleAllocs
	if w.peak > held && w.peak-held >= w.cfg.HeldDrop && held <= w.peak/2 {
		// What was held has mostly ended: that is garbage now, whatever else allocates
		// meanwhile (new connections, scrapes). As after a load, the pools' victim caches
		// are released at the next idle interval.
		w.again = true
		return true
	}
	if delta >= w.cfg.IdleAllocs {
		return false // under load
	}
	switch {
	case now-w.sinceRelease >= w.cfg.LoadAllocs:
		// A load came and went. Its pools survive the first GC in their victim caches;
		// the next idle interval releases them.
		w.again = true
		return true
	case w.again:
		w.again = false
		return true
	}
	return false
}

// released records a release that ended with the allocation count and Held now.
func (w *watcher) released(now uint64, held int) {
	w.last, w.sinceRelease, w.peak = now, now, held
}
