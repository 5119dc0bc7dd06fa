package failover

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/machine"
)

// Report is a run's result.
type Report struct {
	Machine        machine.Description `json:"machine"`
	Started        time.Time           `json:"started"`
	ElapsedSeconds float64             `json:"elapsed_seconds"`
	LoadBefore     string              `json:"load_before"`
	LoadAfter      string              `json:"load_after"`
	CommandLine    string              `json:"command_line,omitempty"`
	Repetitions    int                 `json:"repetitions"`
	Rows           []Row               `json:"rows"`
	// Partial: the run was interrupted or a kind failed; the rows hold what was measured.
	Partial bool `json:"partial,omitempty"`
}

// Row is one kind of failure on one stack.
type Row struct {
	Kind     string `json:"kind"`
	Stack    string `json:"stack"`
	Killed   string `json:"killed"`
	Recovers string `json:"recovers"`
	// Times are kill → end of the first successful dial started after it, one per repetition.
	Times []time.Duration `json:"times_ns"`
	// Held and Broken (the carrier kind): the connections held at the cuts, and those a cut
	// broke.
	Held   int `json:"held,omitempty"`
	Broken int `json:"broken,omitempty"`
	// Note is what else the kind checked, if anything.
	Note string `json:"note,omitempty"`
}

// P50 and Worst of the row's times (the upper median for an even count); 0 without any.
func (r Row) P50() time.Duration {
	s := r.sorted()
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func (r Row) Worst() time.Duration {
	s := r.sorted()
	if len(s) == 0 {
		return 0
	}
	return s[len(s)-1]
}

func (r Row) sorted() []time.Duration {
	s := slices.Clone(r.Times)
	slices.Sort(s)
	return s
}

// broken is "broken/held" for a row that held connections, else "-".
func (r Row) broken() string {
	if r.Held == 0 {
		return "-"
	}
	return fmt.Sprintf("%d/%d", r.Broken, r.Held)
}

func seconds(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// p50 and worst are the row's figures for a table: "-" without any.
func (r Row) p50() string {
	if len(r.Times) == 0 {
		return "-"
	}
	return seconds(r.P50())
}

func (r Row) worst() string {
	if len(r.Times) == 0 {
		return "-"
	}
	return seconds(r.Worst())
}

// WriteJSON writes the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error { return harness.WriteJSON(w, rep) }

// WriteTable writes the report as a plain-text table.
func (rep *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "Failover: kill → next successful dial (%d repetitions)\n", rep.Repetitions)
	t := harness.Table{Header: []string{"kind", "stack", "runs", "p50", "worst", "broken", "all"}, Left: []bool{true, true, false, false, false, false, true}}
	for _, r := range rep.Rows {
		t.Rows = append(t.Rows, []string{r.Kind, r.Stack, strconv.Itoa(len(r.Times)), r.p50(), r.worst(), r.broken(), all(r.sorted())})
	}
	t.Write(&b)
	for _, r := range rep.Rows {
		if r.Note != "" {
			fmt.Fprintf(&b, "%s: %s\n", r.Kind, r.Note)
		}
	}
	if rep.Partial {
		b.WriteString("(partial: the run was interrupted or failed)\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func all(ds []time.Duration) string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = fmt.Sprintf("%.2f", d.Seconds())
	}
	return strings.Join(out, " ")
}

// WriteMarkdown writes the report as a Markdown section.
func (rep *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("## Failover (`tendril-bench failover`)\n\n")
	m := rep.Machine
	fmt.Fprintf(&b, "Machine: %s, %d cores (GOMAXPROCS %d), %s, %s %s. Started %s, took %.0f s; load average before %s, after %s.\n\n",
		m.CPUModel, m.Cores, m.GOMAXPROCS, m.Kernel, m.GoVersion, m.GOOSARCH,
		rep.Started.UTC().Format(time.RFC3339), rep.ElapsedSeconds, rep.LoadBefore, rep.LoadAfter)
	if rep.CommandLine != "" {
		fmt.Fprintf(&b, "```\n%s\n```\n\n", rep.CommandLine)
	}
	if rep.Partial {
		b.WriteString("**Partial**: the run was interrupted or failed.\n\n")
	}
	t := harness.Table{Header: []string{"killed", "stack", "recovers by", "runs", "p50", "worst", "held connections broken"}, Left: []bool{true, true, true, true, true, true, true}}
	for _, r := range rep.Rows {
		t.Rows = append(t.Rows, []string{r.Killed, r.Stack, r.Recovers, strconv.Itoa(len(r.Times)), r.p50(), r.worst(), r.broken()})
	}
	t.WriteMarkdown(&b)
	for _, r := range rep.Rows {
		if r.Note != "" {
			fmt.Fprintf(&b, "\n- %s: %s", r.Kind, r.Note)
		}
	}
	b.WriteString("\n\n" + strings.Join([]string{
		"Time from the SIGKILL to the end of the first dial, started after it, that got the pod's answer; a dial",
		"starts every 20 ms, each with a 3 s deadline. Processes are the real binaries in network namespaces on",
		"one machine (round trips of microseconds): the figures are the mechanisms' own, without a long path.",
		"The carrier rows are cuts, not kills: the figure is, per cut, the longest stall of a held connection that",
		"carried on (the gap between its last echo before the cut and its first after it; goal ≤ 1 s, none broken);",
		"a cut that broke them all has no figure.",
	}, "\n") + "\n")
	_, err := io.WriteString(w, b.String())
	return err
}
