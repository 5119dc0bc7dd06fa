package idlemem

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestReleaseBinaryPages: the test binary's code pages that its start-up touched leave the
// resident set (RssFile in /proc/self/status), and the process runs on (they fault back in).
func TestReleaseBinaryPages(t *testing.T) {
	before := rssFileKiB(t)
	n, err := ReleaseBinaryPages()
	if err != nil {
		t.Fatal(err)
	}
	after := rssFileKiB(t)
	if n == 0 || after >= before {
		t.Fatalf("released %d mappings; RssFile %d kB before, %d kB after", n, before, after)
	}
	t.Logf("released %d mappings; RssFile %d kB → %d kB", n, before, after)
}

func rssFileKiB(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skip("no /proc/self/status")
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "RssFile:"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				t.Fatalf("RssFile %q: %v", v, err)
			}
			return n
		}
	}
	t.Skip("no RssFile in /proc/self/status")
	return 0
}
