package idlemem

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"
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

// resident counts the resident pages among the whole pages inside b (mincore).
func resident(t *testing.T, b []byte) int {
	t.Helper()
	start, end := wholePages(b)
	vec := make([]byte, (end-start)/uintptr(pageSize))
	if _, _, e := syscall.Syscall(syscall.SYS_MINCORE, start, end-start, uintptr(unsafe.Pointer(unsafe.SliceData(vec)))); e != 0 {
		t.Fatalf("mincore: %v", e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// TestHeldDropsPagesOnceQuiet: buffers that large reads filled stay resident while reads are
// large and for HeldQuiet after the last one; then their whole pages leave the resident set
// (the partial pages at their ends keep their bytes) and read as zeros; small reads do not
// count as large; and the buffers work as before.
func TestHeldDropsPagesOnceQuiet(t *testing.T) {
	const size = 65535 // wireguard-go's MaxMessageSize
	bufs := make([][]byte, 8)
	fill := func() {
		for _, b := range bufs {
			for i := range b {
				b[i] = 0xab
			}
		}
	}
	whole := 0
	for i := range bufs {
		bufs[i] = make([]byte, size)
	}
	fill()
	for _, b := range bufs {
		whole += resident(t, b)
	}
	if whole < len(bufs)*(size/pageSize-1) {
		t.Fatalf("%d pages resident after filling %d buffers", whole, len(bufs))
	}
	clock := time.Unix(0, 0)
	h := Held{now: func() time.Time { return clock }}
	count := func() int {
		n := 0
		for _, b := range bufs {
			n += resident(t, b)
		}
		return n
	}
	step := func(d time.Duration, filled int) {
		clock = clock.Add(d)
		h.Filled(filled)
		h.Waiting(bufs)
	}
	step(0, size)
	step(HeldQuiet-time.Millisecond, 100) // small reads: quiet since the large one
	if n := count(); n != whole {
		t.Fatalf("%d of %d pages resident before HeldQuiet passed", n, whole)
	}
	step(time.Millisecond, 100)
	if n := count(); n != 0 {
		t.Fatalf("%d of %d pages resident after HeldQuiet of small reads", n, whole)
	}
	for _, b := range bufs {
		p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		head := int((uintptr(pageSize) - p%uintptr(pageSize)) % uintptr(pageSize))
		tail := int((p + uintptr(len(b))) % uintptr(pageSize))
		if b[head] != 0 || b[len(b)-tail-1] != 0 {
			t.Fatalf("a dropped page reads %#x, %#x", b[head], b[len(b)-tail-1])
		}
		if (head > 0 && b[head-1] != 0xab) || (tail > 0 && b[len(b)-1] != 0xab) {
			t.Fatal("the partial pages at a buffer's ends lost their bytes")
		}
	}
	// Used again: large reads keep them; dropped again only after HeldQuiet of quiet.
	fill()
	step(time.Second, size)
	step(HeldQuiet-time.Millisecond, 0)
	if n := count(); n != whole {
		t.Fatalf("%d of %d pages resident within HeldQuiet of a large read", n, whole)
	}
	step(time.Millisecond, 0)
	if n := count(); n != 0 {
		t.Fatalf("%d pages resident after the second quiet period", n)
	}
}
