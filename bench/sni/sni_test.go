package sni

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/peers"
)

// leakCheck fails the test if goroutines started during it are still running
// shortly after it ends.
func leakCheck(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(3 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > before {
			buf := make([]byte, 1<<16)
			t.Errorf("%d goroutines before, %d after:\n%s", before, n, buf[:runtime.Stack(buf, true)])
		}
	})
}

// testLog sends progress lines to t.Log.
type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// installedTargets is direct plus every peer that can run here. tendril
// counts when the owner's binaries are in the repository's bin/.
func installedTargets(t *testing.T) ([]string, string) {
	binDir, err := filepath.Abs("../../bin")
	if err != nil {
		t.Fatal(err)
	}
	targets := []string{TargetDirect}
	for _, p := range []peers.SNI{peers.HAProxy{}, peers.Nginx{}, peers.Tendril{BinDir: binDir}} {
		if err := p.Check(context.Background()); err != nil {
			t.Logf("%s not measured: %v", p.Name(), err)
			continue
		}
		targets = append(targets, p.Name())
	}
	return targets, binDir
}

// TestRunMini is an end-to-end run of the sni mode against direct and every
// installed peer: short, but through the same code as a full run.
func TestRunMini(t *testing.T) {
	leakCheck(t)
	targets, binDir := installedTargets(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const shoots = 4
	rep, err := Run(ctx, Config{Shoots: shoots, Targets: targets, Concurrency: []int{1, 4},
		Duration: 300 * time.Millisecond, BulkBytes: 1 << 20, BulkConns: 2, BinDir: binDir, Progress: testLog{t}})
	if err != nil {
		t.Fatal(err)
	}
	for _, ti := range rep.Targets {
		if ti.Skipped != "" {
			t.Errorf("target %s skipped: %s", ti.Name, ti.Skipped)
		}
	}
	if want := len(targets) * 2; len(rep.RateRuns) != want {
		t.Fatalf("%d rate runs, want %d", len(rep.RateRuns), want)
	}
	perShoot := map[string][]int64{}
	for _, name := range targets {
		perShoot[name] = make([]int64, shoots)
	}
	for _, r := range rep.RateRuns {
		if r.Conns == 0 || r.ConnsPerSec <= 0 {
			t.Errorf("%s c=%d: no connections", r.Target, r.Concurrency)
		}
		if len(r.Errors) != 0 {
			t.Errorf("%s c=%d: errors %v, first: %v", r.Target, r.Concurrency, r.Errors, r.ErrorSamples)
		}
		for i, n := range r.PerShoot {
			perShoot[r.Target][i] += n
		}
		if r.TTFB.P50 <= 0 || r.TTFB.P50 > r.TTFB.P99 {
			t.Errorf("%s c=%d: TTFB p50 %v p99 %v", r.Target, r.Concurrency, r.TTFB.P50, r.TTFB.P99)
		}
	}
	// Every counted connection verified shoot i's certificate for
	// api.s<i>… and got the answer only upstream i sends; through every
	// target, each shoot must have had some.
	for name, counts := range perShoot {
		for i, n := range counts {
			if n == 0 {
				t.Errorf("%s: no verified connection for shoot %d", name, i)
			}
		}
	}
	if len(rep.BulkRuns) != len(targets) {
		t.Fatalf("%d bulk runs, want %d", len(rep.BulkRuns), len(targets))
	}
	for _, r := range rep.BulkRuns {
		if r.Bytes == 0 || len(r.Errors) != 0 {
			t.Errorf("bulk %s: %d bytes, errors %v %v", r.Target, r.Bytes, r.Errors, r.ErrorSamples)
		}
	}
	if len(rep.Upstreams) != shoots {
		t.Fatalf("%d upstream stats, want %d", len(rep.Upstreams), shoots)
	}
	for i, u := range rep.Upstreams {
		if u.Small == 0 || u.Bulk == 0 {
			t.Errorf("upstream %d (%s) answered %d small and %d bulk requests", i, u.Host, u.Small, u.Bulk)
		}
		if u.Misrouted != 0 {
			t.Errorf("upstream %d (%s) got %d ClientHellos for other hosts", i, u.Host, u.Misrouted)
		}
	}
	if len(rep.Rate) != len(targets)*2 || rep.Rate[0].VsDirect == nil || *rep.Rate[0].VsDirect != 1 {
		t.Errorf("rate rows: %+v", rep.Rate)
	}

	var tab, md, js bytes.Buffer
	if err := rep.WriteTable(&tab); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", tab.String())
	for _, name := range targets {
		for what, out := range map[string]string{"table": tab.String(), "markdown": md.String(), "json": js.String()} {
			if !strings.Contains(out, name) {
				t.Errorf("%s lacks target %s", what, name)
			}
		}
	}
	if !strings.Contains(md.String(), "| concurrency | target | conn/s |") || !strings.Contains(md.String(), rep.Machine.CPUModel) {
		t.Errorf("markdown lacks the rate table or the machine:\n%s", md.String())
	}
}

// TestRunCancel checks that cancelling a run stops it promptly, stops the
// peers and returns the measurements completed so far.
func TestRunCancel(t *testing.T) {
	leakCheck(t)
	targets := []string{TargetDirect}
	if (peers.HAProxy{}).Check(context.Background()) == nil {
		targets = append(targets, TargetHAProxy)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg := Config{Targets: targets, Concurrency: []int{2}, Duration: 400 * time.Millisecond,
		Warmup: 50 * time.Millisecond, Progress: testLog{t}}
	// Cancel in the middle of the second measurement.
	time.AfterFunc(700*time.Millisecond, cancel)
	start := time.Now()
	rep, err := Run(ctx, cfg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("Run took %v after cancel", el)
	}
	if rep == nil || !rep.Partial || rep.Note == "" {
		t.Fatalf("report not marked partial: %+v", rep)
	}
	if len(rep.Rate) == 0 {
		t.Errorf("no completed measurement in the partial report (note: %s)", rep.Note)
	}
}

// TestClientVerifies checks the client's error classification: an untrusted
// CA and a certificate for another host fail verification, a ClientHello for
// another shoot is refused by the upstream and counted as misrouted.
func TestClientVerifies(t *testing.T) {
	leakCheck(t)
	hosts := []string{shootHost(0), shootHost(1)}
	p, err := newPKI(hosts)
	if err != nil {
		t.Fatal(err)
	}
	other, err := newPKI(hosts)
	if err != nil {
		t.Fatal(err)
	}
	ups, err := startUpstreams(p, hosts, 64, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer ups.Close()
	ctx := context.Background()
	buf := make([]byte, 65)
	reasonOf := func(err error) string {
		var ce *connError
		if !errors.As(err, &ce) {
			return "none"
		}
		return ce.reason.String()
	}

	good := newClient(p, hosts, 64, 1)
	var s slot
	if _, err := good.fetchSmall(ctx, ups[1].addr(), 1, &s, buf, nil); err != nil {
		t.Fatalf("good client: %v", err)
	}

	untrusted := newClient(other, hosts, 64, 1)
	if _, err := untrusted.fetchSmall(ctx, ups[0].addr(), 0, &s, buf, nil); reasonOf(err) != "verify" {
		t.Errorf("untrusted CA: %v, want a verify error", err)
	}

	// Shoot 1's name sent to shoot 0's upstream: refused at the handshake.
	if _, err := good.fetchSmall(ctx, ups[0].addr(), 1, &s, buf, nil); reasonOf(err) != "handshake" {
		t.Errorf("misrouted ClientHello: %v, want a handshake error", err)
	}
	if n := ups[0].misrouted.Load(); n != 1 {
		t.Errorf("upstream 0 counted %d misrouted ClientHellos, want 1", n)
	}

	// A server that answers any name with shoot 0's certificate: the
	// client asking for shoot 1 must reject the certificate's host name.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		tls.Server(c, &tls.Config{Certificates: []tls.Certificate{p.certs[0]}}).Handshake()
	}()
	defer func() { ln.Close(); <-served }()
	if _, err := good.fetchSmall(ctx, ln.Addr().String(), 1, &s, buf, nil); reasonOf(err) != "verify" ||
		!strings.Contains(err.Error(), shootHost(1)) {
		t.Errorf("certificate for another host: %v, want a verify error naming %s", err, shootHost(1))
	}
}

func TestSmallPayloadNamesShoot(t *testing.T) {
	a, b := smallPayload(1, 64), smallPayload(12, 64)
	if len(a) != 64 || len(b) != 64 || bytes.Equal(a, b) || !bytes.HasPrefix(b, []byte("tendril-bench upstream s12\n")) {
		t.Errorf("payloads %q, %q", a, b)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{
		{Targets: []string{"envoy"}},
		{Targets: []string{TargetDirect, TargetDirect}},
		{Concurrency: []int{0}},
		{Concurrency: []int{16, 16}},
		{Modes: []string{"latency"}},
		{Payload: 8},
	} {
		c.setDefaults()
		if err := c.validate(); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
	var c Config
	c.setDefaults()
	if err := c.validate(); err != nil {
		t.Errorf("defaults rejected: %v", err)
	}
	if c.Warmup != time.Second || c.Shoots != 4 || c.BulkBytes != 64<<20 {
		t.Errorf("defaults: %+v", c)
	}
}
