package harness

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/tendril-net/tendril/bench/hist"
	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/bench/peers"
)

// Report is the result of Run. Rate and Bulk hold one row per target and
// measurement (medians over rounds); RateRuns and BulkRuns every single
// measurement.
type Report struct {
	Mode string `json:"mode"`
	// Path is what a connection sends before its TLS handshake (the
	// mode's Path); Notes are the mode's remarks.
	Path  string   `json:"path,omitempty"`
	Notes []string `json:"notes,omitempty"`
	// Baseline is the peer of the second ratio column (the mode's).
	Baseline string `json:"baseline"`
	Header[Settings]
	// Note says where a partial run was interrupted.
	Note      string          `json:"note,omitempty"`
	Targets   []TargetInfo    `json:"targets"`
	Rate      []RateRow       `json:"rate,omitempty"`
	Bulk      []BulkRow       `json:"bulk,omitempty"`
	Upstreams []UpstreamStats `json:"upstreams"`
	RateRuns  []*RateRun      `json:"rate_runs,omitempty"`
	BulkRuns  []*BulkRun      `json:"bulk_runs,omitempty"`
}

// Header is what every mode's report starts with: how, where and when it
// ran, with the mode's settings S. A report embeds it, so its JSON has these
// fields at the top level, in this order.
type Header[S any] struct {
	CommandLine    string              `json:"command_line,omitempty"`
	Machine        machine.Description `json:"machine"`
	Settings       S                   `json:"settings"`
	Started        time.Time           `json:"started"`
	ElapsedSeconds float64             `json:"elapsed_seconds"`
	// LoadBefore and LoadAfter are the machine's load averages (1, 5,
	// 15 min) around the run: anything well above zero before the run
	// means other work shared the CPUs with the benchmark.
	LoadBefore string `json:"load_before"`
	LoadAfter  string `json:"load_after"`
	// Partial is set when the run was interrupted or failed.
	Partial bool `json:"partial"`
}

// StartHeader describes a run that starts now on this machine.
func StartHeader[S any](commandLine string, settings S) Header[S] {
	return Header[S]{CommandLine: commandLine, Machine: machine.Describe(), Settings: settings,
		Started: time.Now(), LoadBefore: machine.LoadAverage()}
}

// End records the run's end: the time it took and the load average after it.
func (h *Header[S]) End() {
	h.ElapsedSeconds = time.Since(h.Started).Seconds()
	h.LoadAfter = machine.LoadAverage()
}

// WriteMarkdownHead writes the start of a mode's Markdown report: its title
// with the start time, note if the run was partial, the machine, the Go
// version (the benchmark's, which runs goRuns) and the command line.
func (h *Header[S]) WriteMarkdownHead(b *strings.Builder, mode, note, goRuns string) {
	m := h.Machine
	fmt.Fprintf(b, "# tendril-bench %s — %s\n\n", mode, h.Started.Format("2006-01-02 15:04 MST"))
	if h.Partial {
		fmt.Fprintf(b, "> **Partial results:** %s.\n\n", note)
	}
	fmt.Fprintf(b, "- Machine: %s, %d cores (GOMAXPROCS %d), %s, %s\n", m.CPUModel, m.Cores, m.GOMAXPROCS, m.Kernel, m.GOOSARCH)
	fmt.Fprintf(b, "- Go: %s (%s)\n", m.GoVersion, goRuns)
	if h.CommandLine != "" {
		fmt.Fprintf(b, "- Command: `%s`\n", h.CommandLine)
	}
}

// MachineLine is the plain-text report's line about the machine.
func (h *Header[S]) MachineLine() string {
	m := h.Machine
	return fmt.Sprintf("machine: %s, %d cores, %s, %s\n", m.CPUModel, m.Cores, m.Kernel, m.GoVersion)
}

// Settings are the parameters of the run.
type Settings struct {
	Shoots          int      `json:"shoots"`
	Targets         []string `json:"targets"`
	Modes           []string `json:"modes"`
	Concurrency     []int    `json:"concurrency"`
	DurationSeconds float64  `json:"duration_seconds"`
	WarmupSeconds   float64  `json:"warmup_seconds"`
	PayloadBytes    int      `json:"payload_bytes"`
	BulkBytes       int64    `json:"bulk_bytes"`
	BulkConns       int      `json:"bulk_conns"`
	Rounds          int      `json:"rounds"`
	PeerTimeouts    string   `json:"peer_timeouts"`
	TLS             string   `json:"tls"` // negotiated parameters, from the readiness probe
}

func settingsOf(c Config) Settings {
	to := peers.DefaultTimeouts
	return Settings{Shoots: c.Shoots, Targets: c.Targets, Modes: c.Modes, Concurrency: c.Concurrency,
		DurationSeconds: c.Duration.Seconds(), WarmupSeconds: c.Warmup.Seconds(), PayloadBytes: c.Payload,
		BulkBytes: c.BulkBytes, BulkConns: c.BulkConns, Rounds: c.Rounds,
		PeerTimeouts: fmt.Sprintf("ClientHello %v, connect %v, idle %v", to.Hello, to.Connect, to.Idle)}
}

// TargetInfo describes a target, or why it was skipped.
type TargetInfo struct {
	Name    string `json:"name"`
	Version string `json:"version,omitempty"`
	Addr    string `json:"addr,omitempty"`
	Skipped string `json:"skipped,omitempty"`
	Config  string `json:"config,omitempty"` // the peer's rendered configuration
}

// Latency summarises a time-to-first-byte histogram, in milliseconds.
type Latency struct {
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	P99  float64 `json:"p99_ms"`
	Mean float64 `json:"mean_ms"`
	Max  float64 `json:"max_ms"`
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func latencyOf(h *hist.Histogram) Latency {
	return Latency{P50: ms(h.Percentile(0.50)), P90: ms(h.Percentile(0.90)), P99: ms(h.Percentile(0.99)),
		Mean: ms(h.Mean()), Max: ms(h.Max())}
}

// RateRun is one connection-rate measurement.
type RateRun struct {
	Target       string            `json:"target"`
	Concurrency  int               `json:"concurrency"`
	Round        int               `json:"round"`
	Seconds      float64           `json:"seconds"`
	Conns        int64             `json:"conns"` // successful, completed inside the window
	ConnsPerSec  float64           `json:"conns_per_sec"`
	TTFB         Latency           `json:"ttfb"`
	Errors       map[string]int64  `json:"errors,omitempty"`
	ErrorSamples map[string]string `json:"error_samples,omitempty"`
	// OtherCPU is the CPU, in cores, that processes other than the
	// benchmark and its peers (and the hypervisor, as steal) used during
	// the window: noise, ideally near 0.
	OtherCPU float64 `json:"other_cpu_cores"`
	// PerShoot counts successful connections per shoot: each one
	// verified shoot i's certificate for its host and got shoot i's
	// upstream's answer.
	PerShoot []int64 `json:"per_shoot"`
	// DataPlaneCPU is the user+system CPU time, in seconds, that the
	// target's data-plane processes (all of them: nginx's master and
	// workers; tendril-ingress, not tendril-seed) used in the window;
	// CPUPerConn is that per counted connection, in µs. Both are 0 for
	// direct, which has no data plane.
	DataPlaneCPU float64 `json:"data_plane_cpu_seconds,omitempty"`
	CPUPerConn   float64 `json:"cpu_us_per_conn,omitempty"`

	hist hist.Histogram
}

// BulkRun is one bulk-throughput measurement.
type BulkRun struct {
	Target       string            `json:"target"`
	Conns        int               `json:"conns"`
	Round        int               `json:"round"`
	Seconds      float64           `json:"seconds"`
	Bytes        int64             `json:"bytes"` // read inside the window, all connections
	MBps         float64           `json:"mb_per_sec"`
	Transfers    int64             `json:"transfers"` // complete answers that ended inside the window
	Errors       map[string]int64  `json:"errors,omitempty"`
	ErrorSamples map[string]string `json:"error_samples,omitempty"`
	OtherCPU     float64           `json:"other_cpu_cores"` // as in RateRun
}

// RateRow is a target's connection-rate result at one concurrency: the
// median over rounds of connections per second, the TTFB of all rounds
// together, and errors summed.
type RateRow struct {
	Concurrency int              `json:"concurrency"`
	Target      string           `json:"target"`
	ConnsPerSec float64          `json:"conns_per_sec"`
	VsDirect    *float64         `json:"vs_direct"`   // null when direct was not measured
	VsBaseline  *float64         `json:"vs_baseline"` // to Report.Baseline; null when it was not measured
	TTFB        Latency          `json:"ttfb"`
	Conns       int64            `json:"conns"`
	Errors      map[string]int64 `json:"errors,omitempty"`
	OtherCPU    float64          `json:"other_cpu_cores"` // the most of any round
	// CPUPerConn is the data plane's CPU time per new connection, in µs,
	// over all rounds (their CPU summed over their connections summed); 0
	// for direct. CPUVsBaseline is its ratio to the baseline's: ≤ 1 means
	// no more CPU per connection than the baseline.
	CPUPerConn    float64  `json:"cpu_us_per_conn,omitempty"`
	CPUVsBaseline *float64 `json:"cpu_vs_baseline,omitempty"`
}

// BulkRow is a target's bulk result: the median over rounds.
type BulkRow struct {
	Target     string           `json:"target"`
	Conns      int              `json:"conns"`
	MBps       float64          `json:"mb_per_sec"`
	VsDirect   *float64         `json:"vs_direct"`
	VsBaseline *float64         `json:"vs_baseline"`
	Transfers  int64            `json:"transfers"`
	Errors     map[string]int64 `json:"errors,omitempty"`
	OtherCPU   float64          `json:"other_cpu_cores"` // the most of any round
}

// Median is the median of xs, 0 for none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ratio(x float64, base map[string]float64, name string) *float64 {
	b, ok := base[name]
	if !ok || b == 0 {
		return nil
	}
	v := x / b
	return &v
}

func addErrors(dst map[string]int64, src map[string]int64) map[string]int64 {
	for k, v := range src {
		if dst == nil {
			dst = map[string]int64{}
		}
		dst[k] += v
	}
	return dst
}

// targetOrder is the report order of targets: the order they were asked for.
func (rep *Report) targetOrder() []string {
	var names []string
	for _, t := range rep.Targets {
		names = append(names, t.Name)
	}
	return names
}

// aggregate computes Rate and Bulk from the runs so far.
func (rep *Report) aggregate() {
	order := rep.targetOrder()
	idx := func(name string) int { return slices.Index(order, name) }

	rep.Rate = nil
	type key struct {
		conc   int
		target string
	}
	groups := map[key][]*RateRun{}
	for _, r := range rep.RateRuns {
		k := key{r.Concurrency, r.Target}
		groups[k] = append(groups[k], r)
	}
	keys := slices.SortedFunc(maps.Keys(groups), func(a, b key) int {
		return cmp.Or(cmp.Compare(slices.Index(rep.Settings.Concurrency, a.conc), slices.Index(rep.Settings.Concurrency, b.conc)),
			cmp.Compare(idx(a.target), idx(b.target)))
	})
	base, cpuBase := map[int]map[string]float64{}, map[int]map[string]float64{}
	for _, k := range keys {
		var rates []float64
		var h hist.Histogram
		var cpu float64
		row := RateRow{Concurrency: k.conc, Target: k.target}
		for _, r := range groups[k] {
			rates = append(rates, r.ConnsPerSec)
			h.Merge(&r.hist)
			row.Conns += r.Conns
			row.Errors = addErrors(row.Errors, r.Errors)
			row.OtherCPU = max(row.OtherCPU, r.OtherCPU)
			cpu += r.DataPlaneCPU
		}
		row.ConnsPerSec = Median(rates)
		row.TTFB = latencyOf(&h)
		row.CPUPerConn = cpuPerConn(cpu, row.Conns)
		rep.Rate = append(rep.Rate, row)
		if base[k.conc] == nil {
			base[k.conc], cpuBase[k.conc] = map[string]float64{}, map[string]float64{}
		}
		base[k.conc][k.target] = row.ConnsPerSec
		cpuBase[k.conc][k.target] = row.CPUPerConn
	}
	for i := range rep.Rate {
		row := &rep.Rate[i]
		row.VsDirect = ratio(row.ConnsPerSec, base[row.Concurrency], TargetDirect)
		row.VsBaseline = ratio(row.ConnsPerSec, base[row.Concurrency], rep.Baseline)
		if row.CPUPerConn > 0 {
			row.CPUVsBaseline = ratio(row.CPUPerConn, cpuBase[row.Concurrency], rep.Baseline)
		}
	}

	rep.Bulk = nil
	bgroups := map[string][]*BulkRun{}
	for _, r := range rep.BulkRuns {
		bgroups[r.Target] = append(bgroups[r.Target], r)
	}
	bbase := map[string]float64{}
	for _, name := range order {
		runs := bgroups[name]
		if len(runs) == 0 {
			continue
		}
		var xs []float64
		row := BulkRow{Target: name, Conns: runs[0].Conns}
		for _, r := range runs {
			xs = append(xs, r.MBps)
			row.Transfers += r.Transfers
			row.Errors = addErrors(row.Errors, r.Errors)
			row.OtherCPU = max(row.OtherCPU, r.OtherCPU)
		}
		row.MBps = Median(xs)
		bbase[name] = row.MBps
		rep.Bulk = append(rep.Bulk, row)
	}
	for i := range rep.Bulk {
		row := &rep.Bulk[i]
		row.VsDirect = ratio(row.MBps, bbase, TargetDirect)
		row.VsBaseline = ratio(row.MBps, bbase, rep.Baseline)
	}
}

// interrupted marks the report partial and aggregates what was measured.
func (rep *Report) interrupted(where string) *Report {
	if !rep.Partial {
		rep.Partial = true
		rep.Note = "interrupted " + where + "; only completed measurements are shown"
	}
	rep.aggregate()
	return rep
}

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error { return WriteJSON(w, rep) }

// WriteJSON writes a benchmark's report to w as indented JSON.
func WriteJSON(w io.Writer, report any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(report); err != nil {
		return fmt.Errorf("encode report: %w", err)
	}
	return nil
}

func fmtRatio(r *float64) string {
	if r == nil {
		return "-"
	}
	return fmt.Sprintf("%.2f×", *r)
}

func fmtMS(v float64) string {
	switch {
	case v == 0:
		return "-"
	case v < 10:
		return fmt.Sprintf("%.2fms", v)
	case v < 100:
		return fmt.Sprintf("%.1fms", v)
	}
	return fmt.Sprintf("%.0fms", v)
}

// cpuPerConn is cpu seconds per connection in µs, 0 without connections.
func cpuPerConn(cpu float64, conns int64) float64 {
	if conns == 0 {
		return 0
	}
	return cpu / float64(conns) * 1e6
}

// fmtUS formats a CPU time per connection in µs, "-" for none.
func fmtUS(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0fµs", v)
}

func fmtErrors(m map[string]int64) string {
	if len(m) == 0 {
		return "0 errors"
	}
	var parts []string
	for _, k := range reasonNames {
		if n := m[k]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", k, n))
		}
	}
	return strings.Join(parts, " ")
}

func fmtErrorsShort(m map[string]int64) string {
	if len(m) == 0 {
		return "0"
	}
	return fmtErrors(m)
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

func (s Settings) summary() string {
	return fmt.Sprintf("%d shoots, %s per measurement after %s warm-up, %d round(s)",
		s.Shoots, time.Duration(s.DurationSeconds*float64(time.Second)),
		time.Duration(s.WarmupSeconds*float64(time.Second)), s.Rounds)
}

func (rep *Report) rateTitle() string {
	path := ""
	if rep.Path != "" {
		path = rep.Path + ", "
	}
	return fmt.Sprintf("One connection: dial, %sfull TLS handshake with the SNI of a random shoot, "+
		"certificate verified for that host, 1-byte request, %d-byte answer read to EOF, close. "+
		"TTFB = dial start to first answer byte.", path, rep.Settings.PayloadBytes)
}

func (s Settings) bulkTitle() string {
	return fmt.Sprintf("%d connections, each reading %s answers back to back; "+
		"MB/s = 10^6 bytes per second, all connections together.", s.BulkConns, fmtBytes(s.BulkBytes))
}

const sharedCPUNote = "Client, upstream TLS servers and the data plane under test share this machine's CPUs; " +
	"absolute figures are bounded by that, compare the ratios. " +
	"\"others\" is the CPU (in cores) that other processes and hypervisor steal took during a measurement: " +
	"where it is above about 0.1 the row is disturbed; repeat with --rounds on a quiet machine."

// cpuPerConnNote says what the CPU/conn column counts.
const cpuPerConnNote = "CPU/conn: CPU time of the data plane's processes (their threads' run time in ns, /proc/PID/task/*/schedstat: HAProxy's process, " +
	"nginx's master and workers, tendril-ingress) during the window, divided by the connections counted in it; " +
	"direct has no data plane. CPU × baseline ≤ 1 means no more CPU per new connection than the baseline."

// fmtCPU formats a CPU figure in cores.
func fmtCPU(c float64) string { return fmt.Sprintf("%.2f", c) }

// WriteTable writes the report as plain-text tables.
func (rep *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "tendril-bench %s: %s\n", rep.Mode, rep.Settings.summary())
	b.WriteString(rep.MachineLine())
	fmt.Fprintf(&b, "load average before/after: %s / %s\n", rep.LoadBefore, rep.LoadAfter)
	fmt.Fprintf(&b, "tls: %s\n", rep.Settings.TLS)
	fmt.Fprintf(&b, "note: %s\n", sharedCPUNote)
	for _, n := range rep.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	if rep.Partial {
		fmt.Fprintf(&b, "PARTIAL: %s\n", rep.Note)
	}
	b.WriteString("targets:\n")
	for _, t := range rep.Targets {
		if t.Skipped != "" {
			fmt.Fprintf(&b, "  %-8s skipped: %s\n", t.Name, t.Skipped)
		} else {
			fmt.Fprintf(&b, "  %-8s %s\n", t.Name, t.Version)
		}
	}
	if len(rep.Rate) > 0 {
		fmt.Fprintf(&b, "\nNew TLS connections per second. %s\n", rep.rateTitle())
		t := rep.rateTable()
		t.Write(&b)
		fmt.Fprintf(&b, "%s\n", cpuPerConnNote)
	}
	if len(rep.Bulk) > 0 {
		fmt.Fprintf(&b, "\nBulk throughput: %s\n", rep.Settings.bulkTitle())
		t := rep.bulkTable()
		t.Write(&b)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteMarkdown writes the report as a Markdown document: machine, command
// line, settings, targets with versions, the tables with ratios, upstream
// counters and the peers' configurations.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	rep.WriteMarkdownHead(&b, rep.Mode, rep.Note, "client and upstreams")
	fmt.Fprintf(&b, "- Settings: %s; peers' timeouts %s; elapsed %.0fs\n", rep.Settings.summary(), rep.Settings.PeerTimeouts, rep.ElapsedSeconds)
	fmt.Fprintf(&b, "- TLS: %s\n", rep.Settings.TLS)
	fmt.Fprintf(&b, "- Load average (1/5/15 min) before / after the run: %s / %s\n", rep.LoadBefore, rep.LoadAfter)
	fmt.Fprintf(&b, "\n%s Targets are measured one after another in one process run, never at the same time, "+
		"with the same client code and the same upstreams; they take turns per measurement.\n", sharedCPUNote)
	for _, n := range rep.Notes {
		fmt.Fprintf(&b, "\n%s\n", n)
	}

	b.WriteString("\n## Targets\n\n| target | version | status |\n|---|---|---|\n")
	for _, t := range rep.Targets {
		status := "measured"
		if t.Skipped != "" {
			status = "skipped: " + MDEscape(t.Skipped)
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", t.Name, MDEscape(t.Version), status)
	}
	if len(rep.Rate) > 0 {
		fmt.Fprintf(&b, "\n## New TLS connections per second\n\n%s\n\n", rep.rateTitle())
		t := rep.rateTable()
		t.WriteMarkdown(&b)
		fmt.Fprintf(&b, "\n%s\n", cpuPerConnNote)
	}
	if len(rep.Bulk) > 0 {
		fmt.Fprintf(&b, "\n## Bulk throughput\n\n%s\n\n", rep.Settings.bulkTitle())
		t := rep.bulkTable()
		t.WriteMarkdown(&b)
	}
	if len(rep.Upstreams) > 0 {
		b.WriteString("\n## Upstreams\n\nRequests each upstream answered over the whole run (warm-ups and readiness probes included). " +
			"An upstream refuses a ClientHello for another shoot's host (misrouted). Failed includes the connections " +
			"the client aborts when a measurement ends.\n\n")
		b.WriteString("| shoot | host | small | bulk | misrouted | failed |\n|---|---|---:|---:|---:|---:|\n")
		for _, u := range rep.Upstreams {
			fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d |\n", u.Shoot, u.Host, u.Small, u.Bulk, u.Misrouted, u.Failed)
		}
	}
	var cfgs []PeerConfig
	for _, t := range rep.Targets {
		cfgs = append(cfgs, PeerConfig{Name: t.Name, Config: t.Config})
	}
	WritePeerConfigs(&b, "Peer configurations", cfgs)
	_, err := io.WriteString(w, b.String())
	return err
}

// rateTable is the connection-rate table of both the text and the Markdown report: rows by
// concurrency, an empty line (text only) between concurrencies.
func (rep *Report) rateTable() Table {
	t := Table{Header: []string{"concurrency", "target", "conn/s", "× direct", "× " + rep.Baseline, "TTFB p50", "TTFB p90", "TTFB p99",
		"CPU/conn", "CPU × " + rep.Baseline, "others", "errors"},
		Left: []bool{false, true, false, false, false, false, false, false, false, false, false, true}}
	last := 0
	for _, r := range rep.Rate {
		if last != 0 && r.Concurrency != last {
			t.Rows = append(t.Rows, nil)
		}
		last = r.Concurrency
		t.Rows = append(t.Rows, []string{strconv.Itoa(r.Concurrency), r.Target, fmt.Sprintf("%.0f", r.ConnsPerSec),
			fmtRatio(r.VsDirect), fmtRatio(r.VsBaseline), fmtMS(r.TTFB.P50), fmtMS(r.TTFB.P90), fmtMS(r.TTFB.P99),
			fmtUS(r.CPUPerConn), fmtRatio(r.CPUVsBaseline), fmtCPU(r.OtherCPU), fmtErrorsShort(r.Errors)})
	}
	return t
}

// bulkTable is the bulk-throughput table of both reports.
func (rep *Report) bulkTable() Table {
	t := Table{Header: []string{"target", "MB/s", "× direct", "× " + rep.Baseline, "transfers", "others", "errors"},
		Left: []bool{true, false, false, false, false, false, true}}
	for _, r := range rep.Bulk {
		t.Rows = append(t.Rows, []string{r.Target, fmt.Sprintf("%.0f", r.MBps), fmtRatio(r.VsDirect),
			fmtRatio(r.VsBaseline), strconv.FormatInt(r.Transfers, 10), fmtCPU(r.OtherCPU), fmtErrorsShort(r.Errors)})
	}
	return t
}

// PeerConfig is one peer's configuration file as a report shows it.
type PeerConfig struct{ Name, Config string }

// WritePeerConfigs writes the Markdown section title with each non-empty configuration in a
// collapsed block; nothing if none has one.
func WritePeerConfigs(b *strings.Builder, title string, cfgs []PeerConfig) {
	var shown []PeerConfig
	for _, c := range cfgs {
		if c.Config != "" {
			shown = append(shown, c)
		}
	}
	if len(shown) == 0 {
		return
	}
	fmt.Fprintf(b, "\n## %s\n", title)
	for _, c := range shown {
		fmt.Fprintf(b, "\n<details><summary>%s</summary>\n\n```\n%s\n```\n\n</details>\n", c.Name, strings.TrimRight(c.Config, "\n"))
	}
}

// MDEscape makes s fit in a Markdown table cell: a "|" escaped, line breaks
// as spaces.
func MDEscape(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}

// Table is a report table: a header, which columns are text (left-aligned)
// rather than figures (right-aligned), and rows. Write renders it as plain
// text, WriteMarkdown as a Markdown table; the tunnel mode's report uses it
// too.
type Table struct {
	Header []string
	Left   []bool
	// Rows are the cells; a nil row is an empty line in plain text and
	// left out in Markdown.
	Rows [][]string
}

// Write writes t as plain text: columns padded to their widest cell.
func (t *Table) Write(b *strings.Builder) {
	width := make([]int, len(t.Header))
	for _, r := range append([][]string{t.Header}, t.Rows...) {
		for i, c := range r {
			width[i] = max(width[i], utf8.RuneCountInString(c))
		}
	}
	line := func(r []string) {
		var l strings.Builder
		for i, c := range r {
			pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(c))
			if i > 0 {
				l.WriteString("  ")
			}
			if t.Left[i] {
				l.WriteString(c + pad)
			} else {
				l.WriteString(pad + c)
			}
		}
		b.WriteString(strings.TrimRight(l.String(), " ") + "\n")
	}
	line(t.Header)
	for _, r := range t.Rows {
		if r == nil {
			b.WriteString("\n")
			continue
		}
		line(r)
	}
}

// WriteMarkdown writes t as a Markdown table, its cells escaped (MDEscape).
func (t *Table) WriteMarkdown(b *strings.Builder) {
	b.WriteString("| " + strings.Join(t.Header, " | ") + " |\n|")
	for _, l := range t.Left {
		if l {
			b.WriteString("---|")
		} else {
			b.WriteString("---:|")
		}
	}
	b.WriteString("\n")
	for _, r := range t.Rows {
		if r == nil {
			continue
		}
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = MDEscape(c)
		}
		b.WriteString("| " + strings.Join(cells, " | ") + " |\n")
	}
}
