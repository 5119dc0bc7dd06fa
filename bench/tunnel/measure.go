package tunnel

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/hist"
	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/peers"
)

// runStack starts one stack, measures its up time, memory and targets, and
// stops it. A stack that cannot start marks its targets skipped.
func (r *runner) runStack(ctx context.Context, s *stack) {
	res := &StackResult{Name: s.name, Targets: s.targets, Path: s.path}
	r.rep.Stacks = append(r.rep.Stacks, res)
	var targets []*TargetResult
	for _, name := range s.targets {
		t := &TargetResult{Name: name, Stack: s.name}
		targets = append(targets, t)
		r.rep.Targets = append(r.rep.Targets, t)
	}
	skip := func(why string) {
		res.Skipped = why
		for _, t := range targets {
			t.Skipped = cmp.Or(t.Skipped, why)
		}
		r.logf("%s: skipped: %s", s.name, why)
	}
	if err := s.check(ctx); err != nil {
		skip(err.Error())
		return
	}
	res.Version = s.version(ctx)
	dir := filepath.Join(r.tmp, s.name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		skip(err.Error())
		return
	}
	defer s.stop()
	r.logf("%s: starting (%s)", s.name, res.Version)
	// A peer that cannot inherit its sockets binds ports picked free, which another process
	// may take first: it starts again on new ones.
	err := s.startServer(ctx, dir)
	for attempt := 1; err != nil && attempt < startAttempts && peers.AddrInUse(err) && ctx.Err() == nil; attempt++ {
		r.logf("%s: a port was taken (%v); starting again on new ports", s.name, err)
		s.stop()
		err = s.startServer(ctx, dir)
	}
	if err != nil {
		skip("start failed: " + err.Error())
		return
	}
	res.Config = s.config
	if s.startAgent != nil {
		res.ProbeVia = s.probeVia
		// The seed side alone, before any agent: a second after it serves.
		if !harness.SleepCtx(ctx, time.Second) {
			return
		}
		if m, ok := peers.ReadMemory(s.servers[0].PID()); ok {
			res.Server.NoAgentRSS = m.RSS
		}
		for i := range r.cfg.UpRuns {
			if s.agent != nil {
				_ = s.agent.Stop()
				s.agent = nil
				// Let the seed side notice the old agent's stream end.
				if !harness.SleepCtx(ctx, 200*time.Millisecond) {
					return
				}
			}
			p, up, err := r.upTime(ctx, s, dir)
			s.agent = p
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				skip(fmt.Sprintf("tunnel not up (run %d): %v", i+1, err))
				return
			}
			res.UpMS = append(res.UpMS, ms(up))
			r.logf("%s: tunnel up %.0f ms after the agent's start (run %d/%d)", s.name, ms(up), i+1, r.cfg.UpRuns)
		}
		// Idle memory: the tunnel up, nothing through it for a moment.
		if !harness.SleepCtx(ctx, time.Second) {
			return
		}
		noAgent := res.Server.NoAgentRSS
		res.Server = memOf(s.servers[0])
		res.Server.NoAgentRSS = noAgent
		res.Agent = memOf(s.agent)
		r.logf("%s: idle RSS: %s %s, %s %s", s.name, res.Server.Process, fmtMiB(res.Server.IdleRSS),
			res.Agent.Process, fmtMiB(res.Agent.IdleRSS))
		if r.cfg.Settle > 0 {
			if !harness.SleepCtx(ctx, r.cfg.Settle) {
				return
			}
			res.Server.IdleSettledRSS = memOf(s.servers[0]).IdleRSS
			res.Agent.IdleSettledRSS = memOf(s.agent).IdleRSS
			r.logf("%s: idle RSS %v later: %s %s, %s %s", s.name, r.cfg.Settle, res.Server.Process,
				fmtMiB(res.Server.IdleSettledRSS), res.Agent.Process, fmtMiB(res.Agent.IdleSettledRSS))
		}
	}
	r.pathCPU, r.innerTCP, r.agentInnerTCP = s.cpu(r.ingress), s.innerTCP, s.agentInnerTCP
	defer func() { r.pathCPU, r.innerTCP, r.agentInnerTCP = nil, nil, nil }()
	for _, t := range targets {
		d := s.dial[t.Name]
		if d == nil {
			t.Skipped = "no konnectivity client linked (tendril-bench supplies konnectivity-client)"
			continue
		}
		if err := r.measureCells(ctx, t, d); err != nil {
			r.rep.Partial = true
			r.rep.Note = fmt.Sprintf("interrupted during %s; only completed measurements are shown", t.Name)
			break
		}
		// The tunnel must have survived the measurements (HOL included).
		if s.probe != nil {
			if err := pingOnce(ctx, s.dial[t.Name], 5*time.Second); err != nil && ctx.Err() == nil {
				t.Notes = append(t.Notes, "after the measurements a dial failed: "+err.Error())
			}
		}
	}
	if s.agent == nil {
		return
	}
	res.Server.Peak = peakOf(s.servers[0])
	res.Agent.Peak = peakOf(s.agent)
	if r.cfg.Settle == 0 || !harness.SleepCtx(ctx, r.cfg.Settle) {
		return
	}
	res.Server.AfterRSS = memOf(s.servers[0]).IdleRSS
	res.Agent.AfterRSS = memOf(s.agent).IdleRSS
	r.logf("%s: RSS %v after the load: %s %s (peak %s), %s %s (peak %s)", s.name, r.cfg.Settle,
		res.Server.Process, fmtMiB(res.Server.AfterRSS), fmtMiB(res.Server.Peak),
		res.Agent.Process, fmtMiB(res.Agent.AfterRSS), fmtMiB(res.Agent.Peak))
	// The same load again: its figures are not kept, the memory after it is.
	for load := 2; load <= r.cfg.Loads; load++ {
		for _, t := range targets {
			if d := s.dial[t.Name]; d != nil && t.Skipped == "" {
				if err := r.measureTarget(ctx, &TargetResult{Name: t.Name, Stack: t.Stack}, d); err != nil {
					return
				}
			}
		}
		if !harness.SleepCtx(ctx, r.cfg.Settle) {
			return
		}
		server, agent := memOf(s.servers[0]).IdleRSS, memOf(s.agent).IdleRSS
		res.Server.AfterMoreRSS = append(res.Server.AfterMoreRSS, server)
		res.Agent.AfterMoreRSS = append(res.Agent.AfterMoreRSS, agent)
		r.logf("%s: RSS %v after load %d: %s %s, %s %s", s.name, r.cfg.Settle, load,
			res.Server.Process, fmtMiB(server), res.Agent.Process, fmtMiB(agent))
	}
}

// cpuNow is the measured stack's CPU time so far, or -1 if it has no processes.
func (r *runner) cpuNow() time.Duration {
	if r.pathCPU == nil {
		return -1
	}
	return r.pathCPU()
}

func memOf(p *peers.Process) ProcMemory {
	m, _ := peers.ReadMemory(p.PID())
	return ProcMemory{Process: p.Name(), IdleRSS: m.RSS}
}

func peakOf(p *peers.Process) int64 {
	m, _ := peers.ReadMemory(p.PID())
	return m.Peak
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// upTime starts the stack's agent and tries the probe every probeEvery,
// each attempt running up to probeTimeout, until one gets through; it returns
// the time from the agent's start to that success.
func (r *runner) upTime(ctx context.Context, s *stack, dir string) (*peers.Process, time.Duration, error) {
	uctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	p, err := s.startAgent(dir)
	if err != nil {
		return nil, 0, err
	}
	won := make(chan time.Time, 1)
	var lastErr atomic.Value
	tick := time.NewTicker(s.probeEvery)
	defer tick.Stop()
	for {
		wg.Go(func() {
			if err := pingOnce(uctx, s.probe, s.probeTimeout); err != nil {
				lastErr.Store(err.Error())
				return
			}
			select {
			case won <- time.Now():
			default:
			}
		})
		select {
		case t := <-won:
			return p, t.Sub(p.Started()), nil
		case <-uctx.Done():
			last, _ := lastErr.Load().(string)
			return p, 0, fmt.Errorf("no dial through the tunnel within 30 s (last error: %s); agent log: %s", last, p.LogTail())
		case <-tick.C:
			if err := p.Exited(); err != nil {
				return p, 0, err
			}
		}
	}
}

// pingOnce dials through d and makes one round trip to the pod.
func pingOnce(ctx context.Context, d dialFunc, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := d(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	return ping(c)
}

func ping(c net.Conn) error {
	if _, err := c.Write([]byte{cmdPing}); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	var b [3]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(b[:], pingReply) {
		return fmt.Errorf("pod answered %q", b[:])
	}
	return nil
}

// measureTarget runs every measurement of one target.
func (r *runner) measureTarget(ctx context.Context, t *TargetResult, d dialFunc) error {
	if err := pingOnce(ctx, d, dialTimeout); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		t.Skipped = "the pod does not answer through it: " + err.Error()
		r.logf("%s: skipped: %s", t.Name, t.Skipped)
		return nil
	}
	for _, dir := range []string{ToShoot, FromShoot} {
		if r.cfg.DialsOnly {
			break
		}
		for _, n := range r.cfg.Conns {
			b, err := rounds(r.cfg.Rounds, func() (BulkResult, error) { return r.bulk(ctx, d, dir, n) }, bulkFigure)
			if err != nil {
				return err
			}
			t.Bulk = append(t.Bulk, b)
			r.logf("%s: bulk %s ×%d: %.0f MB/s%s", t.Name, dir, n, b.MBps, fmtErrLog(b.Errors, b.FirstError))
		}
	}
	for _, n := range r.cfg.DialWorkers {
		dr, err := rounds(r.cfg.Rounds, func() (DialResult, error) { return r.dials(ctx, d, n) }, dialFigure)
		if err != nil {
			return err
		}
		t.Dial = append(t.Dial, dr)
		r.logf("%s: dials ×%d: %.0f/s, p50 %.2f ms, p99 %.2f ms, worst %.1f ms%s", t.Name, n, dr.PerSec, dr.P50, dr.P99, dr.Max, fmtErrLog(dr.Errors, dr.FirstError))
	}
	for _, dir := range []string{ToShoot, FromShoot} {
		if r.cfg.DialsOnly {
			break
		}
		h, err := rounds(r.cfg.Rounds, func() (HOLResult, error) { return r.hol(ctx, d, dir) }, holFigure)
		if err != nil {
			return err
		}
		h.Alone = t.bulkMBps(dir, 1)
		t.HOL = append(t.HOL, h)
		r.logf("%s: head-of-line %s: the other connection %.0f MB/s (alone %.0f) after %s stalled%s", t.Name, dir, h.MBps, h.Alone,
			fmtBytes(h.StalledBytes), fmtErrLog(h.Errors, h.FirstError))
	}
	return nil
}

// rounds runs measure n times in a row and returns the run with the median figure (the lower
// middle one for an even n), carrying the errors of all runs and every run's figure.
func rounds[R any](n int, measure func() (R, error), fig func(*R) (figure *float64, all *[]float64, errs *int64, first *string)) (R, error) {
	runs := make([]R, 0, n)
	for range n {
		res, err := measure()
		if err != nil {
			return res, err
		}
		runs = append(runs, res)
	}
	if n == 1 {
		return runs[0], nil
	}
	figures := make([]float64, n)
	order := make([]int, n)
	var errs int64
	var first string
	for i := range runs {
		f, _, e, fe := fig(&runs[i])
		figures[i], order[i] = *f, i
		errs += *e
		first = cmp.Or(first, *fe)
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(figures[a], figures[b]) })
	median := runs[order[(n-1)/2]]
	_, all, e, fe := fig(&median)
	*all, *e, *fe = figures, errs, first
	return median, nil
}

func bulkFigure(b *BulkResult) (*float64, *[]float64, *int64, *string) {
	return &b.MBps, &b.RoundMBps, &b.Errors, &b.FirstError
}

func dialFigure(d *DialResult) (*float64, *[]float64, *int64, *string) {
	return &d.PerSec, &d.RoundPerSec, &d.Errors, &d.FirstError
}

func holFigure(h *HOLResult) (*float64, *[]float64, *int64, *string) {
	return &h.MBps, &h.RoundMBps, &h.Errors, &h.FirstError
}

func fmtErrLog(n int64, first string) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(", %d errors (first: %s)", n, first)
}

// Measurement phases.
const (
	phaseWarmup int32 = iota
	phaseMeasure
	phaseStop
)

// errs counts a measurement's failures and keeps the first.
type errs struct {
	n     atomic.Int64
	first atomic.Value
}

func (e *errs) add(err error) {
	e.n.Add(1)
	e.first.CompareAndSwap(nil, err.Error())
}

func (e *errs) get() (int64, string) {
	s, _ := e.first.Load().(string)
	return e.n.Load(), s
}

// xferBuf is the client's read and write size.
const xferBuf = 64 << 10

// bulk measures the throughput of conns connections transferring in
// direction dir back to back over the window. Bytes to the shoot are counted
// by the pod as it reads them, bytes from the shoot by the client.
func (r *runner) bulk(ctx context.Context, d dialFunc, dir string, conns int) (BulkResult, error) {
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var e errs
	var got atomic.Int64
	slots := make([]*inflight.Slot, conns)
	gaps := make([]*gapMeter, conns)
	var wg sync.WaitGroup
	for k := range slots {
		sl, g := &inflight.Slot{}, newGapMeter()
		slots[k], gaps[k] = sl, g
		wg.Go(func() { transferLoop(mctx, d, dir, sl, g, &got, &e) })
	}
	count := func() int64 {
		if dir == ToShoot {
			return r.pod.sunk.Load()
		}
		return got.Load()
	}
	stop := func() {
		cancel()
		for _, sl := range slots {
			sl.Abort()
		}
		wg.Wait()
		r.pod.reset()
	}
	if !harness.SleepCtx(ctx, r.cfg.Warmup) {
		stop()
		return BulkResult{}, ctx.Err()
	}
	for _, g := range gaps {
		g.arm()
	}
	b0, t0, c0 := count(), time.Now(), r.cpuNow()
	ok := harness.SleepCtx(ctx, r.cfg.Duration)
	b1, t1, c1 := count(), time.Now(), r.cpuNow()
	var longest time.Duration
	for _, g := range gaps {
		longest = max(longest, g.end(t1))
	}
	stop()
	if !ok {
		return BulkResult{}, ctx.Err()
	}
	res := BulkResult{Direction: dir, Conns: conns, Seconds: t1.Sub(t0).Seconds(), Bytes: b1 - b0}
	res.MBps = float64(res.Bytes) / res.Seconds / 1e6
	if dir == FromShoot {
		res.LongestGapMS = ms(longest)
	}
	if c0 >= 0 && res.Bytes > 0 {
		res.CPUPerMB = ms(c1-c0) / (float64(res.Bytes) / 1e6)
	}
	res.Errors, res.FirstError = e.get()
	return res, nil
}

// transferLoop opens connections through d and transfers on each until it
// breaks or the measurement ends.
func transferLoop(ctx context.Context, d dialFunc, dir string, sl *inflight.Slot, gap *gapMeter, got *atomic.Int64, e *errs) {
	buf := make([]byte, xferBuf)
	cmd := []byte{cmdSink}
	if dir == FromShoot {
		cmd[0] = cmdSource
	}
	for ctx.Err() == nil {
		dctx, dcancel := context.WithTimeout(ctx, dialTimeout)
		c, err := d(dctx)
		dcancel()
		if err != nil {
			if ctx.Err() == nil {
				e.add(fmt.Errorf("dial: %w", err))
				harness.SleepCtx(ctx, 10*time.Millisecond)
			}
			continue
		}
		if !sl.Set(c) {
			c.Close()
			return
		}
		_, err = c.Write(cmd)
		for err == nil {
			var n int
			if dir == ToShoot {
				n, err = c.Write(buf)
			} else {
				n, err = c.Read(buf)
				if n > 0 {
					gap.read(time.Now())
				}
			}
			got.Add(int64(n))
		}
		sl.Clear()
		c.Close()
		if ctx.Err() == nil && !sl.Aborted() {
			e.add(fmt.Errorf("transfer: %w", err))
		}
	}
}

// dials measures dials with workers concurrent loops: each dial opens a new
// connection through the path, makes one round trip to the pod and closes.
func (r *runner) dials(ctx context.Context, d dialFunc, workers int) (DialResult, error) {
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var phase atomic.Int32
	var e errs
	hs := make([]hist.Histogram, workers)
	var wg sync.WaitGroup
	for k := range workers {
		wg.Go(func() {
			for mctx.Err() == nil && phase.Load() != phaseStop {
				start := time.Now()
				err := pingOnce(mctx, d, dialTimeout)
				ph := phase.Load()
				if err != nil {
					switch {
					case ph == phaseStop || mctx.Err() != nil:
						// Cut off by the end of the window: a failure only if
						// it had hung (a dial here takes milliseconds).
						if el := time.Since(start); el >= stallAfter {
							e.add(fmt.Errorf("stalled: in flight for %v when the measurement ended", el.Round(time.Millisecond)))
						}
					case ph == phaseMeasure:
						e.add(err)
						harness.SleepCtx(mctx, time.Millisecond)
					}
					continue
				}
				if ph == phaseMeasure {
					hs[k].Record(time.Since(start))
				}
			}
		})
	}
	stop := func() {
		phase.Store(phaseStop)
		cancel()
		wg.Wait()
		r.pod.reset()
	}
	if !harness.SleepCtx(ctx, r.cfg.Warmup) {
		stop()
		return DialResult{}, ctx.Err()
	}
	phase.Store(phaseMeasure)
	t0, c0 := time.Now(), r.cpuNow()
	ok := harness.SleepCtx(ctx, r.cfg.DialDuration)
	phase.Store(phaseStop)
	t1, c1 := time.Now(), r.cpuNow()
	stop()
	if !ok {
		return DialResult{}, ctx.Err()
	}
	var h hist.Histogram
	for i := range hs {
		h.Merge(&hs[i])
	}
	res := DialResult{Workers: workers, Dials: int64(h.Count()), Seconds: t1.Sub(t0).Seconds(),
		P50: ms(h.Percentile(0.5)), P90: ms(h.Percentile(0.9)), P99: ms(h.Percentile(0.99)), Max: ms(h.Max())}
	res.PerSec = float64(res.Dials) / res.Seconds
	if c0 >= 0 && res.Dials > 0 {
		res.CPUPerDial = ms(c1-c0) / float64(res.Dials)
	}
	res.Errors, res.FirstError = e.get()
	return res, nil
}

// stallAfter is how long a dial may be in flight when a measurement ends
// before it counts as failed (hung) rather than cut off.
const stallAfter = time.Second

// Head-of-line: how long the stalled connection's flow must stand still to
// count as stalled, and how long to wait for that at most.
const (
	stallQuiet = 300 * time.Millisecond
	stallMax   = 5 * time.Second
)

// hol opens one connection whose receiver never reads (the pod's for
// to-shoot, the client's for from-shoot), waits until its sender is blocked,
// then measures another connection's throughput in the same direction.
func (r *runner) hol(ctx context.Context, d dialFunc, dir string) (HOLResult, error) {
	res := HOLResult{Direction: dir}
	defer r.pod.reset()
	dctx, dcancel := context.WithTimeout(ctx, dialTimeout)
	c, err := d(dctx)
	dcancel()
	if err != nil {
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		res.Errors, res.FirstError = 1, "stalled connection: dial: "+err.Error()
		return res, nil
	}
	var sent atomic.Int64
	var wg sync.WaitGroup
	defer func() {
		c.Close()
		wg.Wait()
	}()
	var progress func() int64
	if dir == ToShoot {
		if _, err := c.Write([]byte{cmdStall}); err != nil {
			res.Errors, res.FirstError = 1, "stalled connection: "+err.Error()
			return res, nil
		}
		wg.Go(func() {
			buf := make([]byte, xferBuf)
			for {
				n, err := c.Write(buf)
				sent.Add(int64(n))
				if err != nil {
					return
				}
			}
		})
		progress = sent.Load
	} else {
		s0 := r.pod.sourced.Load()
		if _, err := c.Write([]byte{cmdSource}); err != nil {
			res.Errors, res.FirstError = 1, "stalled connection: "+err.Error()
			return res, nil
		}
		progress = func() int64 { return r.pod.sourced.Load() - s0 }
	}
	last, quietSince, deadline := progress(), time.Now(), time.Now().Add(stallMax)
	for {
		if !harness.SleepCtx(ctx, 50*time.Millisecond) {
			return res, ctx.Err()
		}
		v, now := progress(), time.Now()
		if v != last {
			last, quietSince = v, now
		} else if v > 0 && now.Sub(quietSince) >= stallQuiet {
			break
		}
		if now.After(deadline) {
			res.StallNote = fmt.Sprintf("still moving after %v", stallMax)
			break
		}
	}
	res.StalledBytes = last
	b, err := r.bulk(ctx, d, dir, 1)
	if err != nil {
		return res, err
	}
	res.MBps, res.Errors, res.FirstError = b.MBps, b.Errors, b.FirstError
	return res, nil
}

// gapMeter keeps the longest time one receiving connection (and the ones that replace it) went
// without data, over the measurement window: reads before arm only set where a gap starts.
type gapMeter struct {
	mu      sync.Mutex
	armed   bool
	last    time.Time
	longest time.Duration
}

func newGapMeter() *gapMeter { return &gapMeter{last: time.Now()} }

func (g *gapMeter) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed = true
	if now := time.Now(); now.After(g.last) {
		g.last = now // a gap counts from the window's start at the earliest
	}
}

func (g *gapMeter) read(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.armed {
		g.longest = max(g.longest, now.Sub(g.last))
	}
	g.last = now
}

// end closes the window at now (a gap still open counts up to it) and returns the longest gap.
func (g *gapMeter) end(now time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed = false
	return max(g.longest, now.Sub(g.last))
}
