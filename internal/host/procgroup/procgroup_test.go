package procgroup

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestExitedEarly: a process that ends on its own closes ended and is reported on Exited with
// its log's path, and its log's tail says why.
func TestExitedEarly(t *testing.T) {
	g := New(context.Background())
	defer g.Stop()
	log := filepath.Join(t.TempDir(), "server.log")
	ended, err := g.Start("server", log, Options{Setsid: true}, "/bin/sh", "-c", "echo 'listen tcp: bind: address already in use'; exit 1")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ended:
	case <-time.After(time.Minute):
		t.Fatal("the process did not end")
	}
	select {
	case err := <-g.Exited():
		if !strings.Contains(err.Error(), "server exited") || !strings.Contains(err.Error(), log) {
			t.Fatalf("exited: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("no report on Exited")
	}
	if tail := LogTail(log); !strings.Contains(tail, "address already in use") {
		t.Fatalf("log tail %q", tail)
	}
}

// TestStopEndsAll: Stop signals a process that ignores nothing and waits for it; a process that
// Stop ended is not reported as exited.
func TestStopEndsAll(t *testing.T) {
	g := New(context.Background())
	ended, err := g.Start("sleeper", filepath.Join(t.TempDir(), "s.log"), Options{}, "/bin/sleep", "600")
	if err != nil {
		t.Fatal(err)
	}
	g.Stop()
	select {
	case <-ended:
	default:
		t.Fatal("Stop returned before the process ended")
	}
	select {
	case err := <-g.Exited():
		t.Fatalf("reported after Stop: %v", err)
	default:
	}
}
