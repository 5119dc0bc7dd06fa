// Package inflight keeps track of the connections a benchmark has open, so
// that the end of a measurement, or the close of a server the benchmark runs,
// can end them at once whatever they are blocked in: a Slot is the one
// connection a load worker has in flight, a Set the connections a server or
// relay of the benchmark's own serves.
//
// It only records and interrupts connections. It does not dial, accept,
// read or write, and does not wait for the goroutines that use them: its
// users keep their own WaitGroups.
package inflight

import (
	"net"
	"sync"
	"time"
)

// Slot is a worker's connection in flight. The mutex is per worker, so it is
// not contended on the hot path. The zero value is an empty Slot.
type Slot struct {
	mu      sync.Mutex
	c       net.Conn
	aborted bool
}

// Set makes c the connection in flight; false means the Slot was aborted, c
// is not recorded and must not be used (its owner closes it).
func (s *Slot) Set(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.aborted {
		return false
	}
	s.c = c
	return true
}

// Clear forgets the connection in flight; its owner closes it.
func (s *Slot) Clear() {
	s.mu.Lock()
	s.c = nil
	s.mu.Unlock()
}

// Aborted reports whether Abort or Expire was called: an error of the
// connection after it is the measurement's end, not a failure.
func (s *Slot) Aborted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.aborted
}

// Abort closes the connection in flight and makes every later Set fail.
func (s *Slot) Abort() {
	if c := s.stop(); c != nil {
		c.Close()
	}
}

// Expire makes the pending I/O of the connection in flight return now with
// a timeout, by a deadline in the past, and every later Set fail. Unlike
// Abort it leaves the connection open: the error is a timeout, and its owner
// closes it as after any other failure.
func (s *Slot) Expire() {
	if c := s.stop(); c != nil {
		c.SetDeadline(time.Unix(1, 0))
	}
}

// stop marks the Slot aborted and returns the connection in flight. The
// caller interrupts it outside the lock: a Close may take a while, and Set
// can no longer replace it.
func (s *Slot) stop() net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.aborted = true
	return s.c
}

// Set is the open connections of a server or relay. The zero value is an
// empty, open Set.
type Set struct {
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// Add records cs and reports true, or reports false and records nothing once
// the Set is closed: the caller then closes cs itself.
func (s *Set) Add(cs ...net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if s.conns == nil {
		s.conns = make(map[net.Conn]struct{})
	}
	for _, c := range cs {
		s.conns[c] = struct{}{}
	}
	return true
}

// Remove forgets cs without closing them.
func (s *Set) Remove(cs ...net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range cs {
		delete(s.conns, c)
	}
}

// Done forgets c and closes it: the end of a connection's handler.
func (s *Set) Done(c net.Conn) {
	s.Remove(c)
	c.Close()
}

// Reset closes every connection recorded and forgets them; the Set goes on
// recording new ones.
func (s *Set) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeAll()
}

// Close closes every connection recorded, and makes every later Add fail.
func (s *Set) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.closeAll()
}

func (s *Set) closeAll() {
	for c := range s.conns {
		c.Close()
	}
	clear(s.conns)
}
