package idlemem

import (
	"context"
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
