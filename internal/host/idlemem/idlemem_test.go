package idlemem

import (
	"context"
	"runtime/debug"
	"sync"
	"testing"
	"time"
)

func TestWatcher(t *testing.T) {
	const MiB = 1 << 20
	w := watcher{cfg: Config{IdleAllocs: 4 * MiB, LoadAllocs: 16 * MiB}}
	var now uint64
	step := func(alloc uint64, want bool) {
		t.Helper()
		now += alloc
		if got := w.check(now, 0); got != want {
			t.Fatalf("after %d MiB more (total %d MiB): release %v, want %v", alloc/MiB, now/MiB, got, want)
		}
		if want {
			now += MiB / 2 // the release's own GC allocates a little
			w.released(now, 0)
		}
	}
	step(MiB, false)    // idle from the start: nothing to give back
	step(20*MiB, false) // load
	step(30*MiB, false) // load
	step(MiB, true)     // the load is over: release
	step(MiB, true)     // and once more for the pools' victim caches
	step(MiB, false)    // idle: nothing more
	step(2*MiB, false)  // a trickle, below LoadAllocs since the release
	step(3*MiB, false)
	step(15*MiB, false) // load again
	step(0, true)       // over
	step(10*MiB, false) // load before the second release: it waits
	step(0, true)       // idle again: the second release
	step(0, false)      // 10 MiB since the first is no new load
}

// TestWatcherHeld: connections that end allocate next to nothing; their drop to half of the
// peak (and by HeldDrop) asks for the release.
func TestWatcherHeld(t *testing.T) {
	const MiB = 1 << 20
	w := watcher{cfg: Config{IdleAllocs: 4 * MiB, LoadAllocs: 1 << 40, HeldDrop: 1000}}
	var now uint64
	step := func(held int, want bool) {
		t.Helper()
		now += MiB / 4
		if got := w.check(now, held); got != want {
			t.Fatalf("held %d (peak %d): release %v, want %v", held, w.peak, got, want)
		}
		if want {
			w.released(now, held)
		}
	}
	step(10000, false) // connections opened (LoadAllocs out of reach: only Held decides here)
	step(9000, false)  // a tenth closed
	step(5001, false)  // not yet half
	step(5000, true)   // half: release
	step(5000, true)   // and the pools' victim caches
	step(4500, false)  // a drop below HeldDrop from the new peak
	step(2499, true)   // half of 5,000, by more than 1,000
	step(2499, true)
	step(1600, false) // a drop of 899 from 2,499: below HeldDrop
	step(1200, true)  // 1,299 down and under half
	step(1200, true)  // the victim caches
	step(5000, false) // new connections
	now += 40 * MiB   // a load of newer ones while most of those end
	if !w.check(now, 2000) {
		t.Fatal("no release for a drop of held under load")
	}
}

// TestRun: after a real load, Run releases twice, and not again while idle.
func TestRun(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	var mu sync.Mutex
	var releases int
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = Run(ctx, Config{Every: 100 * time.Millisecond, Released: func() {
			mu.Lock()
			releases++
			mu.Unlock()
		}})
	}()
	defer func() { cancel(); <-done }()
	// 64 MiB of garbage in 1 MiB pieces, well inside the first interval.
	var keep [][]byte
	for i := range 64 {
		keep = append(keep, make([]byte, 1<<20))
		keep[i][0] = byte(i)
	}
	keep = nil
	deadline := time.Now().Add(5 * time.Second)
	for {
		mu.Lock()
		n := releases
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d releases 5 s after the load, want 2", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // five idle intervals
	mu.Lock()
	defer mu.Unlock()
	if releases != 2 {
		t.Fatalf("%d releases, want 2 (none while idle)", releases)
	}
}

// TestRunIdleGCPercent: with the real runtime, Run sets the idle GC percent once an interval is
// idle, puts the one before back as soon as a load allocates, sets it again when the load is
// over, and puts it back when it returns; a GC percent already at or below the idle one stays.
func TestRunIdleGCPercent(t *testing.T) {
	before := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(before) }) // registered first: runs after Run has stopped
	// Checks every 2 s; while idle, a poll every 200 ms.
	const every = 2 * time.Second
	waitPercent := func(want int, what string, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for gcPercent() != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: GC percent %d, want %d", what, gcPercent(), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	run := func() (stop func()) {
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = Run(ctx, Config{Every: every, IdleGCPercent: 25})
		}()
		stop = func() { cancel(); <-done }
		t.Cleanup(stop) // after a failure too; a second call only waits for the closed done
		return stop
	}

	stop := run()
	waitPercent(25, "idle", 2*every)
	// A load, right after a check: 1 MiB a millisecond, far above a tenth of IdleAllocs (4 MiB)
	// per poll. The poll, not the next check, puts the percent back.
	loadCtx, cancelLoad := context.WithCancel(t.Context())
	loadStopped := make(chan struct{})
	stopLoad := func() { cancelLoad(); <-loadStopped }
	t.Cleanup(stopLoad)
	go func() {
		defer close(loadStopped)
		for {
			select {
			case <-loadCtx.Done():
				return
			case <-time.After(time.Millisecond):
				b := make([]byte, 1<<20)
				b[0] = 1
			}
		}
	}()
	waitPercent(100, "under a load, before the next check", every*3/4)
	// It stays back while the load goes on, past the next check.
	for range 5 {
		time.Sleep(every / 4)
		if p := gcPercent(); p != 100 {
			t.Fatalf("under a load: GC percent %d, want 100", p)
		}
	}
	stopLoad()
	waitPercent(25, "idle after the load", 2*every)
	stop()
	if p := gcPercent(); p != 100 {
		t.Fatalf("after Run returned: GC percent %d, want 100", p)
	}

	debug.SetGCPercent(20) // GOGC=20: already below the idle percent
	stop = run()
	time.Sleep(every * 3 / 2) // an idle interval
	p := gcPercent()
	stop()
	if p != 20 {
		t.Fatalf("GOGC 20: GC percent %d while idle, want 20 (left alone)", p)
	}
	if p := gcPercent(); p != 20 {
		t.Fatalf("GOGC 20: GC percent %d after Run, want 20", p)
	}
}
