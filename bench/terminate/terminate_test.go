package terminate

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/internal/benchtest"
)

// TestRun runs the benchmark briefly against the binaries make build makes and HAProxy: both
// peers answer every request over HTTP/2, spread over the three replicas, and every figure is
// there.
func TestRun(t *testing.T) {
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Fatal("haproxy is not on PATH; install it (Debian package haproxy, see .ci/run)")
	}
	bin := benchtest.BinDir(t, 2)
	rep, err := Run(context.Background(), Config{BinDir: bin, Clients: []int{1, 4}, Duration: 500 * time.Millisecond, IdleConns: 20, Shoots: 3, Settle: 3 * time.Second, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Cells) != 4 || len(rep.Memory) != 2 {
		t.Fatalf("%d cells, %d memory rows; want 4 and 2: %+v", len(rep.Cells), len(rep.Memory), rep)
	}
	for _, c := range rep.Cells {
		if c.Requests == 0 || c.Errors != 0 || c.CPUMicros <= 0 {
			t.Errorf("%s at %d clients: %d requests, %d errors, %.1f µs CPU each", c.Peer, c.Clients, c.Requests, c.Errors, c.CPUMicros)
		}
		for i, n := range c.PerReplica {
			if n == 0 {
				t.Errorf("%s at %d clients: replica %d served nothing: %v", c.Peer, c.Clients, i, c.PerReplica)
			}
		}
	}
	var out bytes.Buffer
	jsonPath := filepath.Join(t.TempDir(), "terminate.json")
	if err := rep.Write(&out, jsonPath); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "tendril/haproxy requests per CPU-second") || !strings.Contains(out.String(), "settled") {
		t.Errorf("no ratio in the report:\n%s", out.String())
	}
	if _, err := os.Stat(jsonPath); err != nil {
		t.Error(err)
	}
	t.Logf("\n%s", out.String())
}
