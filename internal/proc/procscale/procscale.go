// Package procscale keeps the Go scheduler's processor count (GOMAXPROCS) near what the process
// uses: a process that uses a fifth of a core runs on one processor, one that needs more gets
// more at once, up to its maximum.
//
// Why: an idle processor costs CPU on every event. When a goroutine is woken and a processor is
// idle, Go's scheduler wakes another thread to look for work on it, which finds none and sleeps
// again. tendril-ingress at one client made fewer system calls per connection with one
// processor than with two, the difference being the scheduler's epoll_pwait and futex calls
// (docs/performance.md, "The processors the ingress runs on"). An event loop such as HAProxy's
// sleeps in epoll_wait on each thread and wakes one.
//
// Go updates its default GOMAXPROCS when the CPUs a process may run on or its cgroup's CPU limit
// change (a pod resized in place, a CPU set changed), but not once a program has set it, as this
// package does; so with no fixed Max, Run reads the runtime's default again every LimitInterval
// and keeps within it. It does not pin threads or goroutines.
package procscale

import (
	"context"
	"math"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// Config configures Run. The zero value works.
type Config struct {
	// Max is the most processors. If zero, the runtime's default (the CPUs the process may run
	// on, or its cgroup's CPU limit rounded up, at least 2: runtime.GOMAXPROCS), read again every
	// LimitInterval.
	Max int
	// Interval is the time between two samples of the process's CPU time. If zero,
	// DefaultInterval.
	Interval time.Duration
	// LimitInterval is the time between two readings of the runtime's default when Max is zero.
	// If zero, DefaultLimitInterval.
	LimitInterval time.Duration
	// Changed, if set, is called after every change of GOMAXPROCS (metrics, logs).
	Changed func(procs int, used float64)
}

// DefaultInterval samples five times a second: a burst waits at most that long for more
// processors, on the one or more it has.
const DefaultInterval = 200 * time.Millisecond

// DefaultLimitInterval follows a changed CPU limit within 10 s. A reading stops the world twice
// (runtime.SetDefaultGOMAXPROCS, then the count chosen again), each for microseconds: with 10 s
// between them, nothing a connection would notice.
const DefaultLimitInterval = 10 * time.Second

const (
	// busyTarget is the share of each processor the process may use before it gets another:
	// at half, the scheduler rarely finds every processor taken when a goroutine wakes.
	busyTarget = 0.5
	// calmTarget is the share below which processors are taken away, lower than busyTarget so
	// that a process near the boundary does not flip between two counts.
	calmTarget = 0.35
	// calmSamples is how many samples in a row must ask for fewer processors before they are
	// taken away (5 × 200 ms = 1 s): a short lull does not shrink a busy process.
	calmSamples = 5
)

// Run sets GOMAXPROCS every Interval from the CPU time the process used in the last one, until
// ctx ends; then it leaves Max behind (with Max zero, the runtime's default and its own updates).
// It starts at the most.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.LimitInterval <= 0 {
		cfg.LimitInterval = DefaultLimitInterval
	}
	follow := cfg.Max <= 0
	limit := cfg.Max
	if follow {
		limit = runtimeDefault()
		defer runtime.SetDefaultGOMAXPROCS()
	} else {
		runtime.GOMAXPROCS(limit)
		defer runtime.GOMAXPROCS(limit)
	}
	last := limit // the count at the previous sample
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	lastCPU, err := cpuTime()
	if err != nil {
		return err
	}
	lastWall := time.Now()
	lastLimit := lastWall
	calm := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		cpu, err := cpuTime()
		if err != nil {
			return err
		}
		now := time.Now()
		used := float64(cpu-lastCPU) / float64(now.Sub(lastWall))
		lastCPU, lastWall = cpu, now
		// Read, not remembered: right after runtimeDefault, until Run sets it again, the runtime
		// updates GOMAXPROCS on its own.
		cur := runtime.GOMAXPROCS(0)
		if follow && now.Sub(lastLimit) >= cfg.LimitInterval {
			limit, lastLimit = runtimeDefault(), now
			if cur = min(cur, limit); cur != limit {
				runtime.GOMAXPROCS(cur)
			}
		}
		var n int
		n, calm = next(used, cur, limit, calm)
		if n != cur {
			runtime.GOMAXPROCS(n)
		}
		if n != last {
			last = n
			if cfg.Changed != nil {
				cfg.Changed(n, used)
			}
		}
	}
}

// runtimeDefault sets GOMAXPROCS to the runtime's default and returns it.
func runtimeDefault() int {
	runtime.SetDefaultGOMAXPROCS()
	return runtime.GOMAXPROCS(0)
}

// next is the processor count after a sample in which the process used used cores with cur
// processors (at most limit), and the new count of calm samples. More processors are given at
// once, fewer only after calmSamples samples in a row that all asked for fewer.
func next(used float64, cur, limit, calm int) (int, int) {
	if up := procsFor(used, busyTarget, limit); up > cur {
		return up, 0
	}
	down := procsFor(used, calmTarget, limit)
	if down >= cur {
		return cur, 0
	}
	if calm+1 < calmSamples {
		return cur, calm + 1
	}
	return down, 0
}

// procsFor is how many processors keep each at most share busy with used cores, 1 to limit.
func procsFor(used, share float64, limit int) int {
	return min(limit, max(1, int(math.Ceil(used/share))))
}

// cpuTime is the CPU time the process used so far, user and system, all threads. Linux's
// getrusage sums the threads' exact run times (it splits them into user and system by ticks).
func cpuTime() (time.Duration, error) {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}
