package procscale

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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
	waitProcs(t, 1)

	// Two goroutines that never block use the one processor fully: more are given.
	stop := burn(2)
	waitProcs(t, 2)
	stop()
	if changes.Load() < 2 {
		t.Errorf("%d changes reported, want at least 2", changes.Load())
	}
	waitProcs(t, 1)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := runtime.GOMAXPROCS(0); n != 2 {
		t.Errorf("GOMAXPROCS %d after Run, want Max (2)", n)
	}
}

// waitProcs waits until GOMAXPROCS is want (30 s at most: a failure, not a measurement).
func waitProcs(t *testing.T, want int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for runtime.GOMAXPROCS(0) != want {
		if time.Now().After(deadline) {
			t.Fatalf("GOMAXPROCS %d, want %d", runtime.GOMAXPROCS(0), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// burn starts n goroutines that never block, until the returned func is called (and waits).
func burn(n int) (stop func()) {
	done := make(chan struct{})
	var burners sync.WaitGroup
	for range n {
		burners.Go(func() {
			for x := 0; ; x++ {
				if x%1024 == 0 {
					select {
					case <-done:
						return
					default:
					}
				}
			}
		})
	}
	return func() { close(done); burners.Wait() }
}

// TestRunFollowsCPUs: with no fixed Max, a busy process keeps within the CPUs it may run on when
// they change while it runs (here its threads' affinity, as a changed CPU set; a cgroup's CPU
// limit reaches the runtime's default the same way, but not below 2), and gets them back.
func TestRunFollowsCPUs(t *testing.T) {
	orig := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(orig) })
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		t.Fatal(err)
	}
	if all.Count() < 2 {
		t.Skipf("%d CPUs: the test needs 2", all.Count())
	}
	one := unix.CPUSet{}
	for cpu := range 1024 {
		if all.IsSet(cpu) {
			one.Set(cpu)
			break
		}
	}
	t.Cleanup(func() { setAffinity(t, &all) })
	want := runtimeDefault()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Interval: 20 * time.Millisecond, LimitInterval: 100 * time.Millisecond})
	}()
	waitProcs(t, 1) // idle: Run has set GOMAXPROCS, so the runtime no longer follows the CPUs itself
	stop := burn(2)
	waitProcs(t, min(want, 2))
	setAffinity(t, &one)
	waitProcs(t, 1)
	setAffinity(t, &all)
	waitProcs(t, min(want, 2))
	stop()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := runtime.GOMAXPROCS(0); n != want {
		t.Errorf("GOMAXPROCS %d after Run, want the runtime's default %d", n, want)
	}
}

// setAffinity sets the CPUs of every thread of the process; threads started later inherit them
// from the thread that starts them. Twice, for a thread started during the first pass.
func setAffinity(t *testing.T, set *unix.CPUSet) {
	t.Helper()
	for range 2 {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil {
				continue
			}
			// A thread that ended meanwhile is ESRCH: nothing to set.
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				t.Fatalf("sched_setaffinity %d: %v", tid, err)
			}
		}
	}
}
