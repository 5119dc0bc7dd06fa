package tunnel

import (
	"os"
	"strconv"
	"strings"
)

// memory is a process's resident set: now and its peak.
type memory struct {
	RSS, Peak int64 // bytes
}

// readMemory reads VmRSS and VmHWM of pid.
func readMemory(pid int) (memory, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return memory{}, false
	}
	var m memory
	for l := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) < 1 {
			continue
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "VmRSS":
			m.RSS = kb << 10
		case "VmHWM":
			m.Peak = kb << 10
		}
	}
	return m, m.RSS > 0
}
