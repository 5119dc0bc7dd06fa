package probe

import (
	"runtime"
	"testing"
)

// sampled is how many allocations the heap profile has recorded so far.
func sampled() int64 {
	// The profile publishes a cycle's samples once later GCs have run (runtime.MemProfile).
	for range 3 {
		runtime.GC()
	}
	n, _ := runtime.MemProfile(nil, true)
	records := make([]runtime.MemProfileRecord, n+64)
	n, _ = runtime.MemProfile(records, true)
	var objects int64
	for _, r := range records[:n] {
		objects += r.AllocObjects
	}
	return objects
}

var sink []byte

// allocate allocates 64 MiB, 128 samples at the default rate of one per 512 KiB.
func allocate() {
	for range 64 << 10 {
		sink = make([]byte, 1<<10)
	}
}

func TestSampleHeap(t *testing.T) {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	SampleHeap(true)
	before := sampled()
	allocate()
	if sampled() == before {
		t.Fatalf("with profiling: 64 MiB allocated and no sample recorded (rate %d)", runtime.MemProfileRate)
	}
	SampleHeap(false)
	before = sampled()
	allocate()
	// Each P samples once more when it sees the rate change (runtime.profilealloc), then never.
	if after := sampled(); after-before > int64(runtime.GOMAXPROCS(0)) {
		t.Fatalf("without profiling: %d allocations sampled of 64 MiB (%d Ps)", after-before, runtime.GOMAXPROCS(0))
	}
}
