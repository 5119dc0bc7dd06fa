//go:build !unix

package idle

import "errors"

// raiseFDLimit: no descriptor limit to raise; the mode needs /proc anyway.
func raiseFDLimit() (soft, hard uint64, err error) {
	return 20000, 20000, errors.New("no RLIMIT_NOFILE on this system")
}
