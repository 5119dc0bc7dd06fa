// Package logging builds the structured logger every tendril binary writes to stderr: one JSON
// object per line, with a verbosity threshold. It does not configure anything else.
package logging

import (
	"io"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
)

// New returns a JSON logger writing to w that keeps messages up to verbosity v.
func New(w io.Writer, v int) logr.Logger {
	return funcr.NewJSON(func(obj string) {
		_, _ = io.WriteString(w, obj+"\n")
	}, funcr.Options{Verbosity: v, LogTimestamp: true, TimestampFormat: "2006-01-02T15:04:05.000Z07:00"})
}
