package idlemem

import (
	"os"
	"time"
)

// HeldQuiet is how long no read may have filled more than a page of a reader's buffers before
// Held drops their pages: DefaultEvery, so that the pages go with Run's first release after a
// load and the server is back at its idle RSS within the 60 s its goal allows.
const HeldQuiet = DefaultEvery

// pageSize is the system's memory page size.
var pageSize = os.Getpagesize()

// Held gives back the pages of buffers that one reader keeps between its reads, once its reads
// have been small for a while. wireguard-go's receive goroutine and TUN reader each keep the
// device's batch of 64 KiB message buffers for as long as the device lives and pass them to
// every read (tunnel/bind's ReceiveFunc, tunnel/netstack's Read): under a load every packet
// fills most of a buffer, and what a load touched stays resident (docs/performance.md, "Memory
// after a load against a settled idle") while an idle tunnel's heartbeats and keepalives touch
// one page each. Nothing else can give those pages back: the buffers are in use, so the Go
// runtime does not. The zero value is ready; not safe for concurrent use (one reader).
type Held struct {
	// large: a read filled more than a page since the last Waiting; quiet: since when none has;
	// dropped: the last time the pages were dropped.
	large          bool
	quiet, dropped time.Time
	now            func() time.Time // nil: time.Now; tests set a clock
}

// Filled notes a read of n bytes into one of the buffers.
func (h *Held) Filled(n int) {
	if n > pageSize {
		h.large = true
	}
}

// Waiting is called with the reader's buffers before it waits for its next read, their contents
// no longer needed. Once no read has filled more than a page for HeldQuiet, it drops the whole
// pages inside them from the resident set — they read as zeros afterwards and fault back in a
// page at a time when written — and does again every HeldQuiet while reads stay small (the
// reader's buffers change: wireguard-go swaps a filled one for another from its pool).
func (h *Held) Waiting(bufs [][]byte) {
	now := time.Now
	if h.now != nil {
		now = h.now
	}
	t := now()
	switch {
	case h.large || h.quiet.IsZero():
		h.large, h.quiet = false, t
	case t.Sub(h.quiet) >= HeldQuiet && t.Sub(h.dropped) >= HeldQuiet:
		h.dropped = t
		dropPages(bufs)
	}
}
