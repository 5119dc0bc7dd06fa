package machine

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of /proc CPU times: USER_HZ, 100 on every Linux ABI
// Go supports (sysconf(_SC_CLK_TCK) would need cgo to ask).
const clockTick = 10 * time.Millisecond

// CPUSample is a snapshot of CPU time counters, for telling how much CPU
// work other than the benchmark's own ran during a measurement.
type CPUSample struct {
	// Busy is the CPU time all CPUs spent in user, nice and system mode
	// or stolen by the hypervisor, since boot. Interrupt and softirq time
	// is left out: on loopback most of it is the benchmark's own packets.
	Busy time.Duration
	// Own is the CPU time of this process and of the live processes in
	// the process groups passed to SampleCPU.
	Own time.Duration
	// OK is false when the counters could not be read (not Linux).
	OK bool
}

// SampleCPU reads the counters. groups are process group IDs whose members
// count as our own (the peers, each started in its own group).
func SampleCPU(groups []int) CPUSample {
	busy, ok := busyCPU()
	if !ok {
		return CPUSample{}
	}
	s := CPUSample{Busy: busy, OK: true}
	if t, _, ok := procCPU("/proc/self/stat"); ok {
		s.Own += t
	}
	self := os.Getpid()
	for _, pid := range GroupMembers(groups) {
		if pid != self {
			t, _ := ProcessCPU(pid)
			s.Own += t
		}
	}
	return s
}

// GroupMembers returns the live processes in the process groups groups (a
// peer and its workers: each peer leads its own group), nil when there are
// none or /proc cannot be read.
func GroupMembers(groups []int) []int {
	if len(groups) == 0 {
		return nil
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		_, pgrp, ok := procCPU("/proc/" + e.Name() + "/stat")
		if ok && slices.Contains(groups, pgrp) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// ProcessCPU returns the CPU time process pid has used since it started: the run time of its
// threads in nanoseconds (/proc/<pid>/task/*/schedstat), or, where that is missing, user and
// system time from /proc/<pid>/stat in 10 ms ticks. The ticks are too coarse for short windows:
// a data plane using 5 ms in a 300 ms window read as 0 or 10 ms.
func ProcessCPU(pid int) (time.Duration, bool) {
	if t, ok := threadsRunTime(pid); ok {
		return t, true
	}
	t, _, ok := procCPU("/proc/" + strconv.Itoa(pid) + "/stat")
	return t, ok
}

// threadsRunTime sums the first field of every thread's schedstat: the time it ran on a CPU, in
// nanoseconds. A thread that exits takes its time along; the data planes measured keep theirs.
func threadsRunTime(pid int) (time.Duration, bool) {
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	tasks, err := os.ReadDir(dir)
	if err != nil || len(tasks) == 0 {
		return 0, false
	}
	var sum time.Duration
	for _, task := range tasks {
		t, ok := taskRunTime(dir + "/" + task.Name())
		if !ok {
			continue // exited meanwhile
		}
		sum += t
	}
	return sum, true
}

// taskRunTime reads the run time of one thread, task the directory /proc/<pid>/task/<tid>.
func taskRunTime(task string) (time.Duration, bool) {
	b, err := os.ReadFile(task + "/schedstat")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0, false
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, false
	}
	return time.Duration(ns), true
}

// ProcessesCPU is the user and system CPU time the processes pids have used
// so far, summed. A process that has exited counts as nothing, so the
// difference of two calls is exact while they all run.
func ProcessesCPU(pids []int) time.Duration {
	var sum time.Duration
	for _, pid := range pids {
		if t, ok := ProcessCPU(pid); ok {
			sum += t
		}
	}
	return sum
}

// OpenFiles counts the open file descriptors of process pid (the entries of
// /proc/<pid>/fd); false if it cannot (the process is gone, or no /proc).
func OpenFiles(pid int) (int, bool) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	n := 0
	for {
		// Names in batches, not all at once: a process with 100,000
		// sockets has as many entries.
		names, err := f.Readdirnames(1024)
		n += len(names)
		if err != nil {
			if errors.Is(err, io.EOF) {
				return n, true
			}
			return n, false
		}
	}
}

// Other returns the CPU time used by others between s and a later sample
// t: busy time that was neither ours nor our peers'. It is 0 when either
// sample is missing, and never negative (the counters tick at 10 ms).
func (s CPUSample) Other(t CPUSample) time.Duration {
	if !s.OK || !t.OK {
		return 0
	}
	return max(0, (t.Busy-s.Busy)-(t.Own-s.Own))
}

// busyCPU reads the "cpu" line of /proc/stat.
func busyCPU() (time.Duration, bool) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		return 0, false
	}
	// cpu user nice system idle iowait irq softirq steal guest guest_nice
	f0 := strings.Fields(sc.Text())
	if len(f0) < 9 || f0[0] != "cpu" {
		return 0, false
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 8} {
		n, err := strconv.ParseInt(f0[i], 10, 64)
		if err != nil {
			return 0, false
		}
		ticks += n
	}
	return time.Duration(ticks) * clockTick, true
}

// procCPU reads utime+stime and the process group of one /proc/<pid>/stat.
func procCPU(path string) (time.Duration, int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, false
	}
	// The command name (field 2) is in parentheses and may contain
	// spaces; the fields after the last ')' start with the state (3).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state), so field n is f[n-3]: pgrp 5, utime 14, stime 15.
	if len(f) < 13 {
		return 0, 0, false
	}
	pgrp, err1 := strconv.Atoi(f[2])
	ut, err2 := strconv.ParseInt(f[11], 10, 64)
	st, err3 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return 0, 0, false
	}
	return time.Duration(ut+st) * clockTick, pgrp, true
}
