package tunnel

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
)

// Report is the result of Run.
type Report struct {
	harness.Header[Settings]
	Note    string          `json:"note,omitempty"`
	Stacks  []*StackResult  `json:"stacks"`
	Targets []*TargetResult `json:"targets"`
	// CryptoLimit is the cipher's own limit, measured before the stacks.
	CryptoLimit *CryptoLimit `json:"crypto_limit,omitempty"`
	// Goals compares tendril with the others against the project's
	// targets (evaluate fills it).
	Goals []Goal `json:"goals"`
}

// Settings are the run's parameters.
type Settings struct {
	Targets         []string `json:"targets"`
	DurationSeconds float64  `json:"duration_seconds"`
	WarmupSeconds   float64  `json:"warmup_seconds"`
	Conns           []int    `json:"bulk_conns"`
	DialWorkers     []int    `json:"dial_workers"`
	UpRuns          int      `json:"up_runs"`
	Rounds          int      `json:"rounds,omitempty"`
	// DialSeconds is the dial tests' window when it differs from DurationSeconds.
	DialSeconds   float64 `json:"dial_seconds,omitempty"`
	DialsOnly     bool    `json:"dials_only,omitempty"`
	SettleSeconds float64 `json:"settle_seconds,omitempty"`
	Loads         int     `json:"loads,omitempty"`
	// Impairments are the carrier's cells (Config.Impairments).
	Impairments []ImpairmentSettings `json:"impairments,omitempty"`
}

func settingsOf(c Config) Settings {
	s := Settings{Targets: c.Targets, DurationSeconds: c.Duration.Seconds(), WarmupSeconds: c.Warmup.Seconds(),
		Conns: c.Conns, DialWorkers: c.DialWorkers, UpRuns: c.UpRuns, Rounds: c.Rounds,
		DialsOnly: c.DialsOnly, SettleSeconds: c.Settle.Seconds()}
	for _, i := range c.Impairments {
		s.Impairments = append(s.Impairments, i.settings())
	}
	if c.Loads > 1 {
		s.Loads = c.Loads
	}
	if c.DialDuration != c.Duration {
		s.DialSeconds = c.DialDuration.Seconds()
	}
	return s
}

// StackResult is one data path's processes: what ran, how fast its tunnel
// came up, and its memory.
type StackResult struct {
	Name     string   `json:"name"`
	Targets  []string `json:"targets"`
	Path     string   `json:"path"`
	Version  string   `json:"version,omitempty"`
	Skipped  string   `json:"skipped,omitempty"`
	ProbeVia string   `json:"probe_via,omitempty"`
	// UpMS are the up times of each agent start: process start to the
	// first dial through the tunnel that reached the pod.
	UpMS   []float64  `json:"up_ms,omitempty"`
	Server ProcMemory `json:"server"`
	Agent  ProcMemory `json:"agent"`
	Config string     `json:"config,omitempty"`
}

// ProcMemory is one process's resident memory: with the tunnel up and idle
// before any measurement (after the up-time runs), and its peak (VmHWM)
// after all of them.
type ProcMemory struct {
	Process string `json:"process,omitempty"`
	// NoAgentRSS is the seed side's before any agent connected.
	NoAgentRSS int64 `json:"no_agent_rss_bytes,omitempty"`
	IdleRSS    int64 `json:"idle_rss_bytes,omitempty"`
	Peak       int64 `json:"peak_rss_bytes,omitempty"`
	// IdleSettledRSS is the RSS Config.Settle after IdleRSS, still idle (0: not measured): what
	// AfterRSS compares with. IdleRSS comes a second after tendril-server dropped its binary's
	// pages (tunnel up), AfterRSS tens of seconds after it dropped them again (idlemem, after the
	// load), and the idle process faults code back in over those seconds.
	IdleSettledRSS int64 `json:"idle_settled_rss_bytes,omitempty"`
	// AfterRSS is the RSS Config.Settle after the last measurement (0: not measured).
	AfterRSS int64 `json:"after_rss_bytes,omitempty"`
	// AfterMoreRSS is the RSS Config.Settle after each further load (Config.Loads > 1).
	AfterMoreRSS []int64 `json:"after_more_rss_bytes,omitempty"`
}

// UpMedian is the median up time, 0 if none was measured.
func (s *StackResult) UpMedian() float64 { return harness.Median(s.UpMS) }

// TargetResult is one target's measurements.
type TargetResult struct {
	Name    string       `json:"name"`
	Stack   string       `json:"stack"`
	Skipped string       `json:"skipped,omitempty"`
	Bulk    []BulkResult `json:"bulk,omitempty"`
	Dial    []DialResult `json:"dial,omitempty"`
	HOL     []HOLResult  `json:"head_of_line,omitempty"`
	Notes   []string     `json:"notes,omitempty"`
	// Cells are the figures under each impairment of the carrier (Config.Impairments), the
	// first cell's being the target's own.
	Cells []CellResult `json:"cells,omitempty"`
}

// BulkResult is one throughput measurement.
type BulkResult struct {
	Direction string  `json:"direction"`
	Conns     int     `json:"conns"`
	Seconds   float64 `json:"seconds"`
	Bytes     int64   `json:"bytes"`
	MBps      float64 `json:"mb_per_sec"`
	// CPUPerMB is the CPU time (ms) the stack's own processes spent per MB moved (0: no
	// processes, direct).
	CPUPerMB float64 `json:"cpu_ms_per_mb,omitempty"`
	// LongestGapMS (from-shoot only) is the longest time in the window that a connection went
	// without data: between two reads, or from its last read to the window's end. Across a
	// broken connection it runs on to the first read of the next.
	LongestGapMS float64 `json:"longest_gap_ms,omitempty"`
	// RoundMBps are the MB/s of every round when there were several.
	RoundMBps  []float64 `json:"round_mb_per_sec,omitempty"`
	Errors     int64     `json:"errors,omitempty"`
	FirstError string    `json:"first_error,omitempty"`
}

// DialResult is one dial measurement: dial through the path plus one round
// trip to the pod, then close.
type DialResult struct {
	Workers int     `json:"workers"`
	Seconds float64 `json:"seconds"`
	Dials   int64   `json:"dials"`
	PerSec  float64 `json:"dials_per_sec"`
	P50     float64 `json:"p50_ms"`
	P90     float64 `json:"p90_ms"`
	P99     float64 `json:"p99_ms"`
	// Max is the slowest dial of the window: a lost SYN shows here as ~1 s (gVisor's and
	// Linux's initial retransmission timeout) long before it moves p99.
	Max float64 `json:"max_ms"`
	// CPUPerDial is the CPU time (ms) the stack's own processes spent per dial.
	CPUPerDial float64 `json:"cpu_ms_per_dial,omitempty"`
	// RoundPerSec are the dials/s of every round when there were several.
	RoundPerSec []float64 `json:"round_dials_per_sec,omitempty"`
	Errors      int64     `json:"errors,omitempty"`
	FirstError  string    `json:"first_error,omitempty"`
}

// HOLResult is one head-of-line measurement: the throughput of a
// connection while another one of the same path is stalled.
type HOLResult struct {
	Direction string  `json:"direction"`
	MBps      float64 `json:"mb_per_sec"`
	// Alone is the same path's throughput with one connection and no
	// stalled one (from the bulk test).
	Alone        float64 `json:"alone_mb_per_sec"`
	StalledBytes int64   `json:"stalled_bytes"` // what the stalled connection moved before it stood still
	StallNote    string  `json:"stall_note,omitempty"`
	// RoundMBps are the MB/s of every round when there were several.
	RoundMBps  []float64 `json:"round_mb_per_sec,omitempty"`
	Errors     int64     `json:"errors,omitempty"`
	FirstError string    `json:"first_error,omitempty"`
}

// bulkCPU is the CPU per MB of the bulk run in dir with conns connections, 0 if none.
func (t *TargetResult) bulkCPU(dir string, conns int) float64 {
	for _, b := range t.Bulk {
		if b.Direction == dir && b.Conns == conns {
			return b.CPUPerMB
		}
	}
	return 0
}

// dialCPU is the CPU per dial of the dial run with workers, 0 if none.
func (t *TargetResult) dialCPU(workers int) float64 {
	for _, d := range t.Dial {
		if d.Workers == workers {
			return d.CPUPerDial
		}
	}
	return 0
}

// fmtCPU formats a CPU time in ms, "-" for none.
func fmtCPU(v float64) string {
	if v <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", v)
}

func (t *TargetResult) bulkMBps(dir string, conns int) float64 {
	for _, b := range t.Bulk {
		if b.Direction == dir && b.Conns == conns {
			return b.MBps
		}
	}
	return math.NaN()
}

func (t *TargetResult) dialRate(workers int) float64 {
	for _, d := range t.Dial {
		if d.Workers == workers {
			return d.PerSec
		}
	}
	return math.NaN()
}

func (t *TargetResult) holMBps(dir string) float64 {
	for _, h := range t.HOL {
		if h.Direction == dir {
			return h.MBps
		}
	}
	return math.NaN()
}

func (rep *Report) target(name string) *TargetResult {
	for _, t := range rep.Targets {
		if t.Name == name && t.Skipped == "" {
			return t
		}
	}
	return nil
}

func (rep *Report) stack(name string) *StackResult {
	for _, s := range rep.Stacks {
		if s.Name == name && s.Skipped == "" {
			return s
		}
	}
	return nil
}

// Goal is one comparison of a tendril figure with a target.
type Goal struct {
	Metric  string  `json:"metric"`
	Tendril string  `json:"tendril"` // the tendril target, or the stack
	Versus  string  `json:"versus"`  // the target compared with, "" for an absolute goal
	Value   float64 `json:"value"`
	Other   float64 `json:"other,omitempty"`
	Ratio   float64 `json:"ratio,omitempty"`
	// Infinite is set instead of Ratio when the other figure is 0.
	Infinite bool `json:"infinite,omitempty"`
	// Want is the goal: a minimum ratio, or for absolute goals a maximum
	// value (Unit says which); 0 means no goal, shown for information.
	Want float64 `json:"want,omitempty"`
	Unit string  `json:"unit"`
	Met  bool    `json:"met"`
}

// The project's goals for the reversed tunnel.
const (
	goalVsDirect = 0.4
	// goalVsTLS: the cheapest encrypted path (tls-relay) is the reference for throughput
	// (issue 22).
	goalVsTLS     = 0.5
	goalVsOpenVPN = 3
	goalVsKonn    = 2
	// goalVsCrypto: one connection to the shoot at half of what the cipher alone allows on
	// the two cores (issue 41).
	goalVsCrypto = 0.5
	goalUpMS     = 100
	goalIdleMiB  = 15
)

// evaluate fills Goals from the measurements.
func (rep *Report) evaluate() {
	rep.Goals = nil
	// Each tendril front-end against konnectivity's with the same protocol and transport:
	// CONNECT and gRPC over mutual TLS per dial, and kube-apiserver's grpc egress over a Unix
	// socket (tendril-egress-relay's one long-lived connection; proxy-server beside kube-apiserver).
	pairs := [][2]string{{TargetTendrilConnect, TargetKonnectivityConnect}, {TargetTendrilGRPC, TargetKonnectivityGRPC},
		{TargetTendrilRelay, TargetKonnectivityUDS}, {TargetTendrilTUN, TargetKonnectivityConnect}, {TargetTendrilTUNRelay, TargetKonnectivityUDS},
		{TargetTendrilRelayConnect, TargetKonnectivityConnectUDS}}
	add := func(metric, tendril, versus string, v, o, want float64, unit string) {
		if math.IsNaN(v) || math.IsNaN(o) || o == 0 && v == 0 {
			return
		}
		g := Goal{Metric: metric, Tendril: tendril, Versus: versus, Value: v, Other: o, Want: want, Unit: unit}
		if o > 0 {
			g.Ratio = v / o
		} else {
			g.Infinite = true // the other moved nothing (JSON has no +Inf)
		}
		g.Met = want == 0 || g.Infinite || g.Ratio >= want
		rep.Goals = append(rep.Goals, g)
	}
	for _, p := range pairs {
		t := rep.target(p[0])
		if t == nil {
			continue
		}
		for _, cmp := range []struct {
			name string
			want float64
		}{{TargetDirect, goalVsDirect}, {TargetTLSRelay, goalVsTLS}, {TargetOpenVPN, goalVsOpenVPN}, {p[1], goalVsKonn}} {
			o := rep.target(cmp.name)
			if o == nil {
				continue
			}
			for _, dir := range []string{ToShoot, FromShoot} {
				for _, b := range t.Bulk {
					if b.Direction == dir {
						add(fmt.Sprintf("bulk %s ×%d", dir, b.Conns), t.Name, o.Name, b.MBps, o.bulkMBps(dir, b.Conns), cmp.want, "MB/s")
					}
				}
			}
			for _, d := range t.Dial {
				want := 0.0
				if cmp.name == p[1] {
					want = cmp.want // dials: only konnectivity makes a TLS connection per dial too
				}
				add(fmt.Sprintf("dials/s ×%d", d.Workers), t.Name, o.Name, d.PerSec, o.dialRate(d.Workers), want, "dials/s")
			}
			if cmp.name == p[1] {
				for _, h := range t.HOL {
					add("head-of-line "+h.Direction, t.Name, o.Name, h.MBps, o.holMBps(h.Direction), 0, "MB/s")
				}
				// Work per CPU second of the data path's own processes (the CPU table's
				// inverse): the comparison that other load on the machine hardly moves.
				for _, b := range t.Bulk {
					add(fmt.Sprintf("bulk %s ×%d per CPU second", b.Direction, b.Conns), t.Name, o.Name,
						perCPUSecond(b.CPUPerMB), perCPUSecond(o.bulkCPU(b.Direction, b.Conns)), 0, "MB/CPU-s")
				}
				for _, d := range t.Dial {
					add(fmt.Sprintf("dials ×%d per CPU second", d.Workers), t.Name, o.Name,
						perCPUSecond(d.CPUPerDial), perCPUSecond(o.dialCPU(d.Workers)), 0, "dials/CPU-s")
				}
			}
		}
	}
	if s := rep.stack("tendril"); s != nil {
		if len(s.UpMS) > 0 {
			v := s.UpMedian()
			rep.Goals = append(rep.Goals, Goal{Metric: "tunnel up time (median)", Tendril: "tendril", Value: v, Want: goalUpMS, Unit: "ms", Met: v <= goalUpMS})
		}
		if s.Server.IdleRSS > 0 {
			v := float64(s.Server.IdleRSS) / (1 << 20)
			rep.Goals = append(rep.Goals, Goal{Metric: "idle tendril-server RSS, tunnel up", Tendril: "tendril", Value: v, Want: goalIdleMiB, Unit: "MiB", Met: v <= goalIdleMiB})
		}
		if s.Server.NoAgentRSS > 0 {
			v := float64(s.Server.NoAgentRSS) / (1 << 20)
			rep.Goals = append(rep.Goals, Goal{Metric: "idle tendril-server RSS, no agent", Tendril: "tendril", Value: v, Want: goalIdleMiB, Unit: "MiB", Met: v <= goalIdleMiB})
		}
	}
	rep.Goals = append(rep.Goals, rep.cellGoals()...)
	if lim := rep.CryptoLimit; lim != nil {
		// One connection to the shoot against the cipher's limit: half of it is the goal.
		for _, name := range []string{TargetTendrilConnect, TargetTendrilTUN} {
			if t := rep.target(name); t != nil {
				for _, dir := range []string{ToShoot, FromShoot} {
					add(fmt.Sprintf("bulk %s ×1 of the crypto limit", dir), t.Name, "crypto-limit", t.bulkMBps(dir, 1), lim.MBps, goalVsCrypto, "MB/s")
				}
			}
		}
	}
}

// perCPUSecond turns CPU ms per unit into units per CPU second (NaN without a figure).
func perCPUSecond(msPerUnit float64) float64 {
	if msPerUnit <= 0 {
		return math.NaN()
	}
	return 1000 / msPerUnit
}

// Missed returns the goals with a target that were missed.
func (rep *Report) Missed() []Goal {
	var out []Goal
	for _, g := range rep.Goals {
		if g.Want != 0 && !g.Met {
			out = append(out, g)
		}
	}
	return out
}

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error { return harness.WriteJSON(w, rep) }

func fmtMiB(b int64) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
}

func fmtBytes(b int64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.0f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}

func fmtMB(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case v < 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

func fmtMS(v float64) string {
	switch {
	case v == 0 || math.IsNaN(v):
		return "-"
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 100:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

func fmtRatio(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case math.IsInf(v, 1):
		return "∞"
	case v >= 10:
		return fmt.Sprintf("%.0f×", v)
	}
	return fmt.Sprintf("%.2f×", v)
}

// cell formats a figure with its ratio to direct.
func cellWithRatio(v, direct float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	if math.IsNaN(direct) || direct == 0 {
		return fmtMB(v)
	}
	return fmtMB(v) + " (" + fmtRatio(v/direct) + ")"
}

// table is one of the report's tables, shared by the text and Markdown
// output: a title, the table, and notes below it.
type table struct {
	title string
	harness.Table
	notes []string
}

// addBulkColumns adds a right-aligned column per direction and bulk connection count, headed
// by format with the direction and the count.
func (t *table) addBulkColumns(format string, conns []int) {
	for _, dir := range []string{ToShoot, FromShoot} {
		for _, n := range conns {
			t.Header = append(t.Header, fmt.Sprintf(format, dir, n))
			t.Left = append(t.Left, false)
		}
	}
}

func (rep *Report) tables() []table {
	var out []table
	direct := rep.target(TargetDirect)
	ref := func(dir string, n int) float64 {
		if direct == nil {
			return math.NaN()
		}
		return direct.bulkMBps(dir, n)
	}
	measured := func() []*TargetResult {
		var ts []*TargetResult
		for _, t := range rep.Targets {
			if t.Skipped == "" {
				ts = append(ts, t)
			}
		}
		return ts
	}()

	// Throughput.
	conns := rep.Settings.Conns
	tp := table{title: "Bulk throughput, MB/s (10^6 bytes/s, all connections together; in parentheses: × direct). " +
		"to-shoot: the client writes, the pod reads (counted by the pod); from-shoot: the pod writes, the client reads."}
	tp.Header, tp.Left = []string{"target"}, []bool{true}
	tp.addBulkColumns("%s ×%d", conns)
	tp.Header, tp.Left = append(tp.Header, "errors"), append(tp.Left, false)
	for _, t := range measured {
		row := []string{t.Name}
		var nerr int64
		for _, dir := range []string{ToShoot, FromShoot} {
			for _, n := range conns {
				row = append(row, cellWithRatio(t.bulkMBps(dir, n), ref(dir, n)))
			}
		}
		for _, b := range t.Bulk {
			nerr += b.Errors
		}
		tp.Rows = append(tp.Rows, append(row, strconv.FormatInt(nerr, 10)))
	}
	out = append(out, tp)

	// Dials.
	dt := table{title: "Dials: a new connection through the path (kube-apiserver's way: a new mutual-TLS connection to the " +
		"front-end per dial for tendril-connect, tendril-tun, tendril-grpc and konnectivity's TCP front-ends; a new gRPC connection on " +
		"a Unix socket for tendril-relay, tendril-tun-relay (the relay then opens a stream on its one connection to tendril-server) and " +
		"konnectivity-uds; a new Unix socket connection and a CONNECT for tendril-relay-connect (again a stream of the relay's one " +
		"connection) and konnectivity-connect-uds; a kernel TCP connect for direct and OpenVPN), one round trip to the pod, close. Latency in ms."}
	dt.Header, dt.Left = []string{"target"}, []bool{true}
	for _, n := range rep.Settings.DialWorkers {
		dt.Header = append(dt.Header, fmt.Sprintf("×%d dials/s", n), "p50", "p99", "worst")
		dt.Left = append(dt.Left, false, false, false, false)
	}
	dt.Header, dt.Left = append(dt.Header, "errors"), append(dt.Left, false)
	for _, t := range measured {
		row := []string{t.Name}
		var nerr int64
		for _, n := range rep.Settings.DialWorkers {
			found := false
			for _, d := range t.Dial {
				if d.Workers == n {
					row = append(row, fmt.Sprintf("%.0f", d.PerSec), fmtMS(d.P50), fmtMS(d.P99), fmtMS(d.Max))
					nerr += d.Errors
					found = true
				}
			}
			if !found {
				row = append(row, "-", "-", "-", "-")
			}
		}
		dt.Rows = append(dt.Rows, append(row, strconv.FormatInt(nerr, 10)))
	}
	out = append(out, dt)

	// CPU of the data path.
	ct := table{title: "CPU of the data path: user and system time of the stack's own processes (seed side, shoot side, " +
		"and the ingress for tendril and OpenVPN; not the client or the pod, which are the same for every target) per MB " +
		"moved in the bulk runs and per dial. It moves less than MB/s with other load on the machine. Kernel work " +
		"done in softirq context (much of loopback TCP's receive side) is not counted."}
	ct.Header, ct.Left = []string{"target"}, []bool{true}
	ct.addBulkColumns("ms/MB %s ×%d", conns)
	for _, n := range rep.Settings.DialWorkers {
		ct.Header = append(ct.Header, fmt.Sprintf("ms/dial ×%d", n))
		ct.Left = append(ct.Left, false)
	}
	for _, t := range measured {
		row := []string{t.Name}
		for _, dir := range []string{ToShoot, FromShoot} {
			for _, n := range conns {
				row = append(row, fmtCPU(t.bulkCPU(dir, n)))
			}
		}
		for _, n := range rep.Settings.DialWorkers {
			row = append(row, fmtCPU(t.dialCPU(n)))
		}
		if t.Name != TargetDirect {
			ct.Rows = append(ct.Rows, row)
		}
	}
	out = append(out, ct)

	// Head-of-line.
	ht := table{title: "Head-of-line blocking: one connection's receiver stops reading (to-shoot: the pod; from-shoot: the " +
		"client, as a kube-apiserver client that stops reading a log stream); once its sender is blocked, another connection " +
		"of the same path transfers. MB/s of that other connection, and its share of the same path's 1-connection figure."}
	ht.Header = []string{"target", "to-shoot MB/s", "× alone", "stalled after", "from-shoot MB/s", "× alone", "stalled after", "errors"}
	ht.Left = []bool{true, false, false, false, false, false, false, false}
	for _, t := range measured {
		row := []string{t.Name}
		var nerr int64
		for _, dir := range []string{ToShoot, FromShoot} {
			found := false
			for _, h := range t.HOL {
				if h.Direction != dir {
					continue
				}
				found = true
				ratio := math.NaN()
				if h.Alone > 0 {
					ratio = h.MBps / h.Alone
				}
				stalled := fmtBytes(h.StalledBytes)
				if h.StallNote != "" {
					stalled = h.StallNote
				}
				row = append(row, fmtMB(h.MBps), fmtRatio(ratio), stalled)
				nerr += h.Errors
			}
			if !found {
				row = append(row, "-", "-", "-")
			}
		}
		ht.Rows = append(ht.Rows, append(row, strconv.FormatInt(nerr, 10)))
	}
	out = append(out, ht)

	// Up time and memory.
	ut := table{title: "Tunnel up time (agent process start → first dial through the tunnel that reached the pod; median, " +
		"min–max) and resident memory (no agent: the seed side 1 s after it serves; idle: tunnel up, after the up-time runs " +
		"and before any measurement; peak: VmHWM after all measurements)."}
	settle := rep.Settings.SettleSeconds > 0
	side := func(name string) []string { return []string{name, "idle", "peak"} }
	if settle {
		// Each side's settled idle figure next to its idle one, the after figure next to its peak.
		idle, after := fmt.Sprintf("idle %.0f s on", rep.Settings.SettleSeconds), fmt.Sprintf("%.0f s after", rep.Settings.SettleSeconds)
		side = func(name string) []string { return []string{name, "idle", idle, "peak", after} }
		ut.title += fmt.Sprintf(" Idle %.0f s on: the idle reading repeated that much later, still idle (what the after figure compares with). "+
			"After: RSS that long after the last measurement (after each load, when the load ran several times).", rep.Settings.SettleSeconds)
	}
	seedSide := side("seed side")
	ut.Header = append(append(append([]string{"stack", "up ms", "min–max"}, seedSide[0], "no agent"), seedSide[1:]...), side("shoot side")...)
	ut.Left = make([]bool, len(ut.Header))
	ut.Left[0], ut.Left[3], ut.Left[4+len(seedSide)] = true, true, true
	for _, s := range rep.Stacks {
		if s.Skipped != "" || len(s.UpMS) == 0 {
			continue
		}
		lo, hi := slices.Min(s.UpMS), slices.Max(s.UpMS)
		memory := func(m ProcMemory) []string {
			if settle {
				after := fmtMiB(m.AfterRSS)
				for _, a := range m.AfterMoreRSS {
					after += " / " + fmtMiB(a)
				}
				return []string{fmtMiB(m.IdleRSS), fmtMiB(m.IdleSettledRSS), fmtMiB(m.Peak), after}
			}
			return []string{fmtMiB(m.IdleRSS), fmtMiB(m.Peak)}
		}
		row := []string{s.Name, fmtMS(s.UpMedian()), fmtMS(lo) + "–" + fmtMS(hi), s.Server.Process, fmtMiB(s.Server.NoAgentRSS)}
		row = append(append(append(row, memory(s.Server)...), s.Agent.Process), memory(s.Agent)...)
		ut.Rows = append(ut.Rows, row)
	}
	for _, s := range rep.Stacks {
		if s.ProbeVia != "" && s.Skipped == "" {
			ut.notes = append(ut.notes, s.Name+" probe: "+s.ProbeVia)
		}
	}
	out = append(out, ut)

	// Goals.
	gt := table{title: "tendril against the goals (≥ 0.4× direct, ≥ 0.5× the TLS relay pair, ≥ 3× OpenVPN-TCP, ≥ 2× konnectivity with the same " +
		"front-end protocol; one connection ≥ 0.5× the crypto limit; tunnel up ≤ 100 ms; idle tendril-server ≤ 15 MiB; " +
		"under an impaired carrier, per cell, ≥ the better peer's MB/s and a longest gap ≤ the peers' worst). Dial rates have a goal only against " +
		"konnectivity (direct and OpenVPN make no TLS connection per dial); head-of-line and per-CPU-second figures are for " +
		"information."}
	gt.Header = []string{"metric", "tendril", "value", "versus", "other", "ratio", "goal", "met"}
	gt.Left = []bool{true, true, false, true, false, false, false, true}
	for _, g := range rep.Goals {
		val, other, ratio, goal := fmtMB(g.Value)+" "+g.Unit, "", "", ""
		if g.Versus != "" {
			other, ratio = fmtMB(g.Other)+" "+g.Unit, fmtRatio(g.Ratio)
			if g.Infinite {
				ratio = "∞"
			}
			if g.Want != 0 {
				goal = "≥ " + strings.TrimSuffix(fmtRatio(g.Want), ".00×") + "×"
				goal = strings.Replace(goal, "××", "×", 1)
			}
		} else if g.Want != 0 {
			goal = fmt.Sprintf("≤ %g %s", g.Want, g.Unit)
		}
		met := ""
		switch {
		case g.Want == 0:
		case g.Met:
			met = "yes"
		case g.Versus != "":
			met = fmt.Sprintf("no (%.0f%% of the goal)", 100*g.Ratio/g.Want)
		default:
			met = fmt.Sprintf("no (%s over)", fmtMB(g.Value-g.Want)+" "+g.Unit)
		}
		gt.Rows = append(gt.Rows, []string{g.Metric, g.Tendril, val, g.Versus, other, ratio, goal, met})
	}
	if len(rep.Settings.Impairments) > 0 {
		out = append(out, rep.cellTable())
	}
	out = append(out, gt)
	return out
}

func (t *table) writeText(b *strings.Builder) {
	fmt.Fprintf(b, "\n%s\n", t.title)
	t.Write(b)
	for _, n := range t.notes {
		fmt.Fprintf(b, "  %s\n", n)
	}
}

func (t *table) writeMarkdown(b *strings.Builder) {
	fmt.Fprintf(b, "\n%s\n\n", t.title)
	t.WriteMarkdown(b)
	if len(t.notes) > 0 {
		b.WriteString("\n")
		for _, n := range t.notes {
			fmt.Fprintf(b, "- %s\n", harness.MDEscape(n))
		}
	}
}

func (s Settings) summary() string {
	rounds := ""
	if s.Rounds > 1 {
		rounds = fmt.Sprintf(", %d rounds of each in a row, the median shown", s.Rounds)
	}
	return fmt.Sprintf("%s per measurement after %s warm-up%s; bulk with %v connections; dials with %v workers; %d agent start(s) per stack",
		time.Duration(s.DurationSeconds*float64(time.Second)), time.Duration(s.WarmupSeconds*float64(time.Second)), rounds,
		s.Conns, s.DialWorkers, s.UpRuns)
}

const sharedNote = "The client, the pod and every process of the data path share this machine's CPUs: absolute figures " +
	"are bounded by that, compare the ratios. Stacks run one after another, never at the same time."

// WriteTable writes the report as plain-text tables.
func (rep *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "tendril-bench tunnel: %s\n", rep.Settings.summary())
	b.WriteString(rep.MachineLine())
	fmt.Fprintf(&b, "load average before/after: %s / %s; elapsed %.0fs\n", rep.LoadBefore, rep.LoadAfter, rep.ElapsedSeconds)
	fmt.Fprintf(&b, "note: %s\n", sharedNote)
	if l := rep.CryptoLimit.line(); l != "" {
		fmt.Fprintf(&b, "%s\n", l)
	}
	if rep.Partial {
		fmt.Fprintf(&b, "PARTIAL: %s\n", rep.Note)
	}
	b.WriteString("targets:\n")
	for _, t := range rep.Targets {
		s := rep.stackOf(t)
		switch {
		case t.Skipped != "":
			fmt.Fprintf(&b, "  %-21s skipped: %s\n", t.Name, t.Skipped)
		case s != nil:
			fmt.Fprintf(&b, "  %-21s %s\n", t.Name, s.Version)
		}
		for _, n := range t.Notes {
			fmt.Fprintf(&b, "  %-21s note: %s\n", "", n)
		}
	}
	for _, t := range rep.tables() {
		if len(t.Rows) > 0 {
			t.writeText(&b)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func (rep *Report) stackOf(t *TargetResult) *StackResult {
	for _, s := range rep.Stacks {
		if s.Name == t.Stack {
			return s
		}
	}
	return nil
}

// WriteMarkdown writes the report as a Markdown document.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	rep.WriteMarkdownHead(&b, "tunnel", rep.Note, "client and pod")
	fmt.Fprintf(&b, "- Settings: %s; elapsed %.0fs\n", rep.Settings.summary(), rep.ElapsedSeconds)
	fmt.Fprintf(&b, "- Load average (1/5/15 min) before / after the run: %s / %s\n", rep.LoadBefore, rep.LoadAfter)
	fmt.Fprintf(&b, "\n%s The pod is a TCP server in its own network namespace, reachable from the seed only through "+
		"a tunnel (direct uses a separate veth into the pod's namespace).\n", sharedNote)
	if l := rep.CryptoLimit.line(); l != "" {
		fmt.Fprintf(&b, "\n%s\n", l)
	}
	b.WriteString("\n## Targets\n\n| target | data path | version | status |\n|---|---|---|---|\n")
	for _, t := range rep.Targets {
		s := rep.stackOf(t)
		path, version := "", ""
		if s != nil {
			path, version = s.Path, s.Version
		}
		status := "measured"
		if t.Skipped != "" {
			status = "skipped: " + t.Skipped
		}
		for _, n := range t.Notes {
			status += "; " + n
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", t.Name, harness.MDEscape(path), harness.MDEscape(version), harness.MDEscape(status))
	}
	b.WriteString("\n## Results\n")
	for _, t := range rep.tables() {
		if len(t.Rows) > 0 {
			t.writeMarkdown(&b)
		}
	}
	if missed := rep.Missed(); len(missed) > 0 {
		b.WriteString("\n## Goals missed\n\n")
		for _, g := range missed {
			if g.Versus != "" {
				fmt.Fprintf(&b, "- %s, %s: %s× %s, goal %s× (%s %s vs %s %s; %.0f%% of the goal)\n", g.Metric, g.Tendril,
					strings.TrimSuffix(fmtRatio(g.Ratio), "×"), g.Versus, strings.TrimSuffix(fmtRatio(g.Want), "×"),
					fmtMB(g.Value), g.Unit, fmtMB(g.Other), g.Unit, 100*g.Ratio/g.Want)
			} else {
				fmt.Fprintf(&b, "- %s: %s %s, goal ≤ %g %s\n", g.Metric, fmtMB(g.Value), g.Unit, g.Want, g.Unit)
			}
		}
	}
	var cfgs []harness.PeerConfig
	for _, s := range rep.Stacks {
		cfgs = append(cfgs, harness.PeerConfig{Name: s.Name, Config: s.Config})
	}
	harness.WritePeerConfigs(&b, "Configurations", cfgs)
	_, err := io.WriteString(w, b.String())
	return err
}
