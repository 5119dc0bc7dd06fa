package tunnel

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/internal/benchtest"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/cmd/tendril-bench/konnectivity"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// TestRunMini runs the tunnel mode in miniature through the same code as a
// full run: direct and tendril (both front-ends) always, OpenVPN when it is
// installed, konnectivity when its build is cached (the test never builds
// it). It checks that every measurement of direct and tendril moved data
// without an error, that the tunnel came up and memory was read, that the
// outputs name every target, and that no namespace is left behind. It makes
// no timing assertions.
func TestRunMini(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	benchtest.LeakCheck(t)
	binDir := benchtest.BinDir(t, 2)
	for _, b := range []string{"tendril-seed", "tendril-ingress", "tendril-server", "tendril-agent"} {
		if _, err := os.Stat(binDir + "/" + b); err != nil {
			t.Fatalf("%s/%s missing: run make build first", binDir, b)
		}
	}
	targets := []string{TargetDirect, TargetTLSRelay, TargetTendrilConnect, TargetTendrilGRPC, TargetTendrilRelay, TargetTendrilRelayConnect, TargetTendrilTUN}
	if (peers.OpenVPN{}).Check(context.Background()) == nil {
		targets = append(targets, TargetOpenVPN)
	} else {
		t.Log("openvpn not installed: not measured")
	}
	if (peers.Konnectivity{}).Built() {
		targets = append(targets, TargetKonnectivityGRPC, TargetKonnectivityConnect, TargetKonnectivityUDS, TargetKonnectivityConnectUDS)
	} else {
		t.Log("konnectivity not built in the cache: not measured (tendril-bench tunnel builds it once)")
	}
	cfg := Config{Targets: targets, Duration: 200 * time.Millisecond, Warmup: 50 * time.Millisecond,
		Conns: []int{1, 2}, DialWorkers: []int{1, 4}, UpRuns: 1, Rounds: 2, Settle: 100 * time.Millisecond, Loads: 2, BinDir: binDir, NoBuild: true,
		Konnectivity: konnectivity.Dial, Progress: benchtest.Log{T: t}}
	// Every stack's load runs twice (Loads); with konnectivity built, eight stacks: 2–4 minutes.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, tr := range rep.Targets {
		strict := tr.Name == TargetDirect || tr.Name == TargetTLSRelay || tr.Name == TargetTendrilConnect || tr.Name == TargetTendrilGRPC ||
			tr.Name == TargetTendrilRelay || tr.Name == TargetTendrilRelayConnect || tr.Name == TargetTendrilTUN
		if tr.Skipped != "" {
			if strict {
				t.Errorf("%s skipped: %s", tr.Name, tr.Skipped)
			} else {
				t.Logf("%s skipped: %s", tr.Name, tr.Skipped)
			}
			continue
		}
		// The second load's figures are not kept.
		if len(tr.Bulk) != 4 || len(tr.Dial) != 2 || len(tr.HOL) != 2 {
			t.Errorf("%s: %d bulk, %d dial, %d head-of-line results; want 4, 2, 2", tr.Name, len(tr.Bulk), len(tr.Dial), len(tr.HOL))
		}
		for _, b := range tr.Bulk {
			if (!strict || tr.Name == TargetTLSRelay) && b.Bytes <= 0 {
				// A peer may move nothing in a 200 ms window on a loaded machine; this test is
				// about the harness, the peers' figures come from the real run. So may the TLS
				// relays, which run in this test binary, under -race (a clean-clone make test
				// beside other work: tls-relay to-shoot ×2 moved 0 bytes at load average 11).
				t.Logf("%s bulk %s ×%d: no bytes in the window (%s)", tr.Name, b.Direction, b.Conns, b.FirstError)
				continue
			}
			if b.Bytes <= 0 || strict && b.Errors > 0 {
				t.Errorf("%s bulk %s ×%d: %d bytes, %d errors (%s)", tr.Name, b.Direction, b.Conns, b.Bytes, b.Errors, b.FirstError)
			}
			// The data path's CPU: none of its own for direct and the TLS relays (in this
			// process), some for tendril's, which moved megabytes through three processes in
			// the window.
			if len(b.RoundMBps) != 2 {
				t.Errorf("%s bulk %s ×%d: round figures %v, want 2", tr.Name, b.Direction, b.Conns, b.RoundMBps)
			}
			if strict && (tr.Name == TargetDirect || tr.Name == TargetTLSRelay) != (b.CPUPerMB == 0) {
				t.Errorf("%s bulk %s ×%d: %.3f CPU ms per MB", tr.Name, b.Direction, b.Conns, b.CPUPerMB)
			}
		}
		for _, d := range tr.Dial {
			if d.Dials <= 0 || strict && d.Errors > 0 || d.P50 > d.P99 || d.P99 > d.Max {
				t.Errorf("%s dials ×%d: %d dials, %d errors (%s), p50 %v p99 %v max %v", tr.Name, d.Workers, d.Dials, d.Errors, d.FirstError, d.P50, d.P99, d.Max)
			}
		}
		for _, h := range tr.HOL {
			if strict && (h.StalledBytes <= 0 || h.MBps <= 0 || h.Errors > 0) {
				t.Errorf("%s head-of-line %s: %+v", tr.Name, h.Direction, h)
			}
		}
	}
	for _, s := range rep.Stacks {
		if s.Name != "tendril" {
			continue
		}
		if len(s.UpMS) != 1 || s.UpMS[0] <= 0 || s.Server.IdleRSS <= 0 || s.Agent.IdleRSS <= 0 || s.Server.Peak < s.Server.IdleRSS ||
			s.Server.AfterRSS <= 0 || s.Agent.AfterRSS <= 0 ||
			len(s.Server.AfterMoreRSS) != 1 || s.Server.AfterMoreRSS[0] <= 0 || len(s.Agent.AfterMoreRSS) != 1 || s.Agent.AfterMoreRSS[0] <= 0 {
			t.Errorf("tendril stack: up %v, server %+v, agent %+v", s.UpMS, s.Server, s.Agent)
		}
	}
	if len(rep.Goals) == 0 {
		t.Error("no goals evaluated")
	}

	var tab, md, js bytes.Buffer
	if err := errors.Join(rep.WriteTable(&tab), rep.WriteMarkdown(&md), rep.WriteJSON(&js)); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", tab.String())
	for _, tr := range rep.Targets {
		for what, out := range map[string]string{"table": tab.String(), "markdown": md.String(), "json": js.String()} {
			if !strings.Contains(out, tr.Name) {
				t.Errorf("%s lacks target %s", what, tr.Name)
			}
		}
	}
	if !strings.Contains(md.String(), "# tendril-bench tunnel — ") || !strings.Contains(md.String(), "| target |") {
		t.Errorf("markdown lacks the title or the tables:\n%s", md.String())
	}
	// Everything is cleaned up: tendril-tun's server device too.
	if _, err := net.InterfaceByName("tbt" + strconv.Itoa(os.Getpid())); err == nil {
		t.Error("tendril-tun's server device left behind")
	}
	entries, _ := os.ReadDir("/run/netns")
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), nsPrefix+strconv.Itoa(os.Getpid())+"-") {
			t.Errorf("namespace %s left behind", e.Name())
		}
	}
}

func TestTopologyAddresses(t *testing.T) {
	// The addresses of a topology are four disjoint networks.
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs")
	}
	topo, err := newTopology(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := topo.close(); err != nil {
			t.Error(err)
		}
	}()
	if topo.podNet.Contains(topo.directIP) || topo.podNet.Contains(topo.seedAddr) || !topo.podNet.Contains(topo.podAddr) {
		t.Errorf("topology %+v", topo)
	}
	// The pod's tunnel address has no route from the seed.
	c, err := net.DialTimeout("tcp", net.JoinHostPort(topo.podAddr.String(), "9"), 300*time.Millisecond)
	if err == nil {
		c.Close()
		t.Errorf("the pod's shoot address %s is reachable without a tunnel", topo.podAddr)
	}
	// A socket made in the pod's namespace is reachable over the direct link.
	l, err := netns.Listen(topo.podNS, ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err = net.DialTimeout("tcp", net.JoinHostPort(topo.directIP.String(), strconv.Itoa(l.Addr().(*net.TCPAddr).Port)), 2*time.Second)
	if err != nil {
		t.Fatalf("direct link: %v", err)
	}
	c.Close()
}

func TestRoundsReportTheMedianRound(t *testing.T) {
	figures := []float64{500, 100, 300, 200}
	errs := []int64{1, 0, 2, 0}
	i := 0
	got, err := rounds(len(figures), func() (BulkResult, error) {
		b := BulkResult{MBps: figures[i], Bytes: int64(i + 1), Errors: errs[i]}
		if errs[i] > 0 && i > 0 {
			b.FirstError = "later error"
		} else if errs[i] > 0 {
			b.FirstError = "first error"
		}
		i++
		return b, nil
	}, bulkFigure)
	if err != nil {
		t.Fatal(err)
	}
	// The lower middle of 100, 200, 300, 500 is 200, the fourth run (Bytes 4); the errors
	// are all rounds' and the figures every round's in order.
	if got.MBps != 200 || got.Bytes != 4 || got.Errors != 3 || got.FirstError != "first error" ||
		!slices.Equal(got.RoundMBps, figures) {
		t.Errorf("rounds: %+v", got)
	}
	one, _ := rounds(1, func() (DialResult, error) { return DialResult{PerSec: 7}, nil }, dialFigure)
	if one.PerSec != 7 || one.RoundPerSec != nil {
		t.Errorf("one round: %+v", one)
	}
}
