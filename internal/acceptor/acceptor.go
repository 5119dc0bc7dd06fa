// Package acceptor serves a listener's connections, each in its own goroutine, optionally at
// most a number at once, and drains them on shutdown: once the context ends it stops accepting,
// lets the connections being served finish for up to a drain timeout and closes the rest. It
// does not read or write the connections itself.
package acceptor

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/go-logr/logr"
)

// Server serves the connections of one listener.
type Server struct {
	// Handle serves one accepted connection; it is closed once Handle returns. Connections
	// Handle adds to conns (its upstream, say) are closed with the accepted ones on shutdown.
	Handle func(ctx context.Context, c net.Conn, conns *Conns)
	// Max caps the connections served at once; zero: no cap. A connection beyond it is passed
	// to Refused and closed at once.
	Max int
	// Refused, if set, is told of a connection refused for Max (before it is closed).
	Refused func(c net.Conn)
	// DrainTimeout is how long connections may continue once ctx ended.
	DrainTimeout time.Duration
	// Log receives the "Draining" line.
	Log logr.Logger

	once  sync.Once
	slots chan struct{}
}

func (s *Server) init() {
	s.once.Do(func() {
		if s.Max > 0 {
			s.slots = make(chan struct{}, s.Max)
		}
	})
}

// Active is the number of connections being served (counted only with Max).
func (s *Server) Active() int {
	s.init()
	return len(s.slots)
}

// Serve accepts on l and serves each connection until ctx ends or Accept fails; it closes l.
// When ctx ended it drains and returns nil; when Accept failed by itself it closes every
// connection, waits for the handlers and returns Accept's error.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	s.init()
	var wg sync.WaitGroup
	conns := newConns()
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var err error
	for {
		var c net.Conn
		c, err = l.Accept()
		if err != nil {
			break
		}
		if s.slots != nil {
			select {
			case s.slots <- struct{}{}:
			default:
				if s.Refused != nil {
					s.Refused(c)
				}
				c.Close()
				continue
			}
		}
		conns.Add(c)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if s.slots != nil {
				defer func() { <-s.slots }()
			}
			defer conns.Remove(c)
			s.Handle(ctx, c, conns)
		}()
	}
	if ctx.Err() == nil {
		l.Close()
		conns.closeAll()
		wg.Wait()
		return err
	}
	s.Log.Info("Draining", "connections", conns.len(), "timeout", s.DrainTimeout.String())
	drained := make(chan struct{})
	go func() {
		wg.Wait()
		close(drained)
	}()
	select {
	case <-drained:
	case <-time.After(s.DrainTimeout):
		conns.closeAll()
		<-drained
	}
	return nil
}

// Conns tracks open connections so that shutdown can close them.
type Conns struct {
	mu sync.Mutex
	m  map[net.Conn]struct{}
}

func newConns() *Conns { return &Conns{m: make(map[net.Conn]struct{})} }

// Add tracks c until Remove.
func (s *Conns) Add(c net.Conn) {
	s.mu.Lock()
	s.m[c] = struct{}{}
	s.mu.Unlock()
}

// Remove forgets c and closes it.
func (s *Conns) Remove(c net.Conn) {
	s.mu.Lock()
	delete(s.m, c)
	s.mu.Unlock()
	c.Close()
}

func (s *Conns) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

func (s *Conns) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.m {
		c.Close()
	}
}
