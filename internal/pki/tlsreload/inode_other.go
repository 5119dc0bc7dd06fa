//go:build !unix

package tlsreload

import "os"

func inode(os.FileInfo) uint64 { return 0 }
