//go:build !linux

package idlemem

// ReleaseBinaryPages does nothing outside Linux (see pages_linux.go).
func ReleaseBinaryPages() (int, error) { return 0, nil }

// dropPages does nothing outside Linux.
func dropPages([][]byte) {}
