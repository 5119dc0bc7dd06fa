//go:build unix

package tlsreload

import (
	"os"
	"syscall"
)

// inode is a file's inode number: a file replaced by rename can keep size and time stamp.
func inode(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Ino) //nolint:unconvert // int64 on some platforms
	}
	return 0
}
