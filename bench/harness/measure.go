package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/hist"
	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/machine"
)

// runner runs the measurements of one Run.
type runner struct {
	cfg      Config
	mode     Mode
	client   *client
	progress io.Writer
	report   *Report

	step, steps int   // for "[ 3/16]" in progress lines
	groups      []int // process groups of the running peers, for machine.SampleCPU
}

func (r *runner) logf(format string, args ...any) {
	if r.progress != nil {
		fmt.Fprintf(r.progress, r.mode.Name+": "+format+"\n", args...)
	}
}

// progressEvery is the interval of progress lines within one measurement.
const progressEvery = 2 * time.Second

// measureAll runs every measurement, target after target. Within a round the
// targets take turns per measurement (all targets at concurrency 1, then all
// at 16, …) rather than one target doing all its measurements in a row, and
// each turn starts with another target: slow drift of the machine (other
// tenants, thermal state, the growing TIME_WAIT table) then spreads over all
// targets instead of biasing the last one.
func (r *runner) measureAll(ctx context.Context, targets []*target) error {
	rate, bulk := false, false
	for _, m := range r.cfg.Modes {
		rate = rate || m == ModeRate
		bulk = bulk || m == ModeBulk
	}
	per := 0
	if rate {
		per += len(r.cfg.Concurrency) * len(targets)
	}
	if bulk {
		per += len(targets)
	}
	r.steps = per * r.cfg.Rounds
	turn := 0
	rotated := func() []*target {
		k := turn % len(targets)
		turn++
		return append(append([]*target{}, targets[k:]...), targets[:k]...)
	}
	for round := range r.cfg.Rounds {
		if rate {
			for _, conc := range r.cfg.Concurrency {
				for _, t := range rotated() {
					run, err := r.measureRate(ctx, t, conc, round)
					if err != nil {
						r.report.interrupted(fmt.Sprintf("during rate c=%d %s", conc, t.name))
						return err
					}
					r.report.RateRuns = append(r.report.RateRuns, run)
				}
			}
		}
		if bulk {
			for _, t := range rotated() {
				run, err := r.measureBulk(ctx, t, round)
				if err != nil {
					r.report.interrupted("during bulk " + t.name)
					return err
				}
				r.report.BulkRuns = append(r.report.BulkRuns, run)
			}
		}
	}
	return nil
}

// Measurement phases, shared by a measurement's workers.
const (
	phaseWarmup int32 = iota
	phaseMeasure
	phaseStop
)

// SleepCtx waits d or until ctx ends, and reports whether d passed; the
// tunnel mode waits with it too.
func SleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// window runs the warm-up and the measurement window of one measurement and
// returns the window's bounds, the CPU, in cores, that processes other than
// the benchmark and its peers used meanwhile, and the CPU time the processes
// of the target's data plane (t.dataPlane) used in the window. Workers read
// phase; tick is called every progressEvery within the window. It returns
// ctx's error if ctx ends first.
func (r *runner) window(ctx context.Context, t *target, phase *atomic.Int32, onStart func(), tick func(elapsed time.Duration)) (t0, t1 time.Time, other float64, dataPlane time.Duration, err error) {
	if !SleepCtx(ctx, r.cfg.Warmup) {
		return t0, t1, 0, 0, ctx.Err()
	}
	// The data plane's processes are looked up once: its workers run for
	// the whole window, and a process that exited would count as nothing
	// at the end.
	pids := machine.GroupMembers(t.dataPlane)
	cpu0, dp0 := machine.SampleCPU(r.groups), machine.ProcessesCPU(pids)
	onStart()
	t0 = time.Now()
	phase.Store(phaseMeasure)
	end := t0.Add(r.cfg.Duration)
	for {
		left := time.Until(end)
		if left <= 0 {
			break
		}
		if !SleepCtx(ctx, min(left, progressEvery)) {
			return t0, t1, 0, 0, ctx.Err()
		}
		if el := time.Since(t0); el < r.cfg.Duration && r.progress != nil {
			tick(el)
		}
	}
	t1 = time.Now()
	cpu1, dp1 := machine.SampleCPU(r.groups), machine.ProcessesCPU(pids)
	return t0, t1, cpu0.Other(cpu1).Seconds() / t1.Sub(t0).Seconds(), dp1 - dp0, nil
}

// rateWorker is one client loop of the connection-rate test. Its fields are
// its own until the measurement has waited for it.
type rateWorker struct {
	slot     inflight.Slot
	rng      *rand.Rand
	h        hist.Histogram
	ok       int64
	perShoot []int64
	errs     [numReasons]int64
	sample   [numReasons]error // the first error of each reason, for the report
}

func (w *rateWorker) run(ctx context.Context, c *client, t *target, phase *atomic.Int32, done, failed *atomic.Int64) {
	buf := make([]byte, len(c.shoots[0].expected)+1)
	for phase.Load() != phaseStop && ctx.Err() == nil {
		i := w.rng.IntN(len(c.shoots))
		start := time.Now()
		ttfb, err := c.fetchSmall(ctx, t, i, &w.slot, buf, nil)
		// A connection counts in the phase in which it completes.
		ph := phase.Load()
		counted := ph == phaseMeasure
		if err != nil {
			if ph == phaseStop {
				w.stalled(err, start)
			}
			if counted {
				w.record(err)
				failed.Add(1)
			}
			backoff(err)
			continue
		}
		if !counted {
			continue
		}
		w.h.Record(ttfb)
		w.ok++
		w.perShoot[i]++
		done.Add(1)
	}
}

// record counts a failed connection by its reason.
func (w *rateWorker) record(err error) { countError(&w.errs, &w.sample, err) }

// stalled counts a connection that the end of the measurement aborted after
// it had been in flight for stallAfter or more.
func (w *rateWorker) stalled(err error, start time.Time) {
	if errors.Is(err, errAborted) || errors.Is(err, os.ErrDeadlineExceeded) {
		if d := time.Since(start); d >= stallAfter {
			countError(&w.errs, &w.sample, fail(reasonStalled, fmt.Errorf("in flight for %v when the measurement ended", d.Round(time.Millisecond))))
		}
	}
}

func countError(errs *[numReasons]int64, sample *[numReasons]error, err error) {
	var ce *connError
	if !errors.As(err, &ce) {
		ce = fail(reasonRead, err)
	}
	errs[ce.reason]++
	if sample[ce.reason] == nil {
		sample[ce.reason] = err
	}
}

// backoff pauses a worker after a failed connection: a target that refuses
// everything would otherwise be hammered in a tight loop that only burns the
// CPU the client shares with it. An aborted connection ends the measurement
// and needs no pause.
func backoff(err error) {
	if !errors.Is(err, errAborted) && !errors.Is(err, os.ErrDeadlineExceeded) {
		time.Sleep(time.Millisecond)
	}
}

// measureRate measures new TLS connections per second and time to first byte
// of target t with conc client loops.
func (r *runner) measureRate(ctx context.Context, t *target, conc, round int) (*RateRun, error) {
	r.step++
	label := fmt.Sprintf("[%2d/%d] rate c=%d %s", r.step, r.steps, conc, t.name)
	var phase atomic.Int32
	var done, failed atomic.Int64
	workers := make([]*rateWorker, conc)
	var wg sync.WaitGroup
	seed := uint64(time.Now().UnixNano())
	for k := range workers {
		w := &rateWorker{rng: rand.New(rand.NewPCG(seed, uint64(k))), perShoot: make([]int64, len(r.client.shoots))}
		workers[k] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(ctx, r.client, t, &phase, &done, &failed)
		}()
	}
	stop := func() {
		phase.Store(phaseStop)
		for _, w := range workers {
			w.slot.Expire()
		}
		wg.Wait()
	}
	t0, t1, other, dpCPU, err := r.window(ctx, t, &phase, func() {}, func(el time.Duration) {
		n := done.Load()
		fmt.Fprintf(r.progress, "%s: %s: %.0fs/%.0fs %d conns (%.0f/s), %d errors\n",
			r.mode.Name, label, el.Seconds(), r.cfg.Duration.Seconds(), n, float64(n)/el.Seconds(), failed.Load())
	})
	stop()
	if err != nil {
		return nil, err
	}

	run := &RateRun{Target: t.name, Concurrency: conc, Round: round, Seconds: t1.Sub(t0).Seconds(),
		PerShoot: make([]int64, len(r.client.shoots)), OtherCPU: other}
	var samples [numReasons]error
	var errs [numReasons]int64
	for _, w := range workers {
		run.hist.Merge(&w.h)
		run.Conns += w.ok
		for i, n := range w.perShoot {
			run.PerShoot[i] += n
		}
		for k := range numReasons {
			errs[k] += w.errs[k]
			if samples[k] == nil {
				samples[k] = w.sample[k]
			}
		}
	}
	run.ConnsPerSec = float64(run.Conns) / run.Seconds
	run.TTFB = latencyOf(&run.hist)
	run.Errors, run.ErrorSamples = errorMaps(errs, samples)
	if t.dataPlane != nil {
		run.DataPlaneCPU = dpCPU.Seconds()
		run.CPUPerConn = cpuPerConn(run.DataPlaneCPU, run.Conns)
	}
	r.logf("%s: %.0f conn/s, TTFB p50 %s p99 %s, data plane CPU %s/conn, %s, others used %.2f CPUs", label, run.ConnsPerSec,
		fmtMS(run.TTFB.P50), fmtMS(run.TTFB.P99), fmtUS(run.CPUPerConn), fmtErrors(run.Errors), other)
	for k, s := range run.ErrorSamples {
		r.logf("%s: first %s error: %s", label, k, s)
	}
	return run, nil
}

func errorMaps(errs [numReasons]int64, samples [numReasons]error) (map[string]int64, map[string]string) {
	var counts map[string]int64
	var texts map[string]string
	for k := range numReasons {
		if errs[k] == 0 {
			continue
		}
		if counts == nil {
			counts, texts = map[string]int64{}, map[string]string{}
		}
		counts[k.String()] = errs[k]
		if samples[k] != nil {
			texts[k.String()] = samples[k].Error()
		}
	}
	return counts, texts
}

// bulkWorker is one connection loop of the bulk test.
type bulkWorker struct {
	slot      inflight.Slot
	got       atomic.Int64 // bytes read, all phases; read by the measurement while running
	transfers int64        // completed in the window
	errs      [numReasons]int64
	sample    [numReasons]error
}

// bulkBuf is the client's read buffer: larger than one TLS record (16 KiB),
// so every Read returns a whole record.
const bulkBuf = 64 << 10

// run loops bulk transfers. Worker k of conns takes shoots k, k+conns, …
// in turn, so that all shoots see bulk traffic whatever the two numbers are.
func (w *bulkWorker) run(ctx context.Context, c *client, t *target, k, conns int, phase *atomic.Int32, failed *atomic.Int64) {
	buf := make([]byte, bulkBuf)
	for j := 0; phase.Load() != phaseStop && ctx.Err() == nil; j++ {
		shoot := (k + j*conns) % len(c.shoots)
		err := c.fetchBulk(ctx, t, shoot, &w.slot, buf, &w.got)
		counted := phase.Load() == phaseMeasure
		if err != nil {
			if counted {
				countError(&w.errs, &w.sample, err)
				failed.Add(1)
			}
			backoff(err)
			continue
		}
		if counted {
			w.transfers++
		}
	}
}

// measureBulk measures the total throughput of BulkConns connections, each
// reading BulkBytes answers back to back, over the measurement window. Bytes
// are counted as they arrive, so transfers that straddle the window's edges
// count with the part inside it.
func (r *runner) measureBulk(ctx context.Context, t *target, round int) (*BulkRun, error) {
	r.step++
	label := fmt.Sprintf("[%2d/%d] bulk %d conns %s", r.step, r.steps, r.cfg.BulkConns, t.name)
	var phase atomic.Int32
	var failed atomic.Int64
	workers := make([]*bulkWorker, r.cfg.BulkConns)
	var wg sync.WaitGroup
	for k := range workers {
		w := &bulkWorker{}
		workers[k] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(ctx, r.client, t, k, len(workers), &phase, &failed)
		}()
	}
	total := func() int64 {
		var n int64
		for _, w := range workers {
			n += w.got.Load()
		}
		return n
	}
	stop := func() {
		phase.Store(phaseStop)
		for _, w := range workers {
			w.slot.Expire()
		}
		wg.Wait()
	}
	var b0 int64
	t0, t1, other, _, err := r.window(ctx, t, &phase, func() { b0 = total() }, func(el time.Duration) {
		fmt.Fprintf(r.progress, "%s: %s: %.0fs/%.0fs %.0f MB/s, %d errors\n",
			r.mode.Name, label, el.Seconds(), r.cfg.Duration.Seconds(), float64(total()-b0)/el.Seconds()/1e6, failed.Load())
	})
	b1 := total()
	stop()
	if err != nil {
		return nil, err
	}
	run := &BulkRun{Target: t.name, Conns: r.cfg.BulkConns, Round: round, Seconds: t1.Sub(t0).Seconds(),
		Bytes: b1 - b0, OtherCPU: other}
	var samples [numReasons]error
	var errs [numReasons]int64
	for _, w := range workers {
		run.Transfers += w.transfers
		for k := range numReasons {
			errs[k] += w.errs[k]
			if samples[k] == nil {
				samples[k] = w.sample[k]
			}
		}
	}
	run.MBps = float64(run.Bytes) / run.Seconds / 1e6
	run.Errors, run.ErrorSamples = errorMaps(errs, samples)
	r.logf("%s: %.0f MB/s, %d transfers, %s, others used %.2f CPUs", label, run.MBps, run.Transfers,
		fmtErrors(run.Errors), other)
	for k, s := range run.ErrorSamples {
		r.logf("%s: first %s error: %s", label, k, s)
	}
	return run, nil
}
