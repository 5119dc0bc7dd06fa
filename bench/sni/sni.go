// Package sni is the "sni" mode of tendril-bench: it measures SNI-passthrough
// data planes side by side in one run, against the same upstreams with the
// same client code, and reports each one's figures with their ratios to a
// direct connection (the physical limit) and to HAProxy.
//
// Run starts N upstream TLS servers (one certificate per shoot host, from a
// CA made at run time) and the client inside this process, starts each peer
// data plane from package peers on loopback, and measures the targets one
// after another, never two at once: new TLS connections per second with time
// to first byte, and bulk throughput. It does not install peers (a missing
// one is skipped with its reason), does not terminate TLS itself, and does
// not parse flags or print anything but progress: output formats are methods
// of Report.
package sni

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/bench/peers"
)

// Target names.
const (
	TargetDirect  = "direct"
	TargetHAProxy = "haproxy"
	TargetNginx   = "nginx"
	TargetTendril = "tendril"
)

// Modes.
const (
	ModeRate = "rate" // new TLS connections per second and time to first byte
	ModeBulk = "bulk" // bulk throughput
)

// DefaultTargets is every target, in report order.
var DefaultTargets = []string{TargetDirect, TargetHAProxy, TargetNginx, TargetTendril}

// Config configures Run. The zero value runs the full benchmark with the
// defaults given per field.
type Config struct {
	// Shoots is the number of routes and upstreams; 0 means 4. Shoot i's
	// host is api.s<i>.bench.tendril.local.
	Shoots int
	// Targets to measure, from DefaultTargets; nil means all of them.
	Targets []string
	// Modes to run, ModeRate and/or ModeBulk; nil means both.
	Modes []string
	// Concurrency levels of the connection-rate test; nil means 1, 16, 128.
	Concurrency []int
	// Duration of each measurement; 0 means 5 s.
	Duration time.Duration
	// Warmup before each measurement, not counted; 0 means Duration/5,
	// at most 1 s.
	Warmup time.Duration
	// Payload is the size of the small answer; 0 means 64 bytes.
	Payload int
	// BulkBytes is the size of one bulk answer; 0 means 64 MiB.
	BulkBytes int64
	// BulkConns is the number of concurrent bulk connections; 0 means 4.
	BulkConns int
	// Rounds repeats the whole sequence of measurements; the report shows
	// medians. 0 means 1.
	Rounds int
	// BinDir holds tendril-seed and tendril-ingress; "" means "bin".
	BinDir string
	// Progress receives a line per measurement and periodic progress;
	// nil means silent.
	Progress io.Writer
	// CommandLine is recorded in the report as is.
	CommandLine string
}

func (c *Config) setDefaults() {
	if c.Shoots == 0 {
		c.Shoots = 4
	}
	if c.Targets == nil {
		c.Targets = DefaultTargets
	}
	if c.Modes == nil {
		c.Modes = []string{ModeRate, ModeBulk}
	}
	if c.Concurrency == nil {
		c.Concurrency = []int{1, 16, 128}
	}
	if c.Duration == 0 {
		c.Duration = 5 * time.Second
	}
	if c.Warmup == 0 {
		c.Warmup = min(c.Duration/5, time.Second)
	}
	if c.Payload == 0 {
		c.Payload = 64
	}
	if c.BulkBytes == 0 {
		c.BulkBytes = 64 << 20
	}
	if c.BulkConns == 0 {
		c.BulkConns = 4
	}
	if c.Rounds == 0 {
		c.Rounds = 1
	}
	if c.BinDir == "" {
		c.BinDir = "bin"
	}
}

func (c *Config) validate() error {
	var errs []error
	check := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	check(c.Shoots >= 1 && c.Shoots <= 1000, "shoots %d: want 1..1000", c.Shoots)
	check(c.Duration > 0, "duration %v: want > 0", c.Duration)
	check(c.Warmup >= 0, "warm-up %v: want ≥ 0", c.Warmup)
	// The answer names the shoot ("tendril-bench upstream s999\n"), so it
	// needs room for that.
	check(c.Payload >= 32 && c.Payload <= 1<<20, "payload %d: want 32 bytes..1 MiB", c.Payload)
	check(c.BulkBytes > 0, "bulk bytes %d: want > 0", c.BulkBytes)
	check(c.BulkConns >= 1 && c.BulkConns <= 1024, "bulk connections %d: want 1..1024", c.BulkConns)
	check(c.Rounds >= 1, "rounds %d: want ≥ 1", c.Rounds)
	check(len(c.Concurrency) > 0, "no concurrency levels")
	for i, n := range c.Concurrency {
		check(n >= 1 && n <= 4096, "concurrency %d: want 1..4096", n)
		check(!slices.Contains(c.Concurrency[:i], n), "concurrency %d twice (use rounds to repeat)", n)
	}
	check(len(c.Targets) > 0, "no targets")
	for i, t := range c.Targets {
		check(slices.Contains(DefaultTargets, t), "unknown target %q (want some of %v)", t, DefaultTargets)
		check(!slices.Contains(c.Targets[:i], t), "target %q twice", t)
	}
	check(len(c.Modes) > 0, "no modes")
	for _, m := range c.Modes {
		check(m == ModeRate || m == ModeBulk, "unknown mode %q (want %s, %s)", m, ModeRate, ModeBulk)
	}
	return errors.Join(errs...)
}

// shootName and shootHost name shoot i in routes and in the ClientHello.
func shootName(i int) string { return fmt.Sprintf("shoot--bench--s%d", i) }
func shootHost(i int) string { return fmt.Sprintf("api.s%d.bench.tendril.local", i) }

// target is one data plane under test, as the client sees it.
type target struct {
	name string
	addr func(shoot int) string // where the client dials for shoot i
	inst *peers.Instance        // nil for direct
}

// probeTimeout bounds the wait until every route works through a freshly
// started peer.
const probeTimeout = 30 * time.Second

// Run runs the benchmark and returns its report. When ctx ends it stops
// early and returns the report of the measurements completed so far, marked
// partial, together with ctx's error. Peers, upstreams and temporary files
// are gone when it returns.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("sni config: %w", err)
	}
	rep := &Report{Mode: "sni", CommandLine: cfg.CommandLine, Machine: machine.Describe(),
		Settings: settingsOf(cfg), Started: time.Now(), LoadBefore: machine.LoadAverage()}
	defer func() {
		rep.ElapsedSeconds = time.Since(rep.Started).Seconds()
		rep.LoadAfter = machine.LoadAverage()
	}()

	var names, hosts []string
	for i := range cfg.Shoots {
		names, hosts = append(names, shootName(i)), append(hosts, shootHost(i))
	}
	p, err := newPKI(hosts)
	if err != nil {
		return nil, fmt.Errorf("test PKI: %w", err)
	}
	ups, err := startUpstreams(p, hosts, cfg.Payload, cfg.BulkBytes)
	if err != nil {
		return nil, err
	}
	defer func() { rep.Upstreams = ups.stats(names) }() // runs after ups.Close below
	defer ups.Close()
	var routes []peers.Route
	for i, u := range ups {
		routes = append(routes, peers.Route{Name: names[i], Host: hosts[i], Upstream: u.addr()})
	}
	cl := newClient(p, hosts, cfg.Payload, cfg.BulkBytes)

	tmp, err := os.MkdirTemp("", "tendril-bench-sni-")
	if err != nil {
		return nil, fmt.Errorf("temporary directory: %w", err)
	}
	defer os.RemoveAll(tmp)

	r := &runner{cfg: cfg, client: cl, progress: cfg.Progress, report: rep}
	var targets []*target
	// Peers stop in reverse start order when Run returns, Ctrl-C included.
	defer func() {
		for _, t := range slices.Backward(targets) {
			if t.inst != nil {
				if err := t.inst.Stop(); err != nil {
					r.logf("stop %s: %v", t.name, err)
				}
			}
		}
	}()
	for _, name := range cfg.Targets {
		t, info := r.startTarget(ctx, name, ups, tmp, routes)
		rep.Targets = append(rep.Targets, info)
		if t != nil {
			targets = append(targets, t)
			if t.inst != nil {
				r.groups = append(r.groups, t.inst.Groups()...)
			}
		}
		if ctx.Err() != nil {
			return rep.interrupted("while starting " + name), ctx.Err()
		}
	}
	if len(targets) == 0 {
		return rep, errors.New("no target could be started")
	}

	if err := r.measureAll(ctx, targets); err != nil {
		return rep, err
	}
	rep.aggregate()
	return rep, nil
}

// startTarget starts the named target and checks that every route works
// through it. It returns nil and the reason in info.Skipped if the target
// cannot run here.
func (r *runner) startTarget(ctx context.Context, name string, ups upstreams, tmp string, routes []peers.Route) (*target, TargetInfo) {
	info := TargetInfo{Name: name}
	if name == TargetDirect {
		info.Version = "in-process upstreams, no data plane"
		t := &target{name: name, addr: func(i int) string { return ups[i].addr() }}
		state, err := r.client.probe(ctx, t, probeTimeout)
		if err != nil {
			info.Skipped = fmt.Sprintf("upstreams do not answer: %v", err)
			return nil, info
		}
		r.report.Settings.TLS = describeTLS(state)
		return t, info
	}
	var peer peers.SNI
	switch name {
	case TargetHAProxy:
		peer = peers.HAProxy{}
	case TargetNginx:
		peer = peers.Nginx{}
	case TargetTendril:
		peer = peers.Tendril{BinDir: r.cfg.BinDir}
	}
	if err := peer.Check(ctx); err != nil {
		info.Skipped = err.Error()
		r.logf("%s: skipped: %s", name, info.Skipped)
		return nil, info
	}
	dir := filepath.Join(tmp, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		info.Skipped = fmt.Sprintf("temporary directory: %v", err)
		return nil, info
	}
	r.logf("%s: starting", name)
	inst, err := peer.Start(ctx, dir, routes)
	if err != nil {
		info.Skipped = fmt.Sprintf("start failed: %v", err)
		r.logf("%s: skipped: %s", name, info.Skipped)
		return nil, info
	}
	info.Version, info.Addr, info.Config = inst.Version, inst.Addr, inst.Config
	t := &target{name: name, addr: func(int) string { return inst.Addr }, inst: inst}
	state, err := r.client.probe(ctx, t, probeTimeout)
	if err != nil {
		info.Skipped = fmt.Sprintf("routes do not work: %v", err)
		r.logf("%s: skipped: %s", name, info.Skipped)
		if err := inst.Stop(); err != nil {
			r.logf("stop %s: %v", name, err)
		}
		return nil, info
	}
	if r.report.Settings.TLS == "" {
		r.report.Settings.TLS = describeTLS(state)
	}
	r.logf("%s: ready on %s (%s)", name, inst.Addr, inst.Version)
	return t, info
}
