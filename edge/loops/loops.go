// Package loops joins TCP connection pairs on a few epoll event loops, so that an idle pair holds
// nothing but its sockets, and dials upstreams for them (Join, JoinDialed, Dial). Loops also
// accept (Serve): a connection's first bytes are read on a loop and a Handshaker decides where it
// goes, so a new connection takes no goroutine either. It does not parse or count anything
// itself: the Handshaker does. Without epoll (not Linux) each pair runs package pipe's Pipe on a
// goroutine.
package loops

import (
	"errors"
	"sync/atomic"
)

// LoopsConfig configures Loops. The zero value works.
type LoopsConfig struct {
	// Loops is the number of event loops. If zero, GOMAXPROCS: each loop is one goroutine
	// moving bytes when its sockets are ready, so more than the CPUs only adds switches.
	// Ignored without epoll (not Linux).
	Loops int
}

// Group is a set of pairs closed together (a listener's, on shutdown). The zero value is an
// empty, open group.
type Group struct {
	open   atomic.Int64
	shakes atomic.Int64
	closed atomic.Bool
}

// Len reports how many of the group's pairs are open.
func (g *Group) Len() int { return int(g.open.Load()) }

// Handshakes reports how many of the group's accepted connections are in their handshake (read
// or dialing for, on the loops).
func (g *Group) Handshakes() int { return int(g.shakes.Load()) }

// ErrClosed is returned by Join once the Loops or the group are closed.
var ErrClosed = errors.New("relay loops closed")
