package loops

import (
	"testing"
	"time"
)

// BenchmarkIdleSweep measures one idle sweep of a loop holding 50,000 idle pairs (half of
// 100,000 on a 2-core replica), none of them due: the work an idle replica does every second
// per loop. The pairs are bookkeeping only (no sockets), which is all a sweep touches.
func BenchmarkIdleSweep(b *testing.B) {
	l := &loop{socks: map[int32]*sock{}, dialing: map[int32]*Socket{}}
	const pairs = 50_000
	for i := range pairs {
		p := &pair{g: &Group{}, idle: time.Hour}
		p.a.fd, p.a.p = 2*i, p
		p.b.fd, p.b.p = 2*i+1, p
		l.socks[int32(p.a.fd)], l.socks[int32(p.b.fd)] = &p.a, &p.b
	}
	now := time.Minute
	b.ResetTimer()
	for b.Loop() {
		last := time.Duration(0)
		l.sweep(&last, now)
		if len(l.socks) != 2*pairs {
			b.Fatalf("the sweep closed %d pairs", pairs-len(l.socks)/2)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/sweep")
}
