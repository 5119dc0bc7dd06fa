package accept

import (
	"cmp"
	"sync"
	"time"

	"github.com/go-logr/logr"
)

// LimitedLog logs at most Burst lines per Interval and counts the rest, so that a flood of
// refused connections cannot flood the log (the refusals are counted in full by the metrics);
// the next line that gets through says how many were dropped ("suppressedSinceLast"). Its zero
// value discards its lines (the zero logr.Logger); it is safe for concurrent use. It holds a
// few words whatever the flood: the dropped lines are a count, not a queue.
type LimitedLog struct {
	// Log receives the lines.
	Log logr.Logger
	// Burst is how many lines one Interval may log. If zero, 10.
	Burst int
	// Interval is the window Burst applies to. If zero, 1 s.
	Interval time.Duration

	mu         sync.Mutex
	windowEnd  time.Time
	used       int
	suppressed int
}

// Info logs msg with kv unless this window's Burst is used up.
func (r *LimitedLog) Info(msg string, kv ...any) {
	burst, interval := r.Burst, r.Interval
	burst = cmp.Or(burst, 10)
	interval = cmp.Or(interval, time.Second)
	r.mu.Lock()
	now := time.Now()
	if now.After(r.windowEnd) {
		r.windowEnd, r.used = now.Add(interval), 0
	}
	if r.used >= burst {
		r.suppressed++
		r.mu.Unlock()
		return
	}
	r.used++
	suppressed := r.suppressed
	r.suppressed = 0
	r.mu.Unlock()
	if suppressed > 0 {
		kv = append(kv, "suppressedSinceLast", suppressed)
	}
	r.Log.Info(msg, kv...)
}
