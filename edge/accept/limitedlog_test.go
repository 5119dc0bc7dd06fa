package accept

import (
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
)

// TestLimitedLog: beyond Burst lines in a window nothing is logged; the first line of a later
// window says how many were dropped.
func TestLimitedLog(t *testing.T) {
	var lines []string
	l := &LimitedLog{Log: funcr.New(func(_, args string) { lines = append(lines, args) }, funcr.Options{}),
		Burst: 2, Interval: 500 * time.Millisecond}
	for range 5 {
		l.Info("refused")
	}
	if len(lines) != 2 {
		t.Fatalf("%d lines in one window, want 2: %q", len(lines), lines)
	}
	time.Sleep(600 * time.Millisecond) // into the next window
	l.Info("refused")
	if len(lines) != 3 || !strings.Contains(lines[2], `"suppressedSinceLast"=3`) {
		t.Fatalf("line after the window: %q, want suppressedSinceLast=3", lines)
	}
	var zero LimitedLog // discards, and does not panic
	zero.Info("refused")
}
