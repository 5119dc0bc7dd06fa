package failover

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestRowStats(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	r := Row{Times: []time.Duration{ms(700), ms(100), ms(300), ms(200)}}
	if r.P50() != ms(300) || r.Worst() != ms(700) {
		t.Errorf("p50 %v, worst %v; want 300ms, 700ms (the upper median of four)", r.P50(), r.Worst())
	}
	if r.Times[0] != ms(700) {
		t.Error("P50 sorted the row's own times")
	}
	if (Row{}).P50() != 0 || (Row{}).Worst() != 0 {
		t.Error("an empty row has figures")
	}
}

func TestReport(t *testing.T) {
	rep := &Report{CommandLine: "tendril-bench failover", Repetitions: 2, Partial: true, Rows: []Row{
		{Kind: KindAgent, Stack: "tendril", Killed: "the agent", Recovers: "the other agent", Times: []time.Duration{600 * time.Millisecond, 900 * time.Millisecond}, Note: "checked more"},
	}}
	var md, table, js bytes.Buffer
	if err := errors.Join(rep.WriteMarkdown(&md), rep.WriteTable(&table), rep.WriteJSON(&js)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## Failover (`tendril-bench failover`)", "| the agent | tendril | the other agent | 2 | 0.90 s | 0.90 s |", "**Partial**", "- agent: checked more"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, md.String())
		}
	}
	if !strings.Contains(table.String(), "0.60 0.90") {
		t.Errorf("table:\n%s", table.String())
	}
	if !strings.Contains(js.String(), `"times_ns": [`) {
		t.Errorf("json:\n%s", js.String())
	}
}

// TestMeasureKill: the "stack" fails every dial started in the outage after the kill; dials
// started before the kill take slowDial and succeed. The measured time covers the outage (it
// cannot be shorter), so the dials in flight at the kill, which succeed within slowDial of it,
// did not count.
func TestMeasureKill(t *testing.T) {
	const outage, slowDial = 400 * time.Millisecond, 100 * time.Millisecond
	var down, killed atomic.Bool
	dial := func(ctx context.Context) error {
		if down.Load() {
			<-ctx.Done() // a dead path hangs until the deadline
			return ctx.Err()
		}
		if !killed.Load() {
			select {
			case <-time.After(slowDial):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
	d, err := measureKill(t.Context(), dial, func() (time.Time, error) {
		at := time.Now()
		killed.Store(true)
		down.Store(true)
		time.AfterFunc(outage, func() { down.Store(false) })
		return at, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if d < outage {
		t.Errorf("measured %v, shorter than the %v outage: a dial from before the kill counted", d, outage)
	}
}

func TestMeasureKillNeverRecovers(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	var down atomic.Bool
	dial := func(ctx context.Context) error {
		if down.Load() {
			return errors.New("refused")
		}
		return nil
	}
	_, err := measureKill(ctx, dial, func() (time.Time, error) { down.Store(true); return time.Now(), nil })
	if err == nil || !strings.Contains(err.Error(), "no successful dial since the kill") {
		t.Errorf("got %v, want the run's end with the last dial error", err)
	}
}
