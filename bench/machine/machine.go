// Package machine describes the host a benchmark runs on, for the header of a
// report: CPU model, core count, kernel, Go version.
//
// It only reads what the system already exposes (/proc/cpuinfo,
// /proc/sys/kernel, /proc/loadavg); it does not measure anything and does not
// fail: a fact it cannot find is reported as "unknown".
package machine

import (
	"bufio"
	"os"
	"runtime"
	"strings"
)

// Description is what a report says about the machine.
type Description struct {
	CPUModel   string `json:"cpu_model"`
	Cores      int    `json:"cores"`       // logical CPUs usable by this process
	GOMAXPROCS int    `json:"gomaxprocs"`  // Go's view of the same, after cgroup limits
	Kernel     string `json:"kernel"`      // e.g. "Linux 6.1.0-18-amd64"
	GoVersion  string `json:"go_version"`  // runtime.Version() of the benchmark binary
	GOOSARCH   string `json:"goos_goarch"` // e.g. "linux/amd64"
}

// Describe returns the description of the current machine.
func Describe() Description {
	return Description{
		CPUModel:   cpuModel("/proc/cpuinfo"),
		Cores:      runtime.NumCPU(),
		GOMAXPROCS: runtime.GOMAXPROCS(0),
		Kernel:     kernel(),
		GoVersion:  runtime.Version(),
		GOOSARCH:   runtime.GOOS + "/" + runtime.GOARCH,
	}
}

// LoadAverage returns the 1, 5 and 15 minute load averages as the kernel
// prints them ("0.52 0.58 0.59"), or "unknown". A benchmark records it
// before and after a run: on a machine shared with other work, a high load
// says the figures are noisy.
func LoadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// cpuModel returns the first "model name" of a cpuinfo file.
func cpuModel(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

func kernel() string {
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	typ, rel := read("/proc/sys/kernel/ostype"), read("/proc/sys/kernel/osrelease")
	if typ == "" && rel == "" {
		return "unknown"
	}
	return strings.TrimSpace(typ + " " + rel)
}
