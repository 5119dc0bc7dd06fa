package idle

import (
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/tendril-net/tendril/bench/harness"
)

// Report is the result of Run: one Result per listener and target.
type Report struct {
	harness.Header[Settings]
	// Note says where a partial run was interrupted.
	Note      string                  `json:"note,omitempty"`
	Results   []*Result               `json:"results"`
	Upstreams []harness.UpstreamStats `json:"upstreams"`
}

// Settings are the parameters of the run.
type Settings struct {
	Conns              int      `json:"conns"`
	Listeners          []string `json:"listeners"`
	Targets            []string `json:"targets"`
	HoldSeconds        float64  `json:"hold_seconds"`
	ReleaseSeconds     float64  `json:"release_window_seconds"`
	OpenTimeoutSeconds float64  `json:"open_timeout_seconds"`
	MaxFailures        int      `json:"max_failures"`
	Parallel           int      `json:"parallel"`
	Shoots             int      `json:"shoots"`
	// FDSoft and FDHard are RLIMIT_NOFILE of the benchmark and its peers
	// (the soft limit raised to the hard one).
	FDSoft uint64 `json:"fd_soft_limit"`
	FDHard uint64 `json:"fd_hard_limit"`
	// Kernel are the kernel settings that bound how many connections one
	// machine holds.
	Kernel map[string]string `json:"kernel"`
	TLS    string            `json:"tls"`
}

// Result is one target's figures on one listener.
type Result struct {
	Listener string `json:"listener"`
	Target   string `json:"target"`
	Version  string `json:"version,omitempty"`
	Skipped  string `json:"skipped,omitempty"`
	Config   string `json:"config,omitempty"` // the peer's rendered configuration

	Asked int `json:"asked"` // N
	// Held is the number of connections open end to end at once: N, or
	// fewer when opening stopped after MaxFailures failures.
	Held               int               `json:"held"`
	OpenSeconds        float64           `json:"open_seconds"`
	OpenFailures       map[string]int64  `json:"open_failures,omitempty"`
	OpenFailureSamples map[string]string `json:"open_failure_samples,omitempty"`

	// Processes is the number of data-plane processes summed over
	// (nginx: master and workers).
	Processes   int   `json:"processes"`
	BaselineRSS int64 `json:"baseline_rss_bytes"`
	HeldRSS     int64 `json:"held_rss_bytes"`
	BaselineFDs int   `json:"baseline_fds"`
	HeldFDs     int   `json:"held_fds"`
	// RSSPerConnKiB and FDsPerConn are (held − baseline) / Held.
	RSSPerConnKiB float64 `json:"rss_per_conn_kib"`
	FDsPerConn    float64 `json:"fds_per_conn"`
	// Goroutines of a Go data plane (tendril-ingress); -1 when not one
	// or not known (GoroutineNote says why).
	BaselineGoroutines int     `json:"baseline_goroutines"`
	HeldGoroutines     int     `json:"held_goroutines"`
	GoroutinesPerConn  float64 `json:"goroutines_per_conn,omitempty"`
	GoroutineNote      string  `json:"goroutine_note,omitempty"`

	// Survivors answered a ping through after HoldSeconds idle.
	HoldSeconds        float64           `json:"hold_seconds"`
	Survivors          int               `json:"survivors"`
	PingFailures       map[string]int64  `json:"ping_failures,omitempty"`
	PingFailureSamples map[string]string `json:"ping_failure_samples,omitempty"`

	// ReleaseRSSSeconds and ReleaseFDsSeconds are the times after the
	// connections closed until RSS and descriptors were within 10% of the
	// baseline, -1 when not within the release window; ReleasedRSS and
	// ReleasedFDs the last sample.
	ReleaseRSSSeconds float64 `json:"release_rss_seconds"`
	ReleaseFDsSeconds float64 `json:"release_fds_seconds"`
	ReleasedRSS       int64   `json:"released_rss_bytes"`
	ReleasedFDs       int     `json:"released_fds"`
}

// perConn computes the per-connection figures from the samples.
func (r *Result) perConn() {
	if r.Held == 0 {
		return
	}
	n := float64(r.Held)
	r.RSSPerConnKiB = float64(r.HeldRSS-r.BaselineRSS) / 1024 / n
	r.FDsPerConn = float64(r.HeldFDs-r.BaselineFDs) / n
	if r.BaselineGoroutines >= 0 && r.HeldGoroutines >= 0 {
		r.GoroutinesPerConn = float64(r.HeldGoroutines-r.BaselineGoroutines) / n
	}
}

func (r *Result) countOpenFailure(err error) {
	r.OpenFailures, r.OpenFailureSamples = count(r.OpenFailures, r.OpenFailureSamples, err)
}

// count adds err to a count by reason, keeping the first error of each.
func count(counts map[string]int64, samples map[string]string, err error) (map[string]int64, map[string]string) {
	if counts == nil {
		counts, samples = map[string]int64{}, map[string]string{}
	}
	k := harness.FailureReason(err)
	counts[k]++
	if _, ok := samples[k]; !ok {
		samples[k] = err.Error()
	}
	return counts, samples
}

// kernelSettings reads the settings that bound the connections of one
// machine: the system-wide descriptor limits, the accept backlog and the
// client's ephemeral ports (per destination address and port).
func kernelSettings() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"fs.file-max", "fs.nr_open", "net.core.somaxconn", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_max_syn_backlog"} {
		b, err := os.ReadFile("/proc/sys/" + strings.ReplaceAll(k, ".", "/"))
		if err != nil {
			continue
		}
		m[k] = strings.Join(strings.Fields(string(b)), " ")
	}
	return m
}

// Goals of issue 21 for an idle connection, shown beside the figures.
const (
	goalFDs    = 2
	goalKiB    = 4
	goalWithin = "within 10% of the baseline within 30 s"
)

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error { return harness.WriteJSON(w, rep) }

func (rep *Report) summary() string {
	s := rep.Settings
	return fmt.Sprintf("N = %d connections per target, held %v idle, then pinged; release sampled for %v; "+
		"%d shoots; RLIMIT_NOFILE %d (soft, raised to the hard limit %d) for the benchmark and every peer",
		s.Conns, secs(s.HoldSeconds), secs(s.ReleaseSeconds), s.Shoots, s.FDSoft, s.FDHard)
}

func secs(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) + "s" }

// method says how the figures are taken, for both output formats.
func (rep *Report) method() []string {
	k := rep.Settings.Kernel
	kernel := make([]string, 0, len(k))
	for _, name := range slices.Sorted(maps.Keys(k)) {
		kernel = append(kernel, name+" = "+k[name])
	}
	return []string{
		"Each connection: dial, the listener's preamble (proxy: a PROXY v2 header with the shoot's advertised " +
			"address:443), a full TLS handshake end to end with the shoot's upstream, verified for its host, one byte " +
			"echoed back, then idle. The connections are spread over the shoots in turn and opened " +
			strconv.Itoa(rep.Settings.Parallel) + " at a time; opening stops after " + strconv.Itoa(rep.Settings.MaxFailures) +
			" failures (a data plane out of descriptors), and the figures are for the connections then held.",
		"RSS: VmRSS of /proc/PID/status, fds: entries of /proc/PID/fd, summed over the data plane's processes " +
			"(HAProxy's process; nginx's master and workers; tendril-ingress, not tendril-seed). Baseline: the " +
			"target started, every route probed, 1 s later; with N: 1 s after the last connection opened. Per " +
			"connection: (with N − baseline) / held. Goroutines: tendril-ingress's go_goroutines.",
		"Survivors: connections that echo a ping through the data plane after the hold time. Release: the " +
			"client closes every connection; RSS and fds are sampled every 250 ms until each is within 10% of its " +
			"baseline, or the release window ends.",
		"Peers: the routes of the sni and proxy modes; HAProxy maxconn and nginx worker_connections sized to " +
			"the descriptor limit; every idle timeout 1 h, as tendril's. The benchmark holds the client's and the " +
			"upstream's end of each connection (2 descriptors each), so N = (hard limit − 400) / 2.",
		"Kernel: " + strings.Join(kernel, ", ") + ".",
		fmt.Sprintf("Goal (issue 21): ≤ %d fds and ≤ %d KiB per idle connection, all surviving, memory and fds back %s.",
			goalFDs, goalKiB, goalWithin),
	}
}

func fmtMiB(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func fmtCount(n int) string {
	if n < 0 {
		return "-"
	}
	return strconv.Itoa(n)
}

func fmtRelease(s, window float64) string {
	if s < 0 {
		return "not within " + secs(window)
	}
	return fmt.Sprintf("%.2f s", s)
}

func fmtFailures(m map[string]int64) string {
	if len(m) == 0 {
		return "0"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// table is the results of one listener.
func (rep *Report) table(listener string) *harness.Table {
	t := &harness.Table{
		Header: []string{"target", "held / N", "open failures", "RSS baseline", "RSS with held", "KiB/conn", "fds baseline",
			"fds with held", "fds/conn", "goroutines (base → held, per conn)", "survivors", "RSS back", "fds back"},
		Left: []bool{true, false, true, false, false, false, false, false, false, false, false, false, false},
	}
	for _, r := range rep.Results {
		if r.Listener != listener || r.Skipped != "" {
			continue
		}
		gor := "-"
		if r.BaselineGoroutines >= 0 && r.HeldGoroutines >= 0 {
			gor = fmt.Sprintf("%d → %d (%.2f)", r.BaselineGoroutines, r.HeldGoroutines, r.GoroutinesPerConn)
		}
		t.Rows = append(t.Rows, []string{r.Target, fmt.Sprintf("%d / %d", r.Held, r.Asked), fmtFailures(r.OpenFailures),
			fmtMiB(r.BaselineRSS), fmtMiB(r.HeldRSS), fmt.Sprintf("%.1f", r.RSSPerConnKiB), strconv.Itoa(r.BaselineFDs),
			strconv.Itoa(r.HeldFDs), fmt.Sprintf("%.2f", r.FDsPerConn), gor,
			fmt.Sprintf("%d / %d after %.0fs", r.Survivors, r.Held, r.HoldSeconds),
			fmtRelease(r.ReleaseRSSSeconds, rep.Settings.ReleaseSeconds), fmtRelease(r.ReleaseFDsSeconds, rep.Settings.ReleaseSeconds)})
	}
	return t
}

// notes are the per-result remarks: skipped targets, failures with their
// first errors, what is left after the release window, goroutine notes.
func (rep *Report) notes(listener string) []string {
	var out []string
	for _, r := range rep.Results {
		if r.Listener != listener {
			continue
		}
		if r.Skipped != "" {
			out = append(out, fmt.Sprintf("%s: skipped: %s", r.Target, r.Skipped))
			continue
		}
		if r.Held < r.Asked {
			out = append(out, fmt.Sprintf("%s held %d of %d connections: opening stopped after %s failed; first errors: %s",
				r.Target, r.Held, r.Asked, fmtFailures(r.OpenFailures), fmtSamples(r.OpenFailureSamples)))
		}
		if len(r.PingFailures) > 0 {
			out = append(out, fmt.Sprintf("%s: %s connections did not answer the ping; first errors: %s",
				r.Target, fmtFailures(r.PingFailures), fmtSamples(r.PingFailureSamples)))
		}
		out = append(out, fmt.Sprintf("%s: %d process(es); after close: RSS %s, %d fds (baseline %s, %d fds); opening took %.1f s",
			r.Target, r.Processes, fmtMiB(r.ReleasedRSS), r.ReleasedFDs, fmtMiB(r.BaselineRSS), r.BaselineFDs, r.OpenSeconds))
		if r.GoroutineNote != "" {
			out = append(out, fmt.Sprintf("%s: %s", r.Target, r.GoroutineNote))
		}
	}
	return out
}

func fmtSamples(m map[string]string) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		// The error names its reason already ("handshake: EOF").
		parts = append(parts, strings.TrimPrefix(m[k], k+": "))
	}
	return strings.Join(parts, "; ")
}

var listenerTitle = map[string]string{
	ListenerSNI:   "SNI listener (TLS passthrough by server name)",
	ListenerProxy: "Proxy listener (PROXY v2 header by destination, then TLS)",
}

// WriteTable writes the report as plain-text tables.
func (rep *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "tendril-bench idle: %s\n", rep.summary())
	b.WriteString(rep.MachineLine())
	fmt.Fprintf(&b, "load average before/after: %s / %s\n", rep.LoadBefore, rep.LoadAfter)
	fmt.Fprintf(&b, "tls: %s\n", rep.Settings.TLS)
	for _, m := range rep.method() {
		fmt.Fprintf(&b, "note: %s\n", m)
	}
	if rep.Partial {
		fmt.Fprintf(&b, "PARTIAL: %s\n", rep.Note)
	}
	for _, l := range rep.Settings.Listeners {
		fmt.Fprintf(&b, "\n%s\n", listenerTitle[l])
		rep.table(l).Write(&b)
		for _, n := range rep.notes(l) {
			fmt.Fprintf(&b, "  %s\n", n)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteMarkdown writes the report as a Markdown document.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	rep.WriteMarkdownHead(&b, "idle", rep.Note, "client and upstreams")
	fmt.Fprintf(&b, "- Settings: %s; elapsed %.0fs\n", rep.summary(), rep.ElapsedSeconds)
	fmt.Fprintf(&b, "- TLS: %s\n", rep.Settings.TLS)
	fmt.Fprintf(&b, "- Load average (1/5/15 min) before / after the run: %s / %s\n\n", rep.LoadBefore, rep.LoadAfter)
	for _, m := range rep.method() {
		fmt.Fprintf(&b, "%s\n\n", m)
	}
	b.WriteString("## Targets\n\n| listener | target | version | status |\n|---|---|---|---|\n")
	for _, r := range rep.Results {
		status := "measured"
		if r.Skipped != "" {
			status = "skipped: " + harness.MDEscape(r.Skipped)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", r.Listener, r.Target, harness.MDEscape(r.Version), status)
	}
	for _, l := range rep.Settings.Listeners {
		fmt.Fprintf(&b, "\n## %s\n\n", listenerTitle[l])
		rep.table(l).WriteMarkdown(&b)
		if ns := rep.notes(l); len(ns) > 0 {
			b.WriteString("\n")
			for _, n := range ns {
				fmt.Fprintf(&b, "- %s\n", harness.MDEscape(n))
			}
		}
	}
	if len(rep.Upstreams) > 0 {
		b.WriteString("\n## Upstreams\n\nConnections each upstream held in echo mode over the whole run, and readiness probes (small).\n\n")
		b.WriteString("| shoot | host | held | small | misrouted | failed |\n|---|---|---:|---:|---:|---:|\n")
		for _, u := range rep.Upstreams {
			fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d |\n", u.Shoot, u.Host, u.Held, u.Small, u.Misrouted, u.Failed)
		}
	}
	var cfgs []harness.PeerConfig
	for _, r := range rep.Results {
		cfgs = append(cfgs, harness.PeerConfig{Name: r.Target + ", " + r.Listener + " listener", Config: r.Config})
	}
	harness.WritePeerConfigs(&b, "Peer configurations", cfgs)
	_, err := io.WriteString(w, b.String())
	return err
}
