package idle

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/internal/benchtest"
	"github.com/tendril-net/tendril/bench/sni"
)

// installed returns the idle targets that can run here (tendril when the
// repository's bin/ has its binaries).
func installed(t *testing.T, binDir string) []string {
	t.Helper()
	have, missing := sni.Mode.Installed(context.Background(), harness.Config{BinDir: binDir})
	for name, why := range missing {
		t.Logf("%s not measured: %s", name, why)
	}
	var ts []string
	for _, name := range Targets {
		if slices.Contains(have, name) {
			ts = append(ts, name)
		}
	}
	if len(ts) == 0 {
		t.Skip("no idle target installed")
	}
	return ts
}

// TestRunSmall holds a few connections through every installed target on
// both listeners, through the same code as a full run, and checks the
// figures: all held and alive after the hold, at least two descriptors per
// proxied connection (its two sockets), goroutines for tendril only, and
// HAProxy's descriptors back once the connections close.
func TestRunSmall(t *testing.T) {
	benchtest.LeakCheck(t)
	binDir := benchtest.BinDir(t, 2)
	const n = 60
	cfg := Config{Conns: n, Targets: installed(t, binDir), Hold: 300 * time.Millisecond, Release: 3 * time.Second,
		BinDir: binDir, Progress: benchtest.Log{T: t}}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if want := len(cfg.Targets) * len(Listeners); len(rep.Results) != want {
		t.Fatalf("%d results, want %d", len(rep.Results), want)
	}
	for _, r := range rep.Results {
		name := r.Listener + " " + r.Target
		if r.Skipped != "" {
			t.Errorf("%s skipped: %s", name, r.Skipped)
			continue
		}
		if r.Held != n || r.Survivors != n || len(r.OpenFailures) > 0 || len(r.PingFailures) > 0 {
			t.Errorf("%s: held %d, %d survived, open failures %v, ping failures %v (%v); want all %d",
				name, r.Held, r.Survivors, r.OpenFailures, r.PingFailures, r.PingFailureSamples, n)
		}
		if r.FDsPerConn < 1.9 || r.Processes < 1 || r.BaselineRSS <= 0 || r.HeldRSS <= 0 {
			t.Errorf("%s: %.2f fds per connection over %d processes, RSS %d → %d: want ≥ 2 fds (a socket each side)",
				name, r.FDsPerConn, r.Processes, r.BaselineRSS, r.HeldRSS)
		}
		goroutines := r.BaselineGoroutines > 0 && r.HeldGoroutines > 0
		if goroutines != (r.Target == harness.TargetTendril) {
			t.Errorf("%s: goroutines %d → %d (%s); want a count for tendril only", name, r.BaselineGoroutines, r.HeldGoroutines, r.GoroutineNote)
		}
		if r.Target == harness.TargetHAProxy && r.ReleaseFDsSeconds < 0 {
			t.Errorf("%s: descriptors not back within the window: %d, baseline %d", name, r.ReleasedFDs, r.BaselineFDs)
		}
	}
	var held int64
	for _, u := range rep.Upstreams {
		held += u.Held
		if u.Misrouted > 0 {
			t.Errorf("upstream %s: %d misrouted", u.Shoot, u.Misrouted)
		}
	}
	if want := int64(n * len(rep.Results)); held != want {
		t.Errorf("upstreams held %d connections in echo mode, want %d", held, want)
	}

	var tab, md, js bytes.Buffer
	if err := errors.Join(rep.WriteTable(&tab), rep.WriteMarkdown(&md), rep.WriteJSON(&js)); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", tab.String())
	for _, name := range cfg.Targets {
		for what, out := range map[string]string{"table": tab.String(), "markdown": md.String(), "json": js.String()} {
			if !strings.Contains(out, name) {
				t.Errorf("%s lacks target %s", what, name)
			}
		}
	}
	if !strings.Contains(md.String(), "# tendril-bench idle — ") || !strings.Contains(md.String(), "| target | held / N |") {
		t.Errorf("markdown lacks the title or the table:\n%s", md.String())
	}
}

// TestStopsAtPeerLimit: a data plane that holds fewer connections than asked
// (here HAProxy with maxconn 20; tendril-ingress out of descriptors in a full
// run) ends the opening after MaxFailures failures, and the report has the
// connections it did hold, all alive.
func TestStopsAtPeerLimit(t *testing.T) {
	benchtest.LeakCheck(t)
	binDir := benchtest.BinDir(t, 2)
	if !slices.Contains(installed(t, binDir), harness.TargetHAProxy) {
		t.Skip("no haproxy")
	}
	const limit = 20
	cfg := Config{Conns: 2 * limit, Listeners: []string{ListenerSNI}, Targets: []string{harness.TargetHAProxy},
		Hold: 100 * time.Millisecond, Release: 5 * time.Second, OpenTimeout: time.Second, MaxFailures: 4, Parallel: 4,
		PeerMaxConn: limit, BinDir: binDir, Progress: benchtest.Log{T: t}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := rep.Results[0]
	var failed int64
	for _, n := range r.OpenFailures {
		failed += n
	}
	if r.Held != limit || r.Survivors != limit || failed < int64(cfg.MaxFailures) || failed >= int64(cfg.MaxFailures+cfg.Parallel) {
		t.Errorf("held %d, %d survived, %d failed (%v); want %d held and alive, %d..%d failed",
			r.Held, r.Survivors, failed, r.OpenFailureSamples, limit, cfg.MaxFailures, cfg.MaxFailures+cfg.Parallel-1)
	}
	var tab bytes.Buffer
	if err := rep.WriteTable(&tab); err != nil {
		t.Fatal(err)
	}
	if want := "haproxy held 20 of 40 connections"; !strings.Contains(tab.String(), want) {
		t.Errorf("table lacks %q:\n%s", want, tab.String())
	}
}

// TestDefaultConns: N fits the benchmark's and a 2-descriptor peer's limit.
func TestDefaultConns(t *testing.T) {
	for limit, want := range map[uint64]int{20_000: 9_800, 1024: 300, 500: 100, 1 << 40: maxDefaultConns} {
		n := DefaultConns(limit)
		if n != want {
			t.Errorf("DefaultConns(%d) = %d, want %d", limit, n, want)
		}
		if limit >= 1024 && limit < 1<<20 {
			h, ng := peerConns(limit)
			if 2*uint64(n)+benchReserve > limit || 2*uint64(h)+peerReserve > limit || uint64(ng) > limit || h < n || ng < 2*n {
				t.Errorf("limit %d: N %d, haproxy maxconn %d, nginx worker_connections %d do not fit", limit, n, h, ng)
			}
		}
	}
}

func TestWithin(t *testing.T) {
	for _, c := range []struct {
		v, base int64
		want    bool
	}{{12, 10, false}, {11, 10, true}, {13, 12, true}, {14, 12, false}, {110 << 20, 100 << 20, true}, {111 << 20, 100 << 20, false}, {5, 10, true}} {
		if got := within(c.v, c.base); got != c.want {
			t.Errorf("within(%d, %d) = %v, want %v", c.v, c.base, got, c.want)
		}
	}
}

func TestParseCount(t *testing.T) {
	metrics := "# HELP go_goroutines Number of goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines 20077\ngo_threads 9\n"
	if n, err := parseCount(strings.NewReader(metrics), "go_goroutines "); err != nil || n != 20077 {
		t.Errorf("go_goroutines: %d, %v", n, err)
	}
	if n, err := parseCount(strings.NewReader("goroutine profile: total 42\n3 @ 0x1\n"), "goroutine profile: total "); err != nil || n != 42 {
		t.Errorf("profile: %d, %v", n, err)
	}
	if _, err := parseCount(strings.NewReader("go_threads 9\n"), "go_goroutines "); err == nil {
		t.Error("no error without the line")
	}
}

func TestConfigValidate(t *testing.T) {
	c := Config{Listeners: []string{"sni", "sni"}, Targets: []string{"direct"}}
	c.setDefaults(20_000)
	err := c.validate()
	if err == nil || !strings.Contains(err.Error(), `listener "sni"`) || !strings.Contains(err.Error(), `target "direct"`) {
		t.Errorf("validate = %v", err)
	}
	c = Config{}
	c.setDefaults(20_000)
	if err := c.validate(); err != nil || c.Conns != 9_800 {
		t.Errorf("defaults: N %d, %v", c.Conns, err)
	}
}
