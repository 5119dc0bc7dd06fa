package machine

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"
)

func TestCPUModel(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpuinfo")
	data := "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := cpuModel(path); got != "AMD EPYC 7B13" {
		t.Errorf("cpuModel = %q", got)
	}
	if got := cpuModel(filepath.Join(t.TempDir(), "missing")); got != "unknown" {
		t.Errorf("cpuModel of a missing file = %q, want unknown", got)
	}
}

func TestDescribe(t *testing.T) {
	d := Describe()
	if d.Cores < 1 || d.GoVersion == "" || d.CPUModel == "" || LoadAverage() == "" {
		t.Errorf("Describe = %+v, load %q", d, LoadAverage())
	}
}

func TestSampleCPU(t *testing.T) {
	a := SampleCPU([]int{os.Getpid()})
	if !a.OK {
		t.Skip("no /proc/stat")
	}
	// Burn CPU in this process until it counts as our own. Spin by CPU, not wall time: on a
	// loaded machine 200 ms of wall time may hold far less of our CPU. The bound only keeps a
	// broken SampleCPU from spinning forever.
	var b CPUSample
	x := 0
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		for range 1_000_000 {
			x++
		}
		if b = SampleCPU(nil); b.Own-a.Own >= 100*time.Millisecond {
			break
		}
	}
	if b.Own-a.Own < 100*time.Millisecond || b.Busy < a.Busy {
		t.Errorf("own CPU grew by %v, busy by %v after spinning for a minute (%d)", b.Own-a.Own, b.Busy-a.Busy, x)
	}
	if o := a.Other(b); o < 0 {
		t.Errorf("Other = %v", o)
	}
	if (CPUSample{}).Other(b) != 0 {
		t.Error("Other of a missing sample is not 0")
	}
}

// TestGroupMembers finds a child in its own process group, and only there.
func TestGroupMembers(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Skip("cannot start sleep:", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	if got := GroupMembers([]int{pid}); !slices.Equal(got, []int{pid}) {
		t.Errorf("GroupMembers(child's group) = %v, want [%d]", got, pid)
	}
	if got := GroupMembers([]int{syscall.Getpgrp()}); slices.Contains(got, pid) || !slices.Contains(got, os.Getpid()) {
		t.Errorf("GroupMembers(our group) = %v: want us (%d), not the child %d", got, os.Getpid(), pid)
	}
	if got := GroupMembers(nil); got != nil {
		t.Errorf("GroupMembers(nil) = %v", got)
	}
	if _, ok := ProcessCPU(pid); !ok {
		t.Error("no CPU time for the child")
	}
	if ProcessesCPU([]int{-1}) != 0 {
		t.Error("ProcessesCPU counts a process that does not exist")
	}
}

// TestOpenFiles counts descriptors as they open and close.
func TestOpenFiles(t *testing.T) {
	before, ok := OpenFiles(os.Getpid())
	if !ok {
		t.Skip("no /proc/self/fd")
	}
	var fs []*os.File
	const n = 1500 // more than one batch of names
	for range n {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		fs = append(fs, f)
	}
	with, _ := OpenFiles(os.Getpid())
	for _, f := range fs {
		f.Close()
	}
	after, _ := OpenFiles(os.Getpid())
	// Other goroutines of the test binary may open a descriptor meanwhile;
	// ours are the bulk of the difference.
	if with-before < n || with-before > n+5 || after > before+5 {
		t.Errorf("open files: %d before, %d with %d more open, %d after closing them", before, with, n, after)
	}
	if _, ok := OpenFiles(-1); ok {
		t.Error("OpenFiles(-1) succeeded")
	}
}

// TestProcessCPUIsFinerThanTicks: 3 ms of one thread's CPU, by its own rusage, count as about
// that, not as the 0 or 10 ms that /proc/PID/stat's ticks would say. The comparison is per thread
// (the test's goroutine locked to it, RUSAGE_THREAD against that thread's schedstat): the whole
// process's figures also count the runtime's other threads, and on a loaded 2-core CI machine one
// whole-process try read 3.1 ms by rusage against 6.3 ms by the sum of schedstats, the GC's work
// landing in one and not yet the other. The process sum is checked to hold at least the thread's.
func TestProcessCPUIsFinerThanTicks(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const rusageThread = 1 // RUSAGE_THREAD, linux/include/uapi/linux/resource.h; not in syscall
	rusage := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(rusageThread, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	task := "/proc/" + strconv.Itoa(os.Getpid()) + "/task/" + strconv.Itoa(syscall.Gettid())
	// The process's reading first: it reads every thread's schedstat, which this thread's
	// window must not include (it made the window 1.2 ms longer than rusage's on a loaded
	// machine).
	procBefore, procOK := ProcessCPU(os.Getpid())
	before, ok := taskRunTime(task)
	if !ok || !procOK {
		t.Skip("no /proc schedstat")
	}
	ruBefore := rusage()
	x := 0
	for rusage()-ruBefore < 3*time.Millisecond {
		x++
	}
	used := rusage() - ruBefore
	after, _ := taskRunTime(task)
	procAfter, _ := ProcessCPU(os.Getpid())
	if d := after - before; d < used-time.Millisecond || d > used+time.Millisecond {
		t.Errorf("%v of this thread's CPU (rusage) counted as %v (%d loops)", used, d, x)
	}
	if d := procAfter - procBefore; d < used-time.Millisecond {
		t.Errorf("the process's CPU grew by %v while one of its threads used %v", d, used)
	}
}
