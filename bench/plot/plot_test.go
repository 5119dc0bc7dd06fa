package plot

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/tunnel"
	"github.com/tendril-net/tendril/bench/xdsbench"
)

func savePNG(t *testing.T, draw func() error, path string) {
	t.Helper()
	if err := draw(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) || len(b) < 1000 {
		t.Fatalf("%s is not a PNG (%d bytes)", path, len(b))
	}
}

func TestXDSLatency(t *testing.T) {
	rep := &xdsbench.Report{}
	rep.Settings.Replicas = 3
	for i, n := range []int{100, 1000, 10000} {
		f := float64(i + 1)
		rep.Sizes = append(rep.Sizes, &xdsbench.SizeResult{Shoots: n, Changes: []xdsbench.ChangeResult{
			{Kind: xdsbench.KindEndpoint, P50MS: f, P99MS: 3 * f},
			{Kind: xdsbench.KindAdd, P50MS: 2 * f, P99MS: 5 * f},
			{Kind: "all", P50MS: 1.5 * f, P99MS: 5 * f},
		}})
	}
	path := filepath.Join(t.TempDir(), "xds.png")
	savePNG(t, func() error {
		p, err := XDSLatency(rep)
		if err != nil {
			return err
		}
		return Save(p, path)
	}, path)
	if _, err := XDSLatency(&xdsbench.Report{}); err == nil {
		t.Error("an empty report plotted")
	}
}

func TestTunnelThroughput(t *testing.T) {
	rep := &tunnel.Report{Targets: []*tunnel.TargetResult{
		{Name: "direct", Bulk: []tunnel.BulkResult{{Direction: "to-shoot", Conns: 1, MBps: 1000}, {Direction: "from-shoot", Conns: 1, MBps: 900}}},
		{Name: "tendril-connect", Bulk: []tunnel.BulkResult{{Direction: "to-shoot", Conns: 1, MBps: 170}, {Direction: "from-shoot", Conns: 1, MBps: 190}}},
		{Name: "openvpn", Skipped: "not installed"},
	}}
	path := filepath.Join(t.TempDir(), "tunnel.png")
	savePNG(t, func() error {
		p, err := TunnelThroughput(rep)
		if err != nil {
			return err
		}
		return Save(p, path)
	}, path)
	if _, err := TunnelThroughput(&tunnel.Report{}); err == nil {
		t.Error("an empty report plotted")
	}
}

func TestRateLatency(t *testing.T) {
	rep := &harness.Report{Mode: "sni"}
	for _, c := range []int{1, 16, 128} {
		f := float64(c)
		for i, target := range []string{"direct", "haproxy", "tendril"} {
			rep.Rate = append(rep.Rate, harness.RateRow{Concurrency: c, Target: target, Conns: 100,
				TTFB: harness.Latency{P50: f * float64(i+1) / 10, P99: f * float64(i+1) / 4}})
		}
	}
	// A target whose connections all failed has nothing to draw, and is left out.
	rep.Rate = append(rep.Rate, harness.RateRow{Concurrency: 1, Target: "nginx"})
	path := filepath.Join(t.TempDir(), "sni-ttfb.png")
	savePNG(t, func() error {
		p, err := RateLatency(rep)
		if err != nil {
			return err
		}
		return Save(p, path)
	}, path)
	if _, err := RateLatency(&harness.Report{Mode: "sni", Rate: []harness.RateRow{{Concurrency: 1, Target: "tendril"}}}); err == nil {
		t.Error("a report without a successful measurement plotted")
	}
}
