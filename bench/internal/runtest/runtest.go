// Package runtest runs a mode of tendril-bench in miniature for the modes'
// tests: every installed target, two concurrency levels, a fraction of a
// second each, through the same code as a full run, and checks the report.
// It is imported by tests only.
package runtest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/internal/benchtest"
	"github.com/tendril-net/tendril/bench/peers"
)

// Shoots is the number of shoots of a mini run.
const Shoots = 4

// Mini runs mode against direct and every installed peer (tendril when the
// repository's bin/ has its binaries; the calling package is two levels
// below the repository root) and checks the report: every target that is not in skip started
// and measured without a single error, every shoot reached its own upstream
// through each, nothing was misrouted, HAProxy's configuration passes
// "haproxy -c", and the table, Markdown and JSON outputs name every target.
// A target in skip must have been skipped with a reason containing the given
// text. It returns the report.
func Mini(t *testing.T, mode harness.Mode, skip map[string]string) *harness.Report {
	t.Helper()
	benchtest.LeakCheck(t)
	binDir := benchtest.BinDir(t, 2)
	cfg := harness.Config{Shoots: Shoots, Concurrency: []int{1, 4}, Duration: 300 * time.Millisecond,
		BulkBytes: 1 << 20, BulkConns: 2, BinDir: binDir, Progress: benchtest.Log{T: t}}
	targets, missing := mode.Installed(context.Background(), cfg)
	for name, why := range missing {
		t.Logf("%s not measured: %s", name, why)
	}
	cfg.Targets = targets
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := harness.Run(ctx, mode, cfg)
	if err != nil {
		t.Fatal(err)
	}

	var measured []string
	for _, ti := range rep.Targets {
		want, expectSkip := skip[ti.Name]
		switch {
		case expectSkip && ti.Skipped == "":
			t.Errorf("target %s measured, want it skipped (%s)", ti.Name, want)
		case expectSkip && !strings.Contains(ti.Skipped, want):
			t.Errorf("target %s skipped because %s; want a reason containing %q", ti.Name, ti.Skipped, want)
		case !expectSkip && ti.Skipped != "":
			t.Errorf("target %s skipped: %s", ti.Name, ti.Skipped)
		case ti.Skipped == "":
			measured = append(measured, ti.Name)
		}
		if ti.Name == harness.TargetHAProxy && ti.Config != "" {
			checkHAProxyConfig(t, ti.Config)
		}
	}
	if want := len(measured) * 2; len(rep.RateRuns) != want {
		t.Errorf("%d rate runs, want %d", len(rep.RateRuns), want)
	}
	if len(rep.BulkRuns) != len(measured) {
		t.Errorf("%d bulk runs, want %d", len(rep.BulkRuns), len(measured))
	}
	// Every counted connection verified shoot i's certificate for its
	// host and got the answer only upstream i sends; Problems lists a
	// shoot that some target never reached, any error, any misroute.
	for _, p := range rep.Problems() {
		t.Error(p)
	}
	for _, r := range rep.RateRuns {
		if r.TTFB.P50 <= 0 || r.TTFB.P50 > r.TTFB.P99 {
			t.Errorf("%s c=%d: TTFB p50 %v p99 %v", r.Target, r.Concurrency, r.TTFB.P50, r.TTFB.P99)
		}
	}
	// The data plane's CPU per new connection is measured for every peer;
	// direct has no data plane and none.
	cpu := map[string]float64{}
	for _, r := range rep.Rate {
		cpu[r.Target] += r.CPUPerConn
	}
	for _, name := range measured {
		if (name == harness.TargetDirect) != (cpu[name] == 0) {
			t.Errorf("%s: CPU per connection %.0f µs over the rate rows", name, cpu[name])
		}
	}
	if len(rep.Upstreams) != Shoots {
		t.Errorf("%d upstream stats, want %d", len(rep.Upstreams), Shoots)
	}
	if len(rep.Rate) != len(measured)*2 || rep.Rate[0].VsDirect == nil || *rep.Rate[0].VsDirect != 1 {
		t.Errorf("rate rows: %+v", rep.Rate)
	}

	var tab, md, js bytes.Buffer
	if err := errors.Join(rep.WriteTable(&tab), rep.WriteMarkdown(&md), rep.WriteJSON(&js)); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", tab.String())
	for _, ti := range rep.Targets {
		for what, out := range map[string]string{"table": tab.String(), "markdown": md.String(), "json": js.String()} {
			if !strings.Contains(out, ti.Name) {
				t.Errorf("%s lacks target %s", what, ti.Name)
			}
		}
	}
	if !strings.Contains(md.String(), "# tendril-bench "+mode.Name+" — ") ||
		!strings.Contains(md.String(), "| concurrency | target | conn/s |") || !strings.Contains(md.String(), rep.Machine.CPUModel) {
		t.Errorf("markdown lacks the title, the rate table or the machine:\n%s", md.String())
	}
	return rep
}

// checkHAProxyConfig runs "haproxy -c" on a configuration a run used.
func checkHAProxyConfig(t *testing.T, cfg string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := (peers.HAProxy{}).CheckConfig(ctx, path); err != nil {
		t.Error(err)
	}
}
