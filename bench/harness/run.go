// Package harness is the load generator shared by tendril-bench's modes. It
// measures TLS data planes side by side in one run, against the same
// upstreams with the same client code, and reports each one's figures with
// their ratios to a direct connection (the physical limit) and to the mode's
// baseline peer (HAProxy where it can do the job).
//
// A Mode names its targets and says how the client reaches a shoot's
// upstream through each: by the TLS server name alone (sni), after a PROXY v2
// header naming the shoot's advertised address (proxy), or after an HTTP
// CONNECT whose X-Gardener-Destination names the shoot (connect). Run starts
// N upstream TLS servers (one certificate per shoot host, from a CA made at
// run time) and the client inside this process, starts each peer data plane
// from package peers on loopback, and measures the targets one after another,
// never two at once: new TLS connections per second with time to first byte,
// and bulk throughput. It does not install peers (a missing one is skipped
// with its reason), does not terminate TLS itself, and does not parse flags
// or print anything but progress: output formats are methods of Report.
package harness

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/tendril-net/tendril/bench/peers"
)

// Target names. Direct is in every mode and measured by the harness itself;
// the ratio columns compare with direct and with the mode's Baseline.
const (
	TargetDirect  = "direct"
	TargetHAProxy = "haproxy"
	TargetNginx   = "nginx"
	TargetSquid   = "squid"
	TargetTendril = "tendril"
)

// Measurements.
const (
	ModeRate = "rate" // new TLS connections per second and time to first byte
	ModeBulk = "bulk" // bulk throughput
)

// Mode is one path of tendril-bench: its targets, and how the client opens a
// connection to a shoot through each.
type Mode struct {
	// Name is the mode's command ("sni"), in progress lines and reports.
	Name string
	// Targets are the mode's target names in report order, TargetDirect
	// first; a Config without targets measures all of them.
	Targets []string
	// Path says, for the report, what a connection through a data plane
	// sends before its TLS handshake, and what direct does instead; empty
	// when nothing precedes the handshake.
	Path string
	// Notes are remarks for the report, such as a peer that cannot do the
	// job and why.
	Notes []string
	// Baseline is the peer of the second ratio column; "" means
	// TargetHAProxy.
	Baseline string
	// Peer returns the data plane of a target other than TargetDirect.
	Peer func(name string, cfg Config) Peer
}

// Peer is a target's data plane and what the client says to it.
type Peer struct {
	peers.Peer
	// Preamble is what the client sends on a new connection before its
	// TLS handshake.
	Preamble Preamble
	// Static is set when the peer's routes are complete once it accepts
	// connections (a configuration file, no control plane): a definite
	// refusal in the readiness probe then skips it at once, where a
	// control-plane peer gets probeTimeout for its routes to arrive.
	Static bool
}

// Preamble is what the client sends on a new connection before TLS.
type Preamble int

const (
	// PreambleNone: the ClientHello's server name alone names the shoot.
	PreambleNone Preamble = iota
	// PreambleProxyV2: a PROXY protocol v2 header whose destination is
	// the shoot's advertised address, port 443, as the apiserver-proxy in
	// the shoot sends it (GEP-8).
	PreambleProxyV2
	// PreambleConnect: "CONNECT <host>:443" with an X-Gardener-Destination
	// header naming the shoot's kube-apiserver; TLS starts once a 2xx
	// answer has arrived.
	PreambleConnect
	// PreambleConnectUpstreamPort is PreambleConnect with the port of the
	// shoot's upstream in place of 443, for a peer that tunnels only to
	// the port the request names (squid); in a seed the two are the same.
	PreambleConnectUpstreamPort
)

// Config configures Run. The zero value runs the full benchmark with the
// defaults given per field.
type Config struct {
	// Shoots is the number of routes and upstreams; 0 means 4. Shoot i's
	// host is api.s<i>.bench.tendril.local.
	Shoots int
	// Targets to measure, from the mode's; nil means all of them.
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

func (c *Config) setDefaults(m Mode) {
	c.Shoots = cmp.Or(c.Shoots, 4)
	if c.Targets == nil {
		c.Targets = m.Targets
	}
	if c.Modes == nil {
		c.Modes = []string{ModeRate, ModeBulk}
	}
	if c.Concurrency == nil {
		c.Concurrency = []int{1, 16, 128}
	}
	c.Duration = cmp.Or(c.Duration, 5*time.Second)
	if c.Warmup == 0 {
		c.Warmup = min(c.Duration/5, time.Second)
	}
	c.Payload = cmp.Or(c.Payload, 64)
	c.BulkBytes = cmp.Or(c.BulkBytes, 64<<20)
	c.BulkConns = cmp.Or(c.BulkConns, 4)
	c.Rounds = cmp.Or(c.Rounds, 1)
	c.BinDir = cmp.Or(c.BinDir, "bin")
}

// Checks collects what is wrong with a configuration: Check records an error when ok is false,
// Err joins the errors recorded.
type Checks []error

// Check records the error format and args describe unless ok.
func (cs *Checks) Check(ok bool, format string, args ...any) {
	if !ok {
		*cs = append(*cs, fmt.Errorf(format, args...))
	}
}

// Err is the errors recorded, joined; nil if there are none.
func (cs Checks) Err() error { return errors.Join(cs...) }

func (c *Config) validate(m Mode) error {
	var errs Checks
	check := errs.Check
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
		check(slices.Contains(m.Targets, t), "unknown target %q (want some of %v)", t, m.Targets)
		check(!slices.Contains(c.Targets[:i], t), "target %q twice", t)
	}
	check(len(c.Modes) > 0, "no modes")
	for _, x := range c.Modes {
		check(x == ModeRate || x == ModeBulk, "unknown mode %q (want %s, %s)", x, ModeRate, ModeBulk)
	}
	return errs.Err()
}

// ShootName, ShootHost and ShootAdvertised name shoot i in routes, in the
// ClientHello and in the PROXY header. The advertised addresses are
// 240.0.0.1, 240.0.0.2, …: class E, never routed, so no packet can leave for
// them by mistake (the client only names them in the header).
func ShootName(i int) string { return fmt.Sprintf("shoot--bench--s%d", i) }
func ShootHost(i int) string { return fmt.Sprintf("api.s%d.bench.tendril.local", i) }
func ShootAdvertised(i int) netip.Addr {
	n := i + 1
	return netip.AddrFrom4([4]byte{240, byte(n >> 16), byte(n >> 8), byte(n)})
}

// target is one data plane under test, as the client sees it.
type target struct {
	name     string
	addr     func(shoot int) string // where the client dials for shoot i
	preamble Preamble
	static   bool
	inst     *peers.Instance // nil for direct
	// dataPlane are the process groups whose CPU is the data plane's
	// (inst.DataPlaneGroups); nil for direct.
	dataPlane []int
}

// Readiness probe timeouts: the wait until every route works through a
// freshly started peer. A peer with a control plane gets its routes a moment
// after its listener opens; a static one has them from the start.
const (
	probeTimeout       = 30 * time.Second
	staticProbeTimeout = 5 * time.Second
)

// Installed returns the mode's targets that can run here (direct always),
// and why each other one cannot.
func (m Mode) Installed(ctx context.Context, cfg Config) (targets []string, missing map[string]string) {
	for _, name := range m.Targets {
		if name != TargetDirect {
			if err := m.Peer(name, cfg).Check(ctx); err != nil {
				if missing == nil {
					missing = map[string]string{}
				}
				missing[name] = err.Error()
				continue
			}
		}
		targets = append(targets, name)
	}
	return targets, missing
}

// Run runs mode's benchmark and returns its report. When ctx ends it stops
// early and returns the report of the measurements completed so far, marked
// partial, together with ctx's error. Peers, upstreams and temporary files
// are gone when it returns.
func Run(ctx context.Context, mode Mode, cfg Config) (*Report, error) {
	cfg.setDefaults(mode)
	if err := cfg.validate(mode); err != nil {
		return nil, fmt.Errorf("%s config: %w", mode.Name, err)
	}
	baseline := mode.Baseline
	baseline = cmp.Or(baseline, TargetHAProxy)
	rep := &Report{Mode: mode.Name, Path: mode.Path, Notes: mode.Notes, Baseline: baseline,
		Header: StartHeader(cfg.CommandLine, settingsOf(cfg))}
	defer rep.End()

	sess, err := newSession(cfg, mode.Name)
	if err != nil {
		return nil, err
	}
	defer func() { rep.Upstreams = sess.ups.stats(sess.names) }() // runs after sess.Close below
	defer sess.Close()
	ups, routes, tmp := sess.ups, sess.routes, sess.tmp

	r := &runner{cfg: cfg, mode: mode, client: sess.client, progress: cfg.Progress, report: rep}
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
		t := &target{name: name, addr: func(i int) string { return ups[i].addr() }, static: true}
		state, err := r.client.probe(ctx, t, staticProbeTimeout)
		if err != nil {
			info.Skipped = fmt.Sprintf("upstreams do not answer: %v", err)
			return nil, info
		}
		r.report.Settings.TLS = describeTLS(state)
		return t, info
	}
	peer := r.mode.Peer(name, r.cfg)
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
	t := &target{name: name, addr: func(int) string { return inst.Addr }, preamble: peer.Preamble, static: peer.Static, inst: inst,
		dataPlane: inst.DataPlaneGroups()}
	timeout := probeTimeout
	if t.static {
		timeout = staticProbeTimeout
	}
	state, err := r.client.probe(ctx, t, timeout)
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
