// Package plot draws the benchmark plots as PNG from the modes' JSON
// reports: time to first byte versus concurrency per data plane (from
// "tendril-bench sni", "proxy" and "connect"), xDS change → ACK latency
// versus the number of shoots (from "tendril-bench xds") and tunnel
// throughput per target (from "tendril-bench tunnel"). It uses
// gonum.org/v1/plot and only reads reports; it measures nothing.
package plot

import (
	"encoding/json"
	"errors"
	"fmt"
	"image/color"
	"os"
	"slices"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/tunnel"
	"github.com/tendril-net/tendril/bench/xdsbench"
)

// Size of every plot.
const (
	Width  = 18 * vg.Centimeter
	Height = 11 * vg.Centimeter
)

// ReadJSON reads a report written with --json-file (or --json) into v.
func ReadJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// logLog is an empty plot with both axes logarithmic, a grid and the legend top left.
func logLog(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, x, y
	p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())
	return p
}

// XDSLatency plots the change → ACK latency p50 and p99 (all change kinds
// together, and the p99 of each kind) against the number of shoots, both
// axes logarithmic, with the 100 ms target as a dashed line.
func XDSLatency(rep *xdsbench.Report) (*plot.Plot, error) {
	p := logLog(fmt.Sprintf("xDS change → ACK of every replica (%d replicas)", rep.Settings.Replicas), "shoots", "ms")

	sizes := slices.Clone(rep.Sizes)
	slices.SortFunc(sizes, func(a, b *xdsbench.SizeResult) int { return a.Shoots - b.Shoots })
	series := []struct {
		name, kind string
		p99        bool
	}{
		{"p50, all changes", "all", false},
		{"p99, all changes", "all", true},
	}
	for _, k := range xdsbench.Kinds {
		series = append(series, struct {
			name, kind string
			p99        bool
		}{"p99, " + k, k, true})
	}
	drawn := 0
	minX, maxX := 0.0, 0.0
	for i, s := range series {
		var xys plotter.XYs
		for _, sz := range sizes {
			for _, c := range sz.Changes {
				if c.Kind != s.kind {
					continue
				}
				v := c.P50MS
				if s.p99 {
					v = c.P99MS
				}
				xys = append(xys, plotter.XY{X: float64(sz.Shoots), Y: max(v, 0.01)})
			}
		}
		if len(xys) == 0 {
			continue
		}
		if minX == 0 || xys[0].X < minX {
			minX = xys[0].X
		}
		maxX = max(maxX, xys[len(xys)-1].X)
		l, pts, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, err
		}
		l.Color, pts.Color = plotutil.Color(i), plotutil.Color(i)
		pts.Shape = plotutil.Shape(i)
		if i >= 2 {
			l.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
			l.Width = vg.Points(0.7)
		} else {
			l.Width = vg.Points(1.5)
		}
		p.Add(l, pts)
		p.Legend.Add(s.name, l, pts)
		drawn++
	}
	if drawn == 0 {
		return nil, errors.New("xds report has no measured changes")
	}
	if maxX > minX {
		goal, err := plotter.NewLine(plotter.XYs{{X: minX, Y: xdsbench.GoalP99MS}, {X: maxX, Y: xdsbench.GoalP99MS}})
		if err != nil {
			return nil, err
		}
		goal.Color = color.RGBA{R: 200, A: 255}
		goal.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		p.Add(goal)
		p.Legend.Add("target p99 at 10,000 shoots", goal)
	}
	return p, nil
}

// RateLatency plots the connection-rate test's time to first byte, p50
// (solid) and p99 (dashed), against the client concurrency, one colour per
// target (data plane or peer), both axes logarithmic.
func RateLatency(rep *harness.Report) (*plot.Plot, error) {
	p := logLog(fmt.Sprintf("tendril-bench %s: time to first byte of a new connection", rep.Mode), "concurrent clients", "ms (solid p50, dashed p99)")
	var targets []string
	for _, r := range rep.Rate {
		if !slices.Contains(targets, r.Target) {
			targets = append(targets, r.Target)
		}
	}
	drawn := 0
	for i, target := range targets {
		var p50, p99 plotter.XYs
		for _, r := range rep.Rate {
			if r.Target != target || r.Conns == 0 {
				continue // no successful connection: no latency to draw
			}
			x := float64(max(r.Concurrency, 1))
			p50 = append(p50, plotter.XY{X: x, Y: max(r.TTFB.P50, 0.01)})
			p99 = append(p99, plotter.XY{X: x, Y: max(r.TTFB.P99, 0.01)})
		}
		if len(p50) == 0 {
			continue
		}
		slices.SortFunc(p50, func(a, b plotter.XY) int { return cmpFloat(a.X, b.X) })
		slices.SortFunc(p99, func(a, b plotter.XY) int { return cmpFloat(a.X, b.X) })
		for j, xys := range []plotter.XYs{p50, p99} {
			l, pts, err := plotter.NewLinePoints(xys)
			if err != nil {
				return nil, err
			}
			l.Color, pts.Color, pts.Shape = plotutil.Color(i), plotutil.Color(i), plotutil.Shape(i)
			l.Width = vg.Points(1.5)
			if j == 1 {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(2)}
				l.Width = vg.Points(1)
			} else {
				p.Legend.Add(target, l, pts)
			}
			p.Add(l, pts)
		}
		drawn++
	}
	if drawn == 0 {
		return nil, fmt.Errorf("%s report has no successful connection-rate measurement", rep.Mode)
	}
	return p, nil
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// TunnelThroughput plots each measured target's bulk throughput as grouped
// bars, on a logarithmic axis: one group per target, one bar per direction
// and connection count.
func TunnelThroughput(rep *tunnel.Report) (*plot.Plot, error) {
	type key struct {
		dir   string
		conns int
	}
	var targets []*tunnel.TargetResult
	var keys []key
	for _, t := range rep.Targets {
		if t.Skipped != "" || len(t.Bulk) == 0 {
			continue
		}
		targets = append(targets, t)
		for _, b := range t.Bulk {
			if k := (key{b.Direction, b.Conns}); !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	if len(targets) == 0 {
		return nil, errors.New("tunnel report has no bulk measurement")
	}
	slices.SortStableFunc(keys, func(a, b key) int {
		if a.dir != b.dir {
			if a.dir < b.dir {
				return -1
			}
			return 1
		}
		return a.conns - b.conns
	})
	p := plot.New()
	p.Title.Text = "Tunnel bulk throughput per target"
	p.Y.Label.Text = "MB/s"
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	names := make([]string, len(targets))
	for i, t := range targets {
		names[i] = t.Name
	}
	p.NominalX(names...)
	p.X.Tick.Label.Rotation = 0.35
	p.X.Tick.Label.XAlign = draw.XRight
	barWidth := vg.Points(min(60/float64(len(keys)), 14))
	top := 1.0
	for i, k := range keys {
		vs := make(plotter.Values, len(targets))
		for j, t := range targets {
			for _, b := range t.Bulk {
				if b.Direction == k.dir && b.Conns == k.conns {
					vs[j] = b.MBps
				}
			}
		}
		// The y axis is logarithmic (direct is 10–100× the tunnels): every
		// bar stands on one of 1 MB/s (the axis's bottom) that is not drawn.
		ones := make(plotter.Values, len(targets))
		for j := range ones {
			ones[j] = 1
		}
		base, err := plotter.NewBarChart(ones, barWidth)
		if err != nil {
			return nil, err
		}
		base.Color, base.LineStyle.Width = color.Transparent, 0
		bars, err := plotter.NewBarChart(vs, barWidth)
		if err != nil {
			return nil, err
		}
		bars.Color = plotutil.Color(i)
		bars.LineStyle.Width = 0
		base.Offset = barWidth * vg.Length(float64(i)-float64(len(keys)-1)/2)
		bars.Offset = base.Offset
		bars.StackOn(base)
		p.Add(bars) // base is not drawn: its bars would start at 0
		for _, v := range vs {
			top = max(top, v+1)
		}
		p.Legend.Add(k.dir+", "+strconv.Itoa(k.conns)+" conn", bars)
	}
	p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	p.Y.Label.Text = "MB/s (log scale)"
	p.Y.Min, p.Y.Max = 1, top*3
	return p, nil
}

// Save writes p as a PNG (or whatever the file's extension names) of the
// standard size.
func Save(p *plot.Plot, path string) error {
	return p.Save(Width, Height, path)
}
