package xdsbench

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
)

// Report is the result of Run.
type Report struct {
	harness.Header[Settings]
	Sizes []*SizeResult `json:"sizes"`
	// Goals compares the largest set size of at least GoalShoots with the
	// project's targets.
	Goals []Goal `json:"goals"`
}

// Settings are the run's parameters.
type Settings struct {
	Shoots         []int   `json:"shoots"`
	Replicas       int     `json:"replicas"`
	Changes        int     `json:"changes"`
	Warmup         int     `json:"warmup_changes"`
	TimeoutSeconds float64 `json:"timeout_seconds"`
	// Ingress is what ran the replicas.
	Ingress string `json:"ingress"`
}

// SizeResult is the measurement of one set size.
type SizeResult struct {
	Shoots    int `json:"shoots"`
	Resources int `json:"resources"`
	// BuildMS is the Apply of the full set from empty (translation, content
	// hashes, cache updates), with no client connected.
	BuildMS float64 `json:"build_ms"`
	// SyncMS is the time until every replica, connected after the build,
	// acknowledged every shoot; SyncBytesPerReplica what each was sent.
	SyncMS              float64 `json:"sync_ms"`
	SyncBytesPerReplica int64   `json:"sync_bytes_per_replica"`
	// Changes has a row per change kind and a last one, "all", over all.
	Changes []ChangeResult `json:"changes"`
	// ControlPlane is the control plane process; Ingress the largest of the
	// replicas (each value its own maximum). Loaded is after the initial
	// sync, After after the changes; Peak is VmHWM.
	ControlPlane Memories `json:"control_plane"`
	Ingress      Memories `json:"ingress"`
}

// Memories are a process's memory at two points of a run.
type Memories struct {
	Loaded memory `json:"loaded"`
	After  memory `json:"after_changes"`
}

// Peak is the larger VmHWM of the two readings.
func (m Memories) Peak() int64 { return max(m.Loaded.Peak, m.After.Peak) }

// ChangeResult summarises the changes of one kind.
type ChangeResult struct {
	Kind  string `json:"kind"`
	Count int    `json:"count"`
	// P50MS, P99MS and MaxMS are the time from just before Apply to the
	// acknowledgement of the change by every replica.
	P50MS float64 `json:"ack_p50_ms"`
	P99MS float64 `json:"ack_p99_ms"`
	MaxMS float64 `json:"ack_max_ms"`
	// ApplyP50MS and ApplyP99MS are the Apply call alone (the control
	// plane's share of the latency).
	ApplyP50MS float64 `json:"apply_p50_ms"`
	ApplyP99MS float64 `json:"apply_p99_ms"`
	// BytesPerReplica is the mean of what the server wrote per change and
	// replica on the wire (gRPC and HTTP/2 framing included, no TLS).
	BytesPerReplica    float64 `json:"bytes_per_replica"`
	MaxBytesPerReplica float64 `json:"max_bytes_per_replica"`
}

// All is the row over every kind, or nil.
func (s *SizeResult) All() *ChangeResult {
	for i := range s.Changes {
		if s.Changes[i].Kind == "all" {
			return &s.Changes[i]
		}
	}
	return nil
}

// Goal is one of the targets against what was measured.
type Goal struct {
	Name     string `json:"name"`
	Target   string `json:"target"`
	Measured string `json:"measured"`
	Met      bool   `json:"met"`
	// Miss says by how much a missed target was missed.
	Miss string `json:"miss,omitempty"`
}

// The targets at GoalShoots shoots (issue 8).
const (
	GoalShoots  = 10000
	GoalP99MS   = 100.0
	GoalBytes   = 10 << 10
	GoalCPBytes = 256 << 20
)

func (rep *Report) finish(partial bool) {
	rep.Partial = partial
	rep.End()
	rep.Goals = nil
	var at *SizeResult
	for _, s := range rep.Sizes {
		if s.Shoots >= GoalShoots && s.All() != nil && (at == nil || s.Shoots > at.Shoots) {
			at = s
		}
	}
	if at == nil {
		rep.Goals = append(rep.Goals, Goal{Name: "all", Target: fmt.Sprintf("measured at %d shoots", GoalShoots), Measured: "no complete run at that size"})
		return
	}
	all := at.All()
	worstBytes := 0.0
	for _, c := range at.Changes {
		worstBytes = max(worstBytes, c.BytesPerReplica)
	}
	p99Name := fmt.Sprintf("change → ACK of every replica p99 at %d shoots", at.Shoots)
	rep.Goals = append(rep.Goals,
		goal(p99Name, fmt.Sprintf("≤ %.0f ms", GoalP99MS), all.P99MS, GoalP99MS, fmt.Sprintf("%.1f ms", all.P99MS), func(d float64) string { return fmt.Sprintf("%.1f ms", d) }),
		goal(fmt.Sprintf("bytes per change and replica at %d shoots (mean of the worst kind)", at.Shoots), "≤ "+FormatBytes(GoalBytes),
			worstBytes, GoalBytes, FormatBytes(int64(worstBytes)), func(d float64) string { return FormatBytes(int64(d)) }),
		goal(fmt.Sprintf("control plane peak RSS at %d shoots", at.Shoots), "≤ "+FormatBytes(GoalCPBytes),
			float64(at.ControlPlane.Peak()), GoalCPBytes, FormatBytes(at.ControlPlane.Peak()), func(d float64) string { return FormatBytes(int64(d)) }),
	)
}

func goal(name, target string, v, limit float64, measured string, format func(float64) string) Goal {
	g := Goal{Name: name, Target: target, Measured: measured, Met: v <= limit}
	if !g.Met {
		g.Miss = fmt.Sprintf("%s over (%.2f×)", format(v-limit), v/limit)
	}
	return g
}

// FormatBytes prints n in B, KiB or MiB.
func FormatBytes(n int64) string {
	switch {
	case n >= 10<<20:
		return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 10<<10:
		return fmt.Sprintf("%.0f KiB", float64(n)/(1<<10))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return strconv.FormatInt(n, 10) + " B"
}

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error { return harness.WriteJSON(w, rep) }

func f1(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// tables are the report's tables: changes, then per set size.
func (rep *Report) tables() (changes, sizes, goals harness.Table) {
	changes = harness.Table{
		Header: []string{"shoots", "change", "n", "ACK p50 ms", "ACK p99 ms", "max ms", "Apply p50 ms", "Apply p99 ms", "bytes/replica", "max bytes"},
		Left:   []bool{false, true, false, false, false, false, false, false, false, false},
	}
	sizes = harness.Table{
		Header: []string{"shoots", "resources", "build ms", "initial sync ms", "sync bytes/replica", "control plane RSS", "peak", "Go heap", "ingress RSS", "peak"},
		Left:   make([]bool, 10),
	}
	for i, s := range rep.Sizes {
		if i > 0 && len(s.Changes) > 0 {
			changes.Rows = append(changes.Rows, nil)
		}
		for _, c := range s.Changes {
			changes.Rows = append(changes.Rows, []string{strconv.Itoa(s.Shoots), c.Kind, strconv.Itoa(c.Count),
				f1(c.P50MS), f1(c.P99MS), f1(c.MaxMS), f1(c.ApplyP50MS), f1(c.ApplyP99MS),
				FormatBytes(int64(c.BytesPerReplica)), FormatBytes(int64(c.MaxBytesPerReplica))})
		}
		cp, in := s.ControlPlane, s.Ingress
		sizes.Rows = append(sizes.Rows, []string{strconv.Itoa(s.Shoots), strconv.Itoa(s.Resources), f1(s.BuildMS), f1(s.SyncMS),
			FormatBytes(s.SyncBytesPerReplica), FormatBytes(max(cp.Loaded.RSS, cp.After.RSS)), FormatBytes(cp.Peak()),
			FormatBytes(max(cp.Loaded.HeapInuse, cp.After.HeapInuse)), FormatBytes(max(in.Loaded.RSS, in.After.RSS)), FormatBytes(in.Peak())})
	}
	goals = harness.Table{Header: []string{"target", "goal", "measured", "met", "missed by"}, Left: []bool{true, true, false, true, false}}
	for _, g := range rep.Goals {
		met := "yes"
		if !g.Met {
			met = "NO"
		}
		if g.Target == "" || strings.HasPrefix(g.Measured, "no ") {
			met = "-"
		}
		goals.Rows = append(goals.Rows, []string{g.Name, g.Target, g.Measured, met, g.Miss})
	}
	return changes, sizes, goals
}

func (rep *Report) title() string {
	s := rep.Settings
	return fmt.Sprintf("xDS at scale: %d ingress replicas (%s), %d measured changes per size after %d warm-up",
		s.Replicas, s.Ingress, s.Changes, s.Warmup)
}

// WriteTable writes the report as plain-text tables.
func (rep *Report) WriteTable(w io.Writer) error {
	changes, sizes, goals := rep.tables()
	var b strings.Builder
	b.WriteString(rep.title() + "\n")
	if rep.Partial {
		b.WriteString("PARTIAL: the run was interrupted or failed\n")
	}
	b.WriteString("\nSingle-shoot changes: Apply → ACK of every replica\n")
	changes.Write(&b)
	b.WriteString("\nSet sizes: full build, initial sync, memory\n")
	sizes.Write(&b)
	b.WriteString("\nTargets\n")
	goals.Write(&b)
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteMarkdown writes the report as a Markdown document.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	changes, sizes, goals := rep.tables()
	var b strings.Builder
	b.WriteString("## xDS at scale (`tendril-bench xds`)\n\n")
	m := rep.Machine
	fmt.Fprintf(&b, "%s. Machine: %s, %d cores (GOMAXPROCS %d), %s, %s %s. Started %s, took %.0f s; load average before %s, after %s.\n\n",
		rep.title(), m.CPUModel, m.Cores, m.GOMAXPROCS, m.Kernel, m.GoVersion, m.GOOSARCH,
		rep.Started.UTC().Format(time.RFC3339), rep.ElapsedSeconds, rep.LoadBefore, rep.LoadAfter)
	if rep.CommandLine != "" {
		fmt.Fprintf(&b, "```\n%s\n```\n\n", rep.CommandLine)
	}
	if rep.Partial {
		b.WriteString("**Partial**: the run was interrupted or failed.\n\n")
	}
	b.WriteString("### Single-shoot changes: Apply → ACK of every replica\n\n")
	changes.WriteMarkdown(&b)
	b.WriteString("\n" + strings.Join([]string{
		"ACK: from just before the control plane's Apply of the whole set (one shoot changed) until every replica",
		"acknowledged it, from the server's acknowledgement tracking (ShootStatus Programmed on every replica;",
		"for a removal, the server's count of delta ACKs of a response of every type the shoot had). Apply: the",
		"Apply call alone. bytes/replica: what the server wrote on its connections per change, divided by the",
		"replicas (gRPC and HTTP/2 framing included; plaintext loopback, so no TLS overhead).",
	}, "\n") + "\n\n")
	b.WriteString("### Set sizes: full build, initial sync, memory\n\n")
	sizes.WriteMarkdown(&b)
	b.WriteString("\n" + strings.Join([]string{
		"build: Apply of the full set into an empty server, before any replica connects. initial sync: the",
		"replicas connect after the build; time until every shoot is programmed on all of them. The control",
		"plane is a process of its own (RSS and peak VmHWM of that process alone; Go heap in use beside it);",
		"ingress: the largest replica. Memory read after the initial sync and after the changes; the larger shown.",
	}, "\n") + "\n\n")
	b.WriteString("### Targets\n\n")
	goals.WriteMarkdown(&b)
	_, err := io.WriteString(w, b.String())
	return err
}
