package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tendril-net/tendril/bench/xdsbench"
)

func TestParseXDS(t *testing.T) {
	c, err := parseXDS([]string{"--shoots", "10,20", "--replicas", "2", "--bin-dir", t.TempDir(), "--json-file", "x.json"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Config.Shoots, []int{10, 20}) || c.Config.Replicas != 2 || c.Config.Changes != 300 || c.JSONFile != "x.json" {
		t.Errorf("config %+v", c.Config)
	}
	if c.Config.IngressBinary != "" {
		t.Errorf("no tendril-ingress in an empty bin dir, got %q", c.Config.IngressBinary)
	}
	for _, bad := range [][]string{{"--replicas", "0"}, {"--shoots", "0"}, {"--changes", "0"}, {"extra"}} {
		if _, err := parseXDS(bad, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// TestXDSAndPlot runs the xds mode in miniature through the command (its
// children are this test binary, see TestMain) and plots its JSON report.
func TestXDSAndPlot(t *testing.T) {
	dir := t.TempDir()
	js, md, png := filepath.Join(dir, "xds.json"), filepath.Join(dir, "xds.md"), filepath.Join(dir, "xds.png")
	var out strings.Builder
	err := run(context.Background(), []string{"tendril-bench", "xds", "--shoots", "5", "--replicas", "1", "--changes", "3",
		"--warmup", "0", "--bin-dir", "", "--json-file", js, "--markdown", md}, &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "remove") {
		t.Errorf("table:\n%s", out.String())
	}
	if b, err := os.ReadFile(md); err != nil || !strings.Contains(string(b), "## xDS at scale") {
		t.Errorf("markdown: %v\n%s", err, b)
	}
	out.Reset()
	if err := run(context.Background(), []string{"tendril-bench", "plot", "--xds", js, "--xds-out", png}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() == 0 {
		t.Errorf("plot: %v", err)
	}
	if err := run(context.Background(), []string{"tendril-bench", "plot"}, &out, io.Discard); !errors.Is(err, errUsage) {
		t.Errorf("plot without reports: %v", err)
	}
}

func TestMain(m *testing.M) {
	if xdsbench.IsChild() {
		os.Exit(xdsbench.ChildMain())
	}
	os.Exit(m.Run())
}
