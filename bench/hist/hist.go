// Package hist records durations in a fixed-size log-linear histogram and
// answers percentile queries on it.
//
// It is in the style of HdrHistogram: values below 256 ns are stored exactly,
// larger values in buckets whose width is at most 1/128 of their lower bound,
// so a reported percentile is within 0.8 % of the recorded value. A Histogram
// is not safe for concurrent use: the load generator keeps one per worker and
// merges them after the workers have stopped, which keeps the hot path free of
// locks. It does not compute anything but counts, extremes, a mean and
// percentiles.
package hist

import (
	"math"
	"math/bits"
	"time"
)

const (
	// subBits sets the precision: 2^subBits linear sub-buckets per power of two.
	subBits  = 7
	subCount = 1 << subBits
	// maxShift bounds the range: values up to 2^(maxShift+subBits+1) ns
	// (about 2^40 ns ≈ 18 minutes) get their own bucket; larger ones are
	// clamped into the last bucket (a connection in a benchmark never takes
	// that long, its deadlines are seconds).
	maxShift   = 32
	numBuckets = (maxShift + 2) * subCount
)

// Histogram counts durations. The zero value is empty and ready to use.
type Histogram struct {
	counts   []uint64 // allocated on first Record: numBuckets entries (≈ 35 KiB)
	n        uint64
	sum      float64 // nanoseconds, for the mean
	min, max int64   // nanoseconds
}

// bucket returns the index of the bucket holding v (nanoseconds, ≥ 0).
func bucket(v uint64) int {
	if v < subCount {
		return int(v)
	}
	// v>>shift lies in [subCount, 2*subCount): the top subBits+1 bits of v.
	shift := bits.Len64(v) - subBits - 1
	if shift > maxShift {
		return numBuckets - 1
	}
	return (shift+1)*subCount + int(v>>uint(shift)) - subCount
}

// bounds returns the smallest and largest value that fall into bucket b.
func bounds(b int) (lo, hi uint64) {
	if b < subCount {
		return uint64(b), uint64(b)
	}
	shift := uint(b/subCount - 1)
	m := uint64(b%subCount + subCount)
	return m << shift, (m+1)<<shift - 1
}

// Record adds one duration. Negative durations count as zero.
func (h *Histogram) Record(d time.Duration) {
	if h.counts == nil {
		h.counts = make([]uint64, numBuckets)
	}
	v := int64(d)
	if v < 0 {
		v = 0
	}
	h.counts[bucket(uint64(v))]++
	if h.n == 0 || v < h.min {
		h.min = v
	}
	if v > h.max {
		h.max = v
	}
	h.n++
	h.sum += float64(v)
}

// Merge adds all values recorded in o to h.
func (h *Histogram) Merge(o *Histogram) {
	if o == nil || o.n == 0 {
		return
	}
	if h.counts == nil {
		h.counts = make([]uint64, numBuckets)
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.n == 0 || o.min < h.min {
		h.min = o.min
	}
	if o.max > h.max {
		h.max = o.max
	}
	h.n += o.n
	h.sum += o.sum
}

// Count returns the number of recorded values.
func (h *Histogram) Count() uint64 { return h.n }

// Min returns the smallest recorded value, 0 if there is none.
func (h *Histogram) Min() time.Duration { return time.Duration(h.min) }

// Max returns the largest recorded value, 0 if there is none.
func (h *Histogram) Max() time.Duration { return time.Duration(h.max) }

// Mean returns the arithmetic mean of the recorded values, 0 if there is none.
func (h *Histogram) Mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return time.Duration(math.Round(h.sum / float64(h.n)))
}

// Percentile returns the value below or at which a fraction q (0 < q ≤ 1) of
// the recorded values lie: the value of rank ⌈q·n⌉ in sorted order (the
// "nearest rank" definition, so p100 is the maximum). Within a bucket wider
// than one nanosecond it returns the bucket's midpoint, clamped to the
// recorded extremes. It returns 0 if nothing was recorded.
func (h *Histogram) Percentile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	rank = max(rank, 1)
	rank = min(rank, h.n)
	var seen uint64
	for b, c := range h.counts {
		seen += c
		if seen < rank {
			continue
		}
		lo, hi := bounds(b)
		v := int64(lo + (hi-lo)/2)
		v = max(v, h.min)
		v = min(v, h.max)
		return time.Duration(v)
	}
	return time.Duration(h.max) // unreachable: the counts sum to n
}
