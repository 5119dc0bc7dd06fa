package tunnel

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/internal/impair"
)

// Impairment is one cell of the loss-and-latency grid: what the carrier link (seed ⇄ shoot,
// which every tunnel's carrier crosses) does to each packet, each way. The pod's links and the
// direct link stay clean.
type Impairment struct {
	// RTT is the round-trip time added, half of it each way.
	RTT time.Duration
	// Jitter is the spread of each way's delay (uniform, ±).
	Jitter time.Duration
	// Loss is the fraction of packets lost, each way (a round trip loses about twice as many).
	Loss float64
	// Rate, if not 0, caps each way at this many bytes per second.
	Rate int64
}

// Grid is the grid: 0, 0.5 and 2 % loss at 0, 50 and 150 ms RTT, the clean cell first.
func Grid() []Impairment {
	var g []Impairment
	for _, rtt := range []time.Duration{0, 50 * time.Millisecond, 150 * time.Millisecond} {
		for _, loss := range []float64{0, 0.005, 0.02} {
			g = append(g, Impairment{RTT: rtt, Loss: loss})
		}
	}
	return g
}

// ParseImpairments reads "grid" (Grid) or a comma-separated list of RTT/LOSS cells, RTT a
// duration ("0" or "50ms") and LOSS a percentage ("0.5"), e.g. "0/0,50ms/0.5,150ms/2".
func ParseImpairments(s string) ([]Impairment, error) {
	if s == "grid" {
		return Grid(), nil
	}
	var out []Impairment
	for cell := range strings.SplitSeq(s, ",") {
		rtt, loss, ok := strings.Cut(strings.TrimSpace(cell), "/")
		if !ok {
			return nil, fmt.Errorf("impairment %q: want RTT/LOSS%%, e.g. 50ms/0.5", cell)
		}
		var imp Impairment
		var err error
		if rtt != "0" {
			if imp.RTT, err = time.ParseDuration(rtt); err != nil {
				return nil, fmt.Errorf("impairment %q: RTT: %w", cell, err)
			}
		}
		pct, err := strconv.ParseFloat(strings.TrimSuffix(loss, "%"), 64)
		if err != nil {
			return nil, fmt.Errorf("impairment %q: loss: %w", cell, err)
		}
		imp.Loss = pct / 100
		out = append(out, imp)
	}
	return out, nil
}

func (i Impairment) validate() error {
	return i.config(0).Validate()
}

// config is one way's impairment; seed tells the two ways' loss draws apart.
func (i Impairment) config(seed uint64) impair.Config {
	return impair.Config{Delay: i.RTT / 2, Jitter: i.Jitter, Loss: i.Loss, Rate: i.Rate, Seed: seed}
}

// ImpairmentSettings is an Impairment as the report records it.
type ImpairmentSettings struct {
	RTTms    float64 `json:"rtt_ms"`
	JitterMS float64 `json:"jitter_ms,omitempty"`
	LossPct  float64 `json:"loss_pct_each_way"`
	RateMBps float64 `json:"rate_mb_per_sec,omitempty"`
}

func (i Impairment) settings() ImpairmentSettings {
	return ImpairmentSettings{RTTms: ms(i.RTT), JitterMS: ms(i.Jitter), LossPct: i.Loss * 100, RateMBps: float64(i.Rate) / 1e6}
}

// String is the cell as a table names it.
func (s ImpairmentSettings) String() string {
	out := fmt.Sprintf("RTT %g ms, loss %g %%", s.RTTms, s.LossPct)
	if s.JitterMS > 0 {
		out += fmt.Sprintf(", jitter ±%g ms", s.JitterMS)
	}
	if s.RateMBps > 0 {
		out += fmt.Sprintf(", %g MB/s", s.RateMBps)
	}
	return out
}

// CellResult is one target's figures under one Impairment.
type CellResult struct {
	Impairment ImpairmentSettings `json:"impairment"`
	Skipped    string             `json:"skipped,omitempty"`
	Bulk       []BulkResult       `json:"bulk,omitempty"`
	Dial       []DialResult       `json:"dial,omitempty"`
	HOL        []HOLResult        `json:"head_of_line,omitempty"`
	Notes      []string           `json:"notes,omitempty"`
	// Carrier is what the carrier link carried and dropped while the cell was measured, by
	// direction (to-shoot is seed → shoot).
	Carrier map[string]CarrierCount `json:"carrier"`
	// InnerTCP and ShootInnerTCP are what tendril-server's and tendril-agent's inner stacks
	// counted meanwhile; nil for the peers and for a stack without them.
	InnerTCP      *InnerTCP `json:"inner_tcp,omitempty"`
	ShootInnerTCP *InnerTCP `json:"shoot_inner_tcp,omitempty"`
}

// CarrierCount is one direction of the carrier link over one cell.
type CarrierCount struct {
	Packets uint64            `json:"packets"`
	Dropped map[string]uint64 `json:"dropped,omitempty"`
}

// crossesCarrier says whether target's path crosses the seed ⇄ shoot link: every tunnel's
// carrier does; direct and the TLS relay pair use the direct link to the pod.
func crossesCarrier(target string) bool {
	return target != TargetDirect && target != TargetTLSRelay
}

// measureCells measures t through d: once as measureTarget does without impairments, or once
// per impairment (the carrier link set to each in turn, and back to the first at the end),
// t's own figures then being the first cell's.
func (r *runner) measureCells(ctx context.Context, t *TargetResult, d dialFunc) error {
	cells := r.cfg.Impairments
	if len(cells) == 0 || !crossesCarrier(t.Name) {
		return r.measureTarget(ctx, t, d)
	}
	defer r.topo.impair(cells[0])
	for i, imp := range cells {
		if err := r.topo.impair(imp); err != nil {
			return err
		}
		r.logf("%s: carrier %s", t.Name, imp.settings())
		if i > 0 && rttRose(cells[i-1], imp) {
			r.logf("%s: waiting %v for the carriers' congestion control to learn the longer round trip", t.Name, rttSettle)
			select {
			case <-time.After(rttSettle):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		before, seedBefore, shootBefore := r.topo.carrierStats(), r.innerTCPNow(ctx, r.innerTCP), r.innerTCPNow(ctx, r.agentInnerTCP)
		m := &TargetResult{Name: t.Name, Stack: t.Stack}
		err := r.measureTarget(ctx, m, d)
		after, seedAfter, shootAfter := r.topo.carrierStats(), r.innerTCPNow(ctx, r.innerTCP), r.innerTCPNow(ctx, r.agentInnerTCP)
		c := CellResult{Impairment: imp.settings(), Skipped: m.Skipped, Bulk: m.Bulk, Dial: m.Dial,
			HOL: m.HOL, Notes: m.Notes, Carrier: carrierDelta(before, after),
			InnerTCP: innerDelta(seedBefore, seedAfter), ShootInnerTCP: innerDelta(shootBefore, shootAfter)}
		t.Cells = append(t.Cells, c)
		if i == 0 {
			t.Skipped, t.Bulk, t.Dial, t.HOL, t.Notes = m.Skipped, m.Bulk, m.Dial, m.HOL, m.Notes
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// innerTCPNow reads one end's inner TCP counters with read, nil where it has none or they
// cannot be read (said in the progress log: the cell is measured all the same).
func (r *runner) innerTCPNow(ctx context.Context, read func(ctx context.Context) (InnerTCP, bool, error)) *InnerTCP {
	if read == nil {
		return nil
	}
	c, ok, err := read(ctx)
	if err != nil {
		r.logf("inner TCP counters: %v", err)
	}
	if !ok {
		return nil
	}
	return &c
}

// innerDelta is what was counted between before and after; nil unless both were read (an agent
// restarted in between would count from zero, but agents start only before the cells).
func innerDelta(before, after *InnerTCP) *InnerTCP {
	if before == nil || after == nil {
		return nil
	}
	d := after.minus(*before)
	return &d
}

// rttSettle is how long a cell waits after the carrier's round trip rose before it is
// measured. A real carrier's path keeps its round trip, a cell's change does not: the
// carriers are long-lived kernel TCP connections, and with BBR (this machine's and many
// distributions' default) the sender paces to its bandwidth × its minimum round trip, a
// minimum that a longer round trip only replaces when it is 10 s old (bbr_min_rtt_win_sec).
// Until then each carrier moves a small fraction of what it could, tendril's and the peers'
// alike (docs/performance.md, "Tunnel under loss and latency"). Half a second beyond the window
// for the first sample after it.
const rttSettle = 10*time.Second + 500*time.Millisecond

// rttRose says whether going from cell prev to next lengthens the carrier's shortest round trip
// (the RTT less the jitter of both ways), the one BBR keeps.
func rttRose(prev, next Impairment) bool { return next.RTT-2*next.Jitter > prev.RTT-2*prev.Jitter }

func carrierDelta(before, after map[string]impair.Stats) map[string]CarrierCount {
	out := map[string]CarrierCount{}
	for dir, a := range after {
		b := before[dir]
		c := CarrierCount{Packets: a.Packets - b.Packets}
		for reason, n := range a.Dropped {
			if n > b.Dropped[reason] {
				if c.Dropped == nil {
					c.Dropped = map[string]uint64{}
				}
				c.Dropped[reason] = n - b.Dropped[reason]
			}
		}
		out[dir] = c
	}
	return out
}

// isPeer says whether target is one of the systems tendril's tunnel is compared with.
func isPeer(target string) bool {
	return target == TargetOpenVPN || strings.HasPrefix(target, "konnectivity-")
}

// cellGoals compares, in every cell, each tendril target with the better peer's throughput
// (per bulk figure) and its longest gap with the peers' worst.
func (rep *Report) cellGoals() []Goal {
	type entry struct {
		target string
		cell   *CellResult
	}
	byCell := map[string][]entry{}
	var order []string
	for _, t := range rep.Targets {
		for i := range t.Cells {
			c := &t.Cells[i]
			if c.Skipped != "" {
				continue
			}
			k := c.Impairment.String()
			if _, ok := byCell[k]; !ok {
				order = append(order, k)
			}
			byCell[k] = append(byCell[k], entry{t.Name, c})
		}
	}
	var goals []Goal
	for _, k := range order {
		var tendril, peers []entry
		for _, e := range byCell[k] {
			switch {
			case strings.HasPrefix(e.target, "tendril-"):
				tendril = append(tendril, e)
			case isPeer(e.target):
				peers = append(peers, e)
			}
		}
		if len(peers) == 0 {
			continue
		}
		worstGap, worstPeer := 0.0, ""
		for _, p := range peers {
			if g := math.Round(longestGap(p.cell.Bulk)); g > worstGap {
				worstGap, worstPeer = g, p.target
			}
		}
		for _, te := range tendril {
			for _, b := range te.cell.Bulk {
				best, bestPeer := math.NaN(), ""
				for _, p := range peers {
					if v := cellBulk(p.cell, b.Direction, b.Conns); !math.IsNaN(v) && (math.IsNaN(best) || v > best) {
						best, bestPeer = v, p.target
					}
				}
				if math.IsNaN(best) {
					continue
				}
				g := Goal{Metric: fmt.Sprintf("%s: bulk %s ×%d", k, b.Direction, b.Conns), Tendril: te.target,
					Versus: bestPeer, Value: b.MBps, Other: best, Want: 1, Unit: "MB/s"}
				if best > 0 {
					g.Ratio = b.MBps / best
				} else {
					g.Infinite = b.MBps > 0
				}
				g.Met = g.Infinite || g.Ratio >= 1
				goals = append(goals, g)
			}
			if worstPeer != "" {
				v := longestGap(te.cell.Bulk)
				goals = append(goals, Goal{Metric: fmt.Sprintf("%s: longest gap from-shoot (≤ %s's %.0f ms)", k, worstPeer, worstGap),
					Tendril: te.target, Value: v, Want: worstGap, Unit: "ms", Met: v <= worstGap})
			}
		}
	}
	return goals
}

func cellBulk(c *CellResult, dir string, conns int) float64 {
	t := TargetResult{Bulk: c.Bulk}
	return t.bulkMBps(dir, conns)
}

// longestGap is the longest gap of the from-shoot bulk runs.
func longestGap(bulk []BulkResult) float64 {
	var g float64
	for _, b := range bulk {
		g = max(g, b.LongestGapMS)
	}
	return g
}

// cellTable is the loss-and-latency grid: a row per cell and target.
func (rep *Report) cellTable() table {
	t := table{title: "Loss and latency on the carrier (MB/s; the longest gap between reads of a from-shoot transfer; dial p99)"}
	t.Header = []string{"carrier", "target"}
	t.Left = []bool{true, true}
	t.addBulkColumns("%s ×%d", rep.Settings.Conns)
	for _, h := range []string{"longest gap ms", "dial p99 ms", "HOL to-shoot", "HOL from-shoot", "carrier lost", "inner RTOs seed", "inner RTOs shoot"} {
		t.Header = append(t.Header, h)
		t.Left = append(t.Left, false)
	}
	var cells []string
	for _, tr := range rep.Targets {
		for _, c := range tr.Cells {
			if k := c.Impairment.String(); !slices.Contains(cells, k) {
				cells = append(cells, k)
			}
		}
	}
	for _, k := range cells {
		for _, tr := range rep.Targets {
			for i := range tr.Cells {
				c := &tr.Cells[i]
				if c.Impairment.String() != k {
					continue
				}
				row := []string{k, tr.Name}
				if c.Skipped != "" {
					row = append(row, "skipped: "+c.Skipped)
					for len(row) < len(t.Header) {
						row = append(row, "")
					}
					t.Rows = append(t.Rows, row)
					continue
				}
				for _, dir := range []string{ToShoot, FromShoot} {
					for _, n := range rep.Settings.Conns {
						row = append(row, fmtMB(cellBulk(c, dir, n)))
					}
				}
				p99 := math.NaN()
				if len(c.Dial) > 0 {
					p99 = c.Dial[0].P99
				}
				hol := TargetResult{HOL: c.HOL}
				var lost uint64
				for _, cc := range c.Carrier {
					lost += cc.Dropped[impair.ReasonLoss]
				}
				row = append(row, fmtMS(longestGap(c.Bulk)), fmtMS(p99), fmtMB(hol.holMBps(ToShoot)), fmtMB(hol.holMBps(FromShoot)),
					strconv.FormatUint(lost, 10), c.InnerTCP.String(), c.ShootInnerTCP.String())
				t.Rows = append(t.Rows, row)
			}
		}
	}
	t.notes = []string{
		"The carrier link is a userspace impairment stage (bench/internal/impair) between two TUN devices in place of the seed ⇄ shoot veth: " +
			"half the RTT each way, the loss each way, packets never reordered; every tunnel's carrier crosses it, the pod's links stay clean.",
		"Dial p99 is of the first dial-worker count; a lost SYN or first segment costs a dial a retransmission timeout (~1 s).",
		"Carrier lost counts the packets the stage dropped in both directions while the cell was measured.",
		"Inner RTOs are the inner TCP retransmission timeouts over the cell, with those the acknowledgements showed spurious, of tendril-server (seed: " +
			"it sends the to-shoot data) and tendril-agent (shoot: the from-shoot data, whose longest gap is the gap column); each stalls a connection " +
			"for at least 200 ms. gVisor counts zero-window probes as timeouts too: the head-of-line measurement's stalled reader gives each end " +
			"about 3 per cell on a clean carrier. – for the peers, which have no inner TCP, and the kernel stack.",
		fmt.Sprintf("A cell whose round trip is longer than the one before waits %v before it is measured: BBR keeps a carrier's minimum round trip for 10 s.", rttSettle),
	}
	return t
}
