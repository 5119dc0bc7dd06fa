// Package idle is the "idle" mode of tendril-bench: what an idle connection
// costs a data plane. A seed's ingress holds tens of thousands of long-lived
// connections (watches of kubelets, controllers and users) that carry nothing
// most of the time; their memory and file descriptors, not their bytes,
// decide how many one replica holds.
//
// For each listener (sni: TLS passthrough by server name; proxy: a PROXY v2
// header, then TLS) and each target (tendril, HAProxy, nginx, configured for
// the same routes as the sni and proxy modes configure), Run opens N
// connections through the data plane, each with its TLS handshake done end to
// end with the shoot's upstream (verified for the shoot's host), and leaves
// them idle. It reports the data plane's resident memory and open descriptors
// before and with the N connections, per connection, tendril-ingress's
// goroutines, how many connections still answer a ping through after a hold
// time, and how long memory and descriptors take after they close to come
// back within 10% of the baseline. The targets run one after another, never
// two at once, against one set of upstreams.
//
// A data plane that runs out of descriptors before N is not an error: the
// connections it held are measured, and the report says how many that was
// and what the next ones failed with.
package idle

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/incluster"
	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/bench/sni"
)

// Listeners.
const (
	ListenerSNI   = "sni"   // TLS passthrough routed by the ClientHello's server name
	ListenerProxy = "proxy" // PROXY v2 header routed by its destination, then TLS
)

// Listeners are the listeners in report order; Targets the targets.
var (
	Listeners = []string{ListenerSNI, ListenerProxy}
	Targets   = []string{harness.TargetTendril, harness.TargetHAProxy, harness.TargetNginx}
)

// File descriptors besides the connections' sockets. The benchmark process
// holds both ends that are not the data plane's: the client's socket and the
// upstream's socket of every connection, 2 per connection, plus benchReserve
// (4 upstream listeners, stdio, epoll and the Go runtime's descriptors, a
// metrics connection, the /proc files it reads while sampling, with room to
// spare). A proxy holds 2 sockets per connection (client side and upstream
// side) plus peerReserve (listener, log, epoll, pipes of its own).
const (
	benchReserve = 400
	peerReserve  = 100
)

// DefaultConns is the largest N that fits a descriptor limit of limit per
// process, which every process here has (RLIMIT_NOFILE): the benchmark needs
// 2N + benchReserve, a proxy with 2 descriptors per connection 2N +
// peerReserve, so N = (limit − benchReserve) / 2, rounded down to a hundred.
// With the 20,000 of this machine: (20,000 − 400) / 2 = 9,800. A data plane
// that needs more than 2 per connection holds fewer and reports how many.
// It is at most maxDefaultConns.
func DefaultConns(limit uint64) int {
	if limit <= benchReserve+200 {
		return 100
	}
	return min(int(min(limit, 1<<30)-benchReserve)/2/100*100, maxDefaultConns)
}

// maxDefaultConns caps the default N: issue 21's goal of 100,000 idle
// connections per replica. Beyond it the client's ephemeral ports to the one
// listener address (ip_local_port_range, 28,232 by default) run out first
// anyway, unless the range is widened.
const maxDefaultConns = 100_000

// peerConns is the connection limit written into HAProxy's maxconn (2
// descriptors per connection, so HAProxy raises its own limit to about
// twice it) and nginx's worker_connections (per worker, counting both sockets
// of a connection: one worker may end up with all of them), so that neither
// is held back by its configuration below the descriptor limit.
func peerConns(limit uint64) (haproxy, nginx int) {
	return int((limit - peerReserve) / 2), int(limit - peerReserve)
}

// Config configures Run. The zero value measures every listener and target
// with the defaults given per field.
type Config struct {
	// Conns is N, the connections held per target; 0 means DefaultConns of
	// the hard descriptor limit.
	Conns int
	// Listeners to measure, from Listeners; nil means all.
	Listeners []string
	// Targets to measure, from Targets; nil means all.
	Targets []string
	// Hold is how long the connections stay idle before the survivors'
	// ping, counted from the last one opened; 0 means 10 s.
	Hold time.Duration
	// Release is how long memory and descriptors are sampled after the
	// connections close; 0 means 30 s.
	Release time.Duration
	// OpenTimeout bounds opening one connection (dial, preamble,
	// handshake, first echo) and one ping; 0 means 10 s.
	OpenTimeout time.Duration
	// MaxFailures stops opening connections to a target after this many
	// have failed (a data plane out of descriptors fails every further
	// one); 0 means 64.
	MaxFailures int
	// Parallel is the number of connections opened (and pinged) at once;
	// 0 means 32.
	Parallel int
	// PeerMaxConn, if not 0, replaces HAProxy's maxconn and nginx's
	// worker_connections (tests: a peer that holds fewer than N).
	PeerMaxConn int
	// Shoots is the number of routes and upstreams; 0 means 4.
	Shoots int
	// BinDir holds tendril-seed and tendril-ingress; "" means "bin".
	BinDir string
	// Progress receives progress lines; nil means silent.
	Progress io.Writer
	// CommandLine is recorded in the report as is.
	CommandLine string
}

func (c *Config) setDefaults(hard uint64) {
	if c.Conns == 0 {
		c.Conns = DefaultConns(hard)
	}
	if c.Listeners == nil {
		c.Listeners = Listeners
	}
	if c.Targets == nil {
		c.Targets = Targets
	}
	c.Hold = cmp.Or(c.Hold, 10*time.Second)
	c.Release = cmp.Or(c.Release, 30*time.Second)
	c.OpenTimeout = cmp.Or(c.OpenTimeout, 10*time.Second)
	c.MaxFailures = cmp.Or(c.MaxFailures, 64)
	c.Parallel = cmp.Or(c.Parallel, 32)
	c.Shoots = cmp.Or(c.Shoots, 4)
	c.BinDir = cmp.Or(c.BinDir, "bin")
}

func (c *Config) validate() error {
	var errs harness.Checks
	check := errs.Check
	check(c.Conns >= 1, "conns %d: want ≥ 1", c.Conns)
	check(c.Hold > 0 && c.Release > 0 && c.OpenTimeout > 0, "hold, release and open timeout must be > 0")
	check(c.MaxFailures >= 1 && c.Parallel >= 1, "max failures and parallel must be ≥ 1")
	check(c.Shoots >= 1 && c.Shoots <= 1000, "shoots %d: want 1..1000", c.Shoots)
	check(len(c.Listeners) > 0 && len(c.Targets) > 0, "no listeners or no targets")
	for i, l := range c.Listeners {
		check(slices.Contains(Listeners, l) && !slices.Contains(c.Listeners[:i], l), "listener %q: unknown or twice (want some of %v)", l, Listeners)
	}
	for i, t := range c.Targets {
		check(slices.Contains(Targets, t) && !slices.Contains(c.Targets[:i], t), "target %q: unknown or twice (want some of %v)", t, Targets)
	}
	return errs.Err()
}

// mode is the harness mode of a listener, with its peers tuned for holding
// many idle connections: connection limits sized to the descriptor limit,
// and tendril's idle timeout (1 h) instead of the rate modes' 60 s, so that
// no peer closes a connection the benchmark holds.
func mode(listener string, cfg Config, limit uint64) harness.Mode {
	m := sni.Mode
	if listener == ListenerProxy {
		m = incluster.Proxy
	}
	hconns, nconns := peerConns(limit)
	if cfg.PeerMaxConn > 0 {
		hconns, nconns = cfg.PeerMaxConn, 2*cfg.PeerMaxConn
	}
	timeouts := peers.DefaultTimeouts
	timeouts.Idle = time.Hour
	peer := m.Peer
	m.Peer = func(name string, hc harness.Config) harness.Peer {
		p := peer(name, hc)
		switch q := p.Peer.(type) {
		case peers.HAProxy:
			q.MaxConn, q.Timeouts = hconns, timeouts
			p.Peer = q
		case peers.Nginx:
			q.MaxConn, q.Timeouts = nconns, timeouts
			p.Peer = q
		}
		return p
	}
	return m
}

// Run runs the idle benchmark and returns its report. When ctx ends it stops
// early and returns what it measured so far, marked partial, with ctx's
// error. Peers, upstreams and connections are gone when it returns.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	soft, hard, limErr := raiseFDLimit()
	cfg.setDefaults(hard)
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("idle config: %w", err)
	}
	rep := &Report{Header: harness.StartHeader(cfg.CommandLine, Settings{
		Conns: cfg.Conns, Listeners: cfg.Listeners, Targets: cfg.Targets, HoldSeconds: cfg.Hold.Seconds(),
		ReleaseSeconds: cfg.Release.Seconds(), OpenTimeoutSeconds: cfg.OpenTimeout.Seconds(), MaxFailures: cfg.MaxFailures,
		Parallel: cfg.Parallel, Shoots: cfg.Shoots, FDSoft: soft, FDHard: hard, Kernel: kernelSettings()})}
	defer rep.End()
	r := &runner{cfg: cfg, report: rep}
	if limErr != nil {
		r.logf("descriptor limit: %v", limErr)
	}
	sess, err := harness.NewSession(harness.Config{Shoots: cfg.Shoots, BinDir: cfg.BinDir})
	if err != nil {
		return nil, err
	}
	defer func() { rep.Upstreams = sess.Upstreams() }() // after Close
	defer sess.Close()
	r.sess = sess
	for _, l := range cfg.Listeners {
		m := mode(l, cfg, hard)
		for _, name := range cfg.Targets {
			res := r.measure(ctx, m, l, name)
			rep.Results = append(rep.Results, res)
			if ctx.Err() != nil {
				rep.Partial = true
				rep.Note = fmt.Sprintf("interrupted during %s %s", l, name)
				return rep, ctx.Err()
			}
		}
	}
	return rep, nil
}

type runner struct {
	cfg    Config
	report *Report
	sess   *harness.Session
}

func (r *runner) logf(format string, args ...any) {
	if r.cfg.Progress != nil {
		fmt.Fprintf(r.cfg.Progress, "idle: "+format+"\n", args...)
	}
}

// settle is the pause after a target is ready and after the connections are
// open, before sampling: the readiness probe's connections and the last
// handshakes finish, so the samples see the idle state.
const settle = time.Second

// sampleEvery is the interval of the release samples.
const sampleEvery = 250 * time.Millisecond

// measure starts one target, holds N connections through it, and stops it.
func (r *runner) measure(ctx context.Context, m harness.Mode, listener, name string) *Result {
	res := &Result{Listener: listener, Target: name, Asked: r.cfg.Conns, ReleaseRSSSeconds: -1, ReleaseFDsSeconds: -1}
	t, info := r.sess.Start(ctx, m, name, r.cfg.Progress)
	res.Version, res.Config = info.Version, info.Config
	if t == nil {
		res.Skipped = info.Skipped
		return res
	}
	r.report.Settings.TLS = cmp.Or(r.report.Settings.TLS, t.TLS)
	defer func() {
		if err := t.Stop(); err != nil {
			r.logf("stop %s: %v", name, err)
		}
	}()
	label := listener + " " + name
	groups := t.Instance().DataPlaneGroups()
	gr := newGoroutines(t.Instance().Metrics)
	defer gr.close()

	if !harness.SleepCtx(ctx, settle) {
		return res
	}
	base := sample(groups)
	res.Processes = base.procs
	res.BaselineRSS, res.BaselineFDs = base.rss, base.fds
	res.BaselineGoroutines, res.GoroutineNote = gr.count()
	r.logf("%s: baseline RSS %s, %d fds, goroutines %s", label, fmtMiB(base.rss), base.fds, fmtCount(res.BaselineGoroutines))

	held, opened := r.open(ctx, t, res, label)
	defer func() {
		for _, h := range held {
			if h != nil {
				h.Close()
			}
		}
	}()
	res.Held = len(held)
	if ctx.Err() != nil || !harness.SleepCtx(ctx, settle) {
		return res
	}
	with := sample(groups)
	res.HeldRSS, res.HeldFDs = with.rss, with.fds
	var note string
	res.HeldGoroutines, note = gr.count()
	res.GoroutineNote = cmp.Or(res.GoroutineNote, note)
	res.perConn()
	r.logf("%s: %d of %d held: RSS %s (%.1f KiB/conn), %d fds (%.2f/conn), goroutines %s", label, res.Held, res.Asked,
		fmtMiB(with.rss), res.RSSPerConnKiB, with.fds, res.FDsPerConn, fmtCount(res.HeldGoroutines))

	// Hold, then ping every connection through.
	if !harness.SleepCtx(ctx, time.Until(opened.Add(r.cfg.Hold))) {
		return res
	}
	res.HoldSeconds = time.Since(opened).Seconds()
	r.ping(ctx, held, res)
	r.logf("%s: %d of %d answered a ping after %.0fs idle", label, res.Survivors, res.Held, res.HoldSeconds)
	if ctx.Err() != nil {
		return res
	}

	// Close all, then sample until both are back within 10% or the window
	// ends.
	for i, h := range held {
		h.Close()
		held[i] = nil
	}
	closed := time.Now()
	for {
		s := sample(groups)
		res.ReleasedRSS, res.ReleasedFDs = s.rss, s.fds
		el := time.Since(closed).Seconds()
		if res.ReleaseRSSSeconds < 0 && within(s.rss, base.rss) {
			res.ReleaseRSSSeconds = el
		}
		if res.ReleaseFDsSeconds < 0 && within(int64(s.fds), int64(base.fds)) {
			res.ReleaseFDsSeconds = el
		}
		if (res.ReleaseRSSSeconds >= 0 && res.ReleaseFDsSeconds >= 0) || time.Since(closed) >= r.cfg.Release {
			break
		}
		if !harness.SleepCtx(ctx, sampleEvery) {
			return res
		}
	}
	r.logf("%s: after close: RSS %s (%s), %d fds (%s)", label, fmtMiB(res.ReleasedRSS), fmtRelease(res.ReleaseRSSSeconds, r.cfg.Release.Seconds()),
		res.ReleasedFDs, fmtRelease(res.ReleaseFDsSeconds, r.cfg.Release.Seconds()))
	return res
}

// within reports whether v is within 10% of base (at least one unit above
// it: 10% of a dozen descriptors is one).
func within(v, base int64) bool { return v <= base+max(1, base/10) }

// open opens up to N connections through t with Parallel at once, spread
// over the shoots in turn, until N are held or MaxFailures have failed (a
// data plane out of descriptors), and returns them with the time the last
// one opened.
func (r *runner) open(ctx context.Context, t *harness.Target, res *Result, label string) ([]*harness.Held, time.Time) {
	n := r.cfg.Conns
	slots := make([]*harness.Held, n)
	var next, ok, failed atomic.Int64
	var mu sync.Mutex // guards res.OpenFailures and res.OpenFailureSamples
	start := time.Now()
	var wg sync.WaitGroup
	stopProgress := make(chan struct{})
	var progressWG sync.WaitGroup
	progressWG.Add(1)
	go func() {
		defer progressWG.Done()
		tick := time.NewTicker(2 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-stopProgress:
				return
			case <-tick.C:
				r.logf("%s: opening: %d held, %d failed", label, ok.Load(), failed.Load())
			}
		}
	}()
	for range min(r.cfg.Parallel, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && failed.Load() < int64(r.cfg.MaxFailures) {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				h, err := r.sess.Hold(ctx, t, i%r.cfg.Shoots, r.cfg.OpenTimeout)
				if err != nil {
					failed.Add(1)
					mu.Lock()
					res.countOpenFailure(err)
					mu.Unlock()
					continue
				}
				slots[i] = h
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	close(stopProgress)
	progressWG.Wait()
	res.OpenSeconds = time.Since(start).Seconds()
	held := slices.DeleteFunc(slots, func(h *harness.Held) bool { return h == nil })
	if f := failed.Load(); f > 0 {
		r.logf("%s: %d connections failed to open, stopped after %d held; first errors: %v", label, f, len(held), res.OpenFailureSamples)
	}
	return held, time.Now()
}

// ping pings every held connection, Parallel at once, and counts the
// survivors and the failures by reason.
func (r *runner) ping(ctx context.Context, held []*harness.Held, res *Result) {
	var next, ok atomic.Int64
	var mu sync.Mutex // guards res.PingFailures and res.PingFailureSamples
	var wg sync.WaitGroup
	for range min(r.cfg.Parallel, max(1, len(held))) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(held) {
					return
				}
				if err := held[i].Ping(r.cfg.OpenTimeout); err != nil {
					mu.Lock()
					res.PingFailures, res.PingFailureSamples = count(res.PingFailures, res.PingFailureSamples, err)
					mu.Unlock()
					continue
				}
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	res.Survivors = int(ok.Load())
}

// usage is the data plane's resident memory and descriptors, summed over
// its processes.
type usage struct {
	rss   int64
	fds   int
	procs int
}

func sample(groups []int) usage {
	var u usage
	for _, pid := range machine.GroupMembers(groups) {
		m, ok := peers.ReadMemory(pid)
		n, ok2 := machine.OpenFiles(pid)
		if !ok || !ok2 {
			continue // gone meanwhile
		}
		u.rss += m.RSS
		u.fds += n
		u.procs++
	}
	return u
}
