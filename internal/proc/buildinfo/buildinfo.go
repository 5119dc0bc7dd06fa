// Package buildinfo holds the version a release build stamps into every binary (make build sets
// both variables with -ldflags -X), so that `--version` of any tendril binary names the image it
// came from. -buildvcs=false keeps Go's own VCS stamp out: the revision comes from here, the
// same in a Docker build without .git as in `make build`.
package buildinfo

import (
	"fmt"
	"runtime"
)

// Version and Revision are set at link time:
//
//	-ldflags "-X github.com/tendril-net/tendril/internal/buildinfo.Version=v0.1.0
//	          -X github.com/tendril-net/tendril/internal/buildinfo.Revision=<commit>"
//
// A plain `go build` leaves them as below.
var (
	Version  = "devel"
	Revision = "unknown"
)

// String is what `PROGRAM --version` prints: the program, its version, the commit and the Go
// toolchain and platform it was built with.
func String(program string) string {
	return fmt.Sprintf("%s %s (revision %s, %s %s/%s)", program, Version, Revision, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
