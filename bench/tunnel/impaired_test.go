package tunnel

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/internal/benchtest"
	"github.com/tendril-net/tendril/bench/internal/impair"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/cmd/tendril-bench/konnectivity"
)

func TestParseImpairments(t *testing.T) {
	got, err := ParseImpairments("0/0, 50ms/0.5,150ms/2%")
	if err != nil {
		t.Fatal(err)
	}
	want := []Impairment{{}, {RTT: 50 * time.Millisecond, Loss: 0.005}, {RTT: 150 * time.Millisecond, Loss: 0.02}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if g, _ := ParseImpairments("grid"); len(g) != 9 || g[0] != (Impairment{}) || g[8] != (Impairment{RTT: 150 * time.Millisecond, Loss: 0.02}) {
		t.Errorf("grid %+v", g)
	}
	for _, bad := range []string{"50ms", "x/1", "50ms/y", ""} {
		if _, err := ParseImpairments(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if err := (Impairment{Loss: 1.5}).validate(); err == nil {
		t.Error("a loss of 150 % validated")
	}
}

func TestGapMeter(t *testing.T) {
	g := newGapMeter()
	base := time.Now()
	g.read(base.Add(time.Hour)) // before the window: not a gap, only where the next starts
	g.arm()
	g.last = base // as if the last read was at base
	g.read(base.Add(30 * time.Millisecond))
	g.read(base.Add(130 * time.Millisecond)) // the longest: 100 ms
	g.read(base.Add(140 * time.Millisecond))
	if got := g.end(base.Add(190 * time.Millisecond)); got != 100*time.Millisecond {
		t.Errorf("longest gap %v, want 100ms", got)
	}
	// A gap still open at the window's end counts up to the end.
	g = newGapMeter()
	g.arm()
	g.last = base
	if got := g.end(base.Add(time.Second)); got != time.Second {
		t.Errorf("open gap %v, want 1s", got)
	}
}

func TestCellGoals(t *testing.T) {
	cell := func(imp Impairment, to, from, gap float64) CellResult {
		return CellResult{Impairment: imp.settings(), Bulk: []BulkResult{
			{Direction: ToShoot, Conns: 1, MBps: to}, {Direction: FromShoot, Conns: 1, MBps: from, LongestGapMS: gap}}}
	}
	lossy := Impairment{RTT: 50 * time.Millisecond, Loss: 0.02}
	rep := &Report{Targets: []*TargetResult{
		{Name: TargetTendrilConnect, Cells: []CellResult{cell(Impairment{}, 100, 100, 5), cell(lossy, 2, 1, 900)}},
		{Name: TargetOpenVPN, Cells: []CellResult{cell(Impairment{}, 50, 40, 10), cell(lossy, 1, 3, 60)}},
		{Name: TargetKonnectivityConnect, Cells: []CellResult{cell(Impairment{}, 120, 90, 8), cell(lossy, 1.5, 1, 1200)}},
	}}
	goals := map[string]Goal{}
	for _, g := range rep.cellGoals() {
		goals[g.Metric] = g
	}
	check := func(metric, versus string, met bool) {
		t.Helper()
		g, ok := goals[metric]
		if !ok {
			t.Errorf("no goal %q in %v", metric, goals)
			return
		}
		if g.Versus != versus || g.Met != met {
			t.Errorf("%s: versus %q met %v, want %q %v", metric, g.Versus, g.Met, versus, met)
		}
	}
	// The better peer per figure, the worst peer's gap.
	check("RTT 0 ms, loss 0 %: bulk to-shoot ×1", TargetKonnectivityConnect, false)
	check("RTT 0 ms, loss 0 %: bulk from-shoot ×1", TargetKonnectivityConnect, true)
	check("RTT 0 ms, loss 0 %: longest gap from-shoot (≤ openvpn's 10 ms)", "", true)
	check("RTT 50 ms, loss 2 %: bulk to-shoot ×1", TargetKonnectivityConnect, true)
	check("RTT 50 ms, loss 2 %: bulk from-shoot ×1", TargetOpenVPN, false)
	check("RTT 50 ms, loss 2 %: longest gap from-shoot (≤ konnectivity-connect's 1200 ms)", "", true)
	if len(goals) != 6 {
		t.Errorf("%d goals, want 6: %v", len(goals), goals)
	}
}

// TestRTTRose: a cell waits for the carriers' congestion control only when the shortest round
// trip grows.
func TestRTTRose(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		prev, next Impairment
		want       bool
	}{
		{Impairment{}, Impairment{RTT: 50 * ms}, true},
		{Impairment{RTT: 50 * ms}, Impairment{RTT: 150 * ms, Loss: 0.02}, true},
		{Impairment{RTT: 150 * ms}, Impairment{}, false},
		{Impairment{RTT: 50 * ms}, Impairment{RTT: 50 * ms, Loss: 0.005}, false},
		{Impairment{RTT: 50 * ms}, Impairment{RTT: 50 * ms, Jitter: 5 * ms}, false},          // shorter at best
		{Impairment{RTT: 50 * ms, Jitter: 10 * ms}, Impairment{RTT: 50 * ms}, true},          // 30 → 50 ms
		{Impairment{RTT: 50 * ms, Loss: 0.02}, Impairment{RTT: 50 * ms, Loss: 0.005}, false}, // loss only
	} {
		if got := rttRose(c.prev, c.next); got != c.want {
			t.Errorf("rttRose(%v, %v) = %v, want %v", c.prev.settings(), c.next.settings(), got, c.want)
		}
	}
}

// TestRunImpaired runs the tunnel mode in miniature with the carrier impaired in two cells:
// every tunnel target is measured in both, the lossy cell's carrier lost packets, direct
// (which does not cross the carrier) has no cells, and the report shows the grid.
func TestRunImpaired(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and TUN devices (run make test as root, as CI does)")
	}
	benchtest.LeakCheck(t)
	binDir := benchtest.BinDir(t, 2)
	targets := []string{TargetDirect, TargetTendrilConnect}
	if (peers.OpenVPN{}).Check(context.Background()) == nil {
		targets = append(targets, TargetOpenVPN)
	}
	if (peers.Konnectivity{}).Built() {
		targets = append(targets, TargetKonnectivityConnect)
	}
	// The lossy cell first: a cell whose round trip rises waits rttSettle (TestRTTRose).
	cells := []Impairment{{RTT: 20 * time.Millisecond, Loss: 0.01}, {}}
	cfg := Config{Targets: targets, Duration: 300 * time.Millisecond, Warmup: 50 * time.Millisecond,
		Conns: []int{1}, DialWorkers: []int{1}, UpRuns: 1, BinDir: binDir, NoBuild: true, Impairments: cells,
		Konnectivity: konnectivity.Dial, Progress: benchtest.Log{T: t}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Settings.Impairments) != 2 {
		t.Errorf("settings record %d impairments, want 2", len(rep.Settings.Impairments))
	}
	for _, tr := range rep.Targets {
		if tr.Skipped != "" {
			if tr.Name == TargetDirect || tr.Name == TargetTendrilConnect {
				t.Errorf("%s skipped: %s", tr.Name, tr.Skipped)
			}
			continue
		}
		if tr.Name == TargetDirect {
			if len(tr.Cells) != 0 || len(tr.Bulk) != 2 {
				t.Errorf("direct: %d cells, %d bulk results; want none (it does not cross the carrier) and 2", len(tr.Cells), len(tr.Bulk))
			}
			continue
		}
		if len(tr.Cells) != 2 {
			t.Fatalf("%s: %d cells, want 2", tr.Name, len(tr.Cells))
		}
		if !reflect.DeepEqual(tr.Bulk, tr.Cells[0].Bulk) {
			t.Errorf("%s: its own figures are not the first cell's", tr.Name)
		}
		for i, c := range tr.Cells {
			if c.Skipped != "" || len(c.Bulk) != 2 || len(c.Dial) != 1 || len(c.HOL) != 2 {
				t.Errorf("%s cell %d: %+v", tr.Name, i, c)
				continue
			}
			var lost uint64
			for dir, cc := range c.Carrier {
				if cc.Packets == 0 {
					t.Errorf("%s cell %d: the carrier carried no packet %s", tr.Name, i, dir)
				}
				lost += cc.Dropped[impair.ReasonLoss]
			}
			if (lost > 0) != (i == 0) {
				t.Errorf("%s cell %d (%s): the carrier lost %d packets", tr.Name, i, c.Impairment, lost)
			}
			if from := c.Bulk[1]; from.Direction != FromShoot || from.LongestGapMS <= 0 {
				t.Errorf("%s cell %d: from-shoot bulk %+v without a longest gap", tr.Name, i, from)
			}
			// tendril-server's and tendril-agent's inner stacks sent the transfers' segments
			// meanwhile; the peers have no inner TCP.
			tendril := tr.Name == TargetTendrilConnect
			for end, in := range map[string]*InnerTCP{"seed": c.InnerTCP, "shoot": c.ShootInnerTCP} {
				if tendril != (in != nil) || (tendril && in.SegmentsSent == 0) {
					t.Errorf("%s cell %d: %s inner TCP %+v", tr.Name, i, end, in)
				}
			}
		}
	}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "Loss and latency on the carrier") || !strings.Contains(md.String(), "RTT 20 ms, loss 1 %") {
		t.Errorf("markdown lacks the grid:\n%s", md.String())
	}
}

// TestInnerTCPCounters: the counters are read from tendril-server's metrics text; a server whose
// stack has none (the kernel's) reads as not there, and a cell without them shows a dash.
func TestInnerTCPCounters(t *testing.T) {
	const text = `# TYPE tendril_server_tunnel_stack_tcp_segments_total counter
tendril_server_tunnel_stack_tcp_segments_total{direction="received"} 7
tendril_server_tunnel_stack_tcp_segments_total{direction="sent"} 100
# TYPE tendril_server_tunnel_stack_tcp_retransmitted_segments_total counter
tendril_server_tunnel_stack_tcp_retransmitted_segments_total 9
# TYPE tendril_server_tunnel_stack_tcp_timeouts_total counter
tendril_server_tunnel_stack_tcp_timeouts_total 3
# TYPE tendril_server_tunnel_stack_tcp_spurious_timeouts_total counter
tendril_server_tunnel_stack_tcp_spurious_timeouts_total 1
`
	serve := func(body string) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, body) }))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	c, ok, err := innerTCPCounters(serve(text))(context.Background())
	if want := (InnerTCP{SegmentsSent: 100, Retransmits: 9, Timeouts: 3, SpuriousTimeouts: 1}); err != nil || !ok || c != want {
		t.Errorf("counters %+v, %v, %v; want %+v", c, ok, err, want)
	}
	if got := c.minus(InnerTCP{SegmentsSent: 40, Retransmits: 4, Timeouts: 1}); got != (InnerTCP{SegmentsSent: 60, Retransmits: 5, Timeouts: 2, SpuriousTimeouts: 1}) {
		t.Errorf("minus: %+v", got)
	}
	if got := (&c).String(); got != "3 (1 spurious)" {
		t.Errorf("String %q", got)
	}
	if got := (*InnerTCP)(nil).String(); got != "–" {
		t.Errorf("nil String %q", got)
	}
	if _, ok, err := innerTCPCounters(serve("# TYPE go_goroutines gauge\ngo_goroutines 5\n"))(context.Background()); ok || err != nil {
		t.Errorf("a kernel stack's metrics: ok %v, %v; want not there, no error", ok, err)
	}
}
