package machine

import (
	"os"
	"path/filepath"
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
