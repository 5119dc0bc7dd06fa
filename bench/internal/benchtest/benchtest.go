// Package benchtest holds test helpers shared by the benchmark packages:
// a goroutine leak check, progress lines into the test log, and where the
// owner's tendril binaries are. It is imported by tests only.
package benchtest

import (
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// LeakCheck fails the test if goroutines started during it are still
// running shortly after it ends.
func LeakCheck(t *testing.T) {
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

// Log is an io.Writer that sends each progress line to t.Log.
type Log struct{ T *testing.T }

func (l Log) Write(p []byte) (int, error) {
	l.T.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// BinDir is the repository's bin/, where "make build" puts tendril-seed and
// tendril-ingress, as an absolute path; depth is how many directories below
// the repository root the calling test's package is.
func BinDir(t *testing.T, depth int) string {
	t.Helper()
	dir, err := filepath.Abs(strings.Repeat("../", depth) + "bin")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}
