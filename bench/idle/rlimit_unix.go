//go:build unix

package idle

import (
	"fmt"
	"syscall"
)

// raiseFDLimit sets this process's soft RLIMIT_NOFILE to its hard limit and
// returns both. The peers it starts
// inherit the raised limit: Go raises its own soft limit at start, but gives
// children the original one unless the program set a limit itself.
func raiseFDLimit() (soft, hard uint64, err error) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return 0, 0, fmt.Errorf("getrlimit: %w", err)
	}
	cur := l.Cur
	l.Cur = l.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return cur, l.Max, fmt.Errorf("setrlimit to %d: %w", l.Max, err)
	}
	return l.Cur, l.Max, nil
}
