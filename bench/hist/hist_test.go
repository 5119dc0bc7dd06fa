package hist

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestBucketBounds(t *testing.T) {
	// Every value lies inside the bounds of its bucket, and buckets are
	// contiguous: the next bucket starts right after the previous one ends.
	for _, v := range []uint64{0, 1, 127, 128, 255, 256, 257, 511, 512, 1000, 1 << 20, 123456789, 1 << 39} {
		b := bucket(v)
		lo, hi := bounds(b)
		if v < lo || v > hi {
			t.Errorf("value %d in bucket %d with bounds [%d, %d]", v, b, lo, hi)
		}
		if float64(hi-lo) > float64(lo)/subCount {
			t.Errorf("bucket %d [%d, %d] wider than 1/%d of its lower bound", b, lo, hi, subCount)
		}
	}
	for b := 0; b < numBuckets-1; b++ {
		_, hi := bounds(b)
		lo, _ := bounds(b + 1)
		if lo != hi+1 {
			t.Fatalf("bucket %d ends at %d, bucket %d starts at %d", b, hi, b+1, lo)
		}
	}
}

func TestPercentileExact(t *testing.T) {
	// Values below 256 ns are stored exactly, so nearest-rank percentiles of
	// 1..100 ns are exact.
	var h Histogram
	for v := 100; v >= 1; v-- {
		h.Record(time.Duration(v))
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{{0.01, 1}, {0.5, 50}, {0.9, 90}, {0.99, 99}, {0.999, 100}, {1, 100}} {
		if got := h.Percentile(tc.q); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.q*100, got, tc.want)
		}
	}
	if h.Count() != 100 || h.Min() != 1 || h.Max() != 100 {
		t.Errorf("count/min/max = %d/%v/%v, want 100/1ns/100ns", h.Count(), h.Min(), h.Max())
	}
	if got, want := h.Mean(), time.Duration(51); got != want { // 50.5 rounds to 51
		t.Errorf("mean = %v, want %v", got, want)
	}
}

func TestPercentileLatencies(t *testing.T) {
	// Known data: 1 ms … 10 ms in 1 µs steps, plus a 1% tail at 50 ms.
	var h Histogram
	var all []time.Duration
	for v := time.Millisecond; v <= 10*time.Millisecond; v += time.Microsecond {
		all = append(all, v)
	}
	for range len(all) / 99 {
		all = append(all, 50*time.Millisecond)
	}
	rand.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	for _, v := range all {
		h.Record(v)
	}
	slices.Sort(all)
	for _, q := range []float64{0.5, 0.9, 0.98, 0.995, 1} {
		want := all[int(float64(len(all))*q+0.999999)-1] // nearest rank
		got := h.Percentile(q)
		if diff := float64(got-want) / float64(want); diff > 1.0/subCount || diff < -1.0/subCount {
			t.Errorf("p%v = %v, want %v ±%.2f%%", q*100, got, want, 100.0/subCount)
		}
	}
	if h.Max() != 50*time.Millisecond || h.Min() != time.Millisecond {
		t.Errorf("min/max = %v/%v, want 1ms/50ms", h.Min(), h.Max())
	}
}

func TestMerge(t *testing.T) {
	var a, b, all Histogram
	for i := range 1000 {
		d := time.Duration(i) * time.Microsecond
		all.Record(d)
		if i%2 == 0 {
			a.Record(d)
		} else {
			b.Record(d)
		}
	}
	var m Histogram
	m.Merge(&a)
	m.Merge(&b)
	m.Merge(&Histogram{}) // empty: no effect
	for _, q := range []float64{0.1, 0.5, 0.99} {
		if m.Percentile(q) != all.Percentile(q) {
			t.Errorf("merged p%v = %v, want %v", q*100, m.Percentile(q), all.Percentile(q))
		}
	}
	if m.Count() != all.Count() || m.Min() != all.Min() || m.Max() != all.Max() || m.Mean() != all.Mean() {
		t.Errorf("merged summary differs: %d %v %v %v vs %d %v %v %v",
			m.Count(), m.Min(), m.Max(), m.Mean(), all.Count(), all.Min(), all.Max(), all.Mean())
	}
}

func TestEmpty(t *testing.T) {
	var h Histogram
	if h.Percentile(0.5) != 0 || h.Mean() != 0 || h.Count() != 0 {
		t.Errorf("empty histogram: p50 %v mean %v count %d", h.Percentile(0.5), h.Mean(), h.Count())
	}
}
