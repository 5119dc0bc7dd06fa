package failover

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/internal/inflight"
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

// TestLongestStall: the stall is the longest gap between echoes from the last at or before the
// cut to the first after the settle; a stream that had not echoed before the cut, or not after
// the settle yet, has none.
func TestLongestStall(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	h := &heldStream{echoes: []time.Time{at(0), at(20), at(40), at(60), at(300), at(320), at(340)}}
	if d, ok := h.longestStall(at(50), at(50)); !ok || d != 20*time.Millisecond {
		t.Errorf("stall around 50 ms: %v, %v; want 20ms (60 after 40)", d, ok)
	}
	if d, ok := h.longestStall(at(10), at(100)); !ok || d != 240*time.Millisecond {
		t.Errorf("stall from 10 ms settled at 100 ms: %v, %v; want 240ms (a gap after the cut)", d, ok)
	}
	if _, ok := h.longestStall(at(-1), at(0)); ok {
		t.Error("a stall for a cut before the first echo")
	}
	if _, ok := h.longestStall(at(0), at(340)); ok {
		t.Error("a stall without an echo after the settle")
	}
	h.forget()
	if len(h.echoes) != 1 || h.echoes[0] != at(340) {
		t.Errorf("after forget: %v, want the last echo alone", h.echoes)
	}
	h.echoes = append(h.echoes, at(360), at(900))
	if d, ok := h.longestStall(at(350), at(400)); !ok || d != 540*time.Millisecond {
		t.Errorf("after forget, a stall from 350 ms: %v, %v; want 540ms (from the echo kept)", d, ok)
	}
}

// connectEcho serves HTTP CONNECT on a Unix socket: 200, then an echo. Its conns can be cut.
func connectEcho(t *testing.T) (string, *inflight.Set) {
	sock := filepath.Join(t.TempDir(), "connect.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	conns := &inflight.Set{}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); conns.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if !conns.Add(c) {
				c.Close()
				return
			}
			wg.Go(func() {
				defer conns.Done(c)
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\n\r\n")
				_, _ = io.Copy(c, br)
			})
		}
	})
	return sock, conns
}

// TestMeasureCuts: cuts the path survives leave every held connection and a stall of about a
// round trip; cuts that end the connections count every one broken, with new ones held for the
// next cut.
func TestMeasureCuts(t *testing.T) {
	logf := func(string, ...any) {}
	sock, conns := connectEcho(t)
	dial := func(ctx context.Context) (net.Conn, error) { return connectStream(ctx, sock, "pod:8081") }
	res, err := measureCuts(t.Context(), dial, 3, 2, 0, func() error { return nil }, logf)
	if err != nil || res.broken != 0 || res.held != 6 || len(res.stalls) != 2 {
		t.Fatalf("harmless cuts: %+v, %v", res, err)
	}
	for _, d := range res.stalls {
		if d <= 0 || d > brokenAfter {
			t.Errorf("stall %v of a harmless cut", d)
		}
	}
	res, err = measureCuts(t.Context(), dial, 3, 2, 0, func() error { conns.Reset(); return nil }, logf)
	if err != nil || res.broken != 6 || res.held != 6 || len(res.stalls) != 0 || res.firstErr == nil {
		t.Errorf("cuts that end the connections: %+v, %v; want 6 of 6 broken, no stall, an error", res, err)
	}
}
