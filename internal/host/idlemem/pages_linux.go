package idlemem

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// ReleaseBinaryPages drops the executable's read-only pages (code and constant data) from the
// process's resident set, once startup or a load is over, and marks them for random access. It
// returns how many mappings it released.
//
// An idle tendril-server's RSS is mostly pages of its binary, most of its code and read-only
// data (docs/performance.md, "Reversed VPN tunnel"): package initialisation touches code and
// tables all over the binary, and the kernel maps 16 pages around every fault of a file mapping
// (fault-around) and reads ahead. Most of it is never used again by an idle server.
// MADV_DONTNEED on a private mapping that was never written only unmaps the pages (they stay in
// the page cache, shared, and fault back in on use: nothing is lost); MADV_RANDOM stops
// readahead for pages that are no longer cached. It does not stop fault-around, which maps the
// cached pages around a fault whatever the advice (Linux's should_fault_around checks only for
// map_pages and userfaultfd): after a release, the pages an idle tunnel-up server touched again
// come back in runs of 16 (64 KiB). Only mappings of the executable that are read-only and hold
// no page of their own are touched: writable ones (.data, .bss) and read-only ones the dynamic
// linker wrote to (relocations in a PIE build, RELRO) would lose their contents.
func ReleaseBinaryPages() (int, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	type mapping struct {
		start, end uintptr
		name       string
	}
	var candidates []mapping
	var cur *mapping
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(fs[0], "-"); ok && len(fs) >= 5 {
			// A mapping's header: address perms offset dev inode [path].
			cur = nil
			if len(fs) < 6 || fs[5] != exe || strings.ContainsRune(fs[1], 'w') {
				continue
			}
			start, err1 := strconv.ParseUint(lo, 16, 64)
			end, err2 := strconv.ParseUint(hi, 16, 64)
			if err1 != nil || err2 != nil || end <= start {
				continue
			}
			candidates = append(candidates, mapping{uintptr(start), uintptr(end), fs[0]})
			cur = &candidates[len(candidates)-1]
			continue
		}
		// A field of the current mapping: "Anonymous: 4 kB" means copied-on-write pages.
		if cur != nil && fs[0] == "Anonymous:" && len(fs) >= 2 && fs[1] != "0" {
			candidates = candidates[:len(candidates)-1]
			cur = nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	for i, m := range candidates {
		for _, advice := range []uintptr{syscall.MADV_RANDOM, syscall.MADV_DONTNEED} {
			if _, _, e := syscall.Syscall(syscall.SYS_MADVISE, m.start, m.end-m.start, advice); e != 0 {
				return i, fmt.Errorf("madvise %s: %w", m.name, e)
			}
		}
	}
	return len(candidates), nil
}

// dropPages drops the whole pages inside bufs from the resident set (MADV_DONTNEED): on the Go
// heap's private anonymous memory they read as zeros afterwards, and writing faults in a zeroed
// page. A pointer-free object's bytes mean nothing to the runtime, so this is a write of zeros
// as far as anything can tell; the caller owns bufs and needs none of their contents.
func dropPages(bufs [][]byte) {
	for _, b := range bufs {
		if start, end := wholePages(b); end > start {
			// Only EINVAL or ENOMEM can come back, for a range that is not a mapping's: not
			// possible for a live slice, and nothing to do about it but keep the pages.
			_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, start, end-start, syscall.MADV_DONTNEED)
		}
	}
}

// wholePages is the range of the whole pages inside b: start rounded up, end rounded down to a
// page boundary (end ≤ start: none).
func wholePages(b []byte) (start, end uintptr) {
	p, mask := uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(pageSize)-1
	return (p + mask) &^ mask, (p + uintptr(len(b))) &^ mask
}
