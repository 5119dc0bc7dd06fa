package localseed

import (
	"context"
	"github.com/tendril-net/tendril/internal/host/procgroup"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWaitHTTPStopsWhenTheProcessEnds: a process that exits before it serves ends the wait with
// that reason (not the wait's deadline), and its log's tail says why.
func TestWaitHTTPStopsWhenTheProcessEnds(t *testing.T) {
	p := procgroup.New(context.Background())
	defer p.Stop()
	log := filepath.Join(t.TempDir(), "server.log")
	ended, err := p.Start("server", log, procgroup.Options{}, "/bin/sh", "-c", "echo 'listen tcp: bind: address already in use'; exit 1")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = waitHTTP(ctx, "http://127.0.0.1:1/healthz", ended)
	if err == nil || !strings.Contains(err.Error(), "the process ended") || ctx.Err() != nil {
		t.Fatalf("waitHTTP: %v (deadline passed: %v)", err, ctx.Err())
	}
	if tail := procgroup.LogTail(log); !strings.Contains(tail, "address already in use") {
		t.Fatalf("log tail %q", tail)
	}
}
