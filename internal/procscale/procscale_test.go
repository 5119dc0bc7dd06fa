package procscale

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestNext(t *testing.T) {
	for _, tc := range []struct {
		name             string
		used             float64
		cur, limit, calm int
		want, wantCalm   int
	}{
		{"idle: one calm sample more", 0.05, 2, 2, 0, 2, 1},
		{"idle: the last calm sample", 0.05, 2, 2, calmSamples - 1, 1, 0},
		{"busy: more at once", 0.6, 1, 2, 0, 2, 0},
		{"very busy: up to the limit", 3.5, 1, 4, 0, 4, 0},
		{"very busy: as many as half-busy needs", 1.2, 1, 8, 0, 3, 0},
		{"between the targets: no change, calm starts over", 0.45, 2, 2, 3, 2, 0},
		{"just above the calm target: stays", 0.36, 1, 2, 0, 1, 0},
		{"one processor idle: stays", 0, 1, 2, 0, 1, 0},
		{"down by the calm target", 0.6, 4, 4, calmSamples - 1, 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, calm := next(tc.used, tc.cur, tc.limit, tc.calm)
			if n != tc.want || calm != tc.wantCalm {
				t.Errorf("next(%v, cur %d, limit %d, calm %d) = %d, %d; want %d, %d", tc.used, tc.cur, tc.limit, tc.calm, n, calm, tc.want, tc.wantCalm)
			}
		})
	}
}

// TestRun: an idle process goes down to one processor, a busy one back up, and Run leaves Max
// behind. Nothing here is timed: it waits for the changes.
func TestRun(t *testing.T) {
	orig := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(orig) })
	ctx, cancel := context.WithCancel(context.Background())
	var changes atomic.Int64
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Max: 2, Interval: 20 * time.Millisecond, Changed: func(int, float64) { changes.Add(1) }})
	}()
	waitProcs := func(want int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for runtime.GOMAXPROCS(0) != want {
			if time.Now().After(deadline) {
				t.Fatalf("GOMAXPROCS %d, want %d", runtime.GOMAXPROCS(0), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitProcs(1)

	// Two goroutines that never block use the one processor fully: more are given.
	stop := make(chan struct{})
	var burners sync.WaitGroup
	for range 2 {
		burners.Add(1)
		go func() {
			defer burners.Done()
			for x := 0; ; x++ {
				if x%1024 == 0 {
					select {
					case <-stop:
						return
					default:
					}
				}
			}
		}()
	}
	waitProcs(2)
	close(stop)
	burners.Wait()
	if changes.Load() < 2 {
		t.Errorf("%d changes reported, want at least 2", changes.Load())
	}
	waitProcs(1)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := runtime.GOMAXPROCS(0); n != 2 {
		t.Errorf("GOMAXPROCS %d after Run, want Max (2)", n)
	}
}
