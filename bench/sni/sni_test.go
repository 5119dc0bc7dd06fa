package sni

import (
	"testing"

	"github.com/tendril-net/tendril/bench/internal/runtest"
)

// TestRunMini is an end-to-end run of the sni mode against direct and every
// installed peer: short, but through the same code as a full run.
func TestRunMini(t *testing.T) {
	runtest.Mini(t, Mode, nil)
}
