// Package accept is the connection edge's accept loop for connections served by goroutines: it
// serves a listener's connections, each in its own goroutine, optionally at most a number at
// once in all and per source address, tracks them (and whatever else their handlers open) so that shutdown can close them, and
// drains them. tendril-server's CONNECT and tunnel front-ends, the apiserver-proxy and the egress
// relay's CONNECT socket and tunnel/tundev's redirected connections are each a Server with its
// own Handle; a listener that gRPC serves
// itself (the egress relay's konnectivity socket) takes the cap alone (Limit); the ingress
// accepts on package loops' event loops instead and tracks what it hands to goroutines in a
// Conns, pausing failed accepts with Pause. LimitedLog logs the refusals without letting a flood
// flood the log. It does not read or write the connections itself, and it knows no protocol.
//
// Lifecycle of a Server: Serve accepts until one of these, and then returns once every handler
// has returned:
//   - ctx ends: it closes the listener, lets the connections being served go on for up to
//     DrainTimeout (none: they are closed at once), closes the rest and returns nil;
//   - the listener is closed by its owner (StopAccepting): it accepts nothing more, the
//     connections go on until they end by themselves or ctx ends (then as above), and it
//     returns nil;
//   - Accept fails by itself: it closes every connection and returns Accept's error, unless
//     RetryAccept, which logs the error and accepts again after a pause.
//
// CloseAll closes the listener and every tracked connection at any time, for an owner that runs
// its own drain (the ingress drains all its listeners at once).
//
// Memory: a tracked connection costs a map entry (about 50 bytes with the table's share); the
// map gives its table back after a peak (a flood of handshakes) once it holds less than a
// quarter of it. With MaxPerSource, a source with a connection open costs another entry (about
// 64 bytes). The goroutine per connection is Handle's.
package accept

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/go-logr/logr"
)

// Server serves the connections of one listener, once. Handle is required; the other fields'
// zero values work: no cap, no drain, an Accept error ends Serve, logs discarded.
type Server struct {
	// Handle serves one accepted connection; it is closed once Handle returns, unless Handle
	// handed it over to another owner with conns.Forget. Connections Handle adds to conns (its
	// upstream, say) are closed with the accepted ones on shutdown. ctx ends when the connections
	// are closed: at once when Serve's ctx ends without DrainTimeout, at the drain's end with it,
	// or when Accept failed and Serve closes everything.
	Handle func(ctx context.Context, c net.Conn, conns *Conns)
	// Max caps the connections served at once; zero: no cap. A connection beyond it is passed
	// to Refused (RefusedMax) and closed at once.
	Max int
	// MaxPerSource caps the connections of one source (SourceKey: an IPv4 address, an IPv6 /64)
	// served at once, so that one client cannot take all of Max; zero: no cap. A peer without an
	// IP address (a Unix socket's) is not counted. A connection beyond it is passed to Refused
	// (RefusedSource) and closed at once.
	MaxPerSource int
	// Refused, if set, is told of a connection refused for a bound, with the bound's reason
	// (before it is closed): count and log it.
	Refused func(c net.Conn, reason string)
	// Abort, if set, is how the Server closes the connections it closes itself: those it refuses
	// and those still open when it shuts them down (tunnel/tundev resets them, as the real
	// destination would have). Zero: Close.
	Abort func(c net.Conn)
	// DrainTimeout is how long connections may continue once ctx ended; zero: they are closed
	// at once.
	DrainTimeout time.Duration
	// RetryAccept makes an Accept error other than the listener's closing (out of file
	// descriptors, say) a logged pause rather than the end of Serve: acceptPauseMin doubling
	// to acceptPauseMax, as net/http does, so that the loop does not spin while the
	// connections being served go on.
	RetryAccept bool
	// Log receives the "Draining" and "Accept failed" lines.
	Log logr.Logger

	once    sync.Once
	slots   chan struct{}
	sources sources
	conns   Conns
	mu      sync.Mutex
	l       net.Listener // the listener being served, for StopAccepting and CloseAll
	// stopped: StopAccepting or CloseAll was called; a Serve that starts later closes its
	// listener at once.
	stopped bool
}

// Reasons a Server refuses a connection, Refused's reason.
const (
	RefusedMax    = "too_many"     // Max connections are being served
	RefusedSource = "source_limit" // MaxPerSource connections of its source are being served
)

// The pause after a failed Accept, with RetryAccept: it doubles from the minimum at every
// failure in a row, up to the maximum.
const (
	acceptPauseMin = 5 * time.Millisecond
	acceptPauseMax = time.Second
)

// Pause logs a failed accept and waits before the next: *pause doubles from acceptPauseMin at
// every failure in a row (the caller zeroes it after a success), up to acceptPauseMax. It reports
// false if ctx ended first. For an owner with an accept loop of its own (the ingress's, on the
// relay loops).
func Pause(ctx context.Context, log logr.Logger, err error, pause *time.Duration) bool {
	*pause = min(max(2**pause, acceptPauseMin), acceptPauseMax)
	log.Error(err, "Accept failed", "retryIn", pause.String())
	t := time.NewTimer(*pause)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (s *Server) init() {
	s.once.Do(func() {
		if s.Max > 0 {
			s.slots = make(chan struct{}, s.Max)
		}
		s.conns.m = make(map[net.Conn]struct{})
		s.conns.abort = s.Abort
	})
}

// Active is the number of connections being served (counted only with Max).
func (s *Server) Active() int {
	s.init()
	return len(s.slots)
}

// Sources is the number of sources with a connection being served (counted only with
// MaxPerSource).
func (s *Server) Sources() int { return s.sources.len() }

// Open is the number of connections tracked: accepted ones not yet ended or handed over, and
// those their handlers added.
func (s *Server) Open() int {
	s.init()
	return s.conns.Len()
}

// StopAccepting closes the listener: the kernel refuses new connections from now on, and Serve
// returns once the connections being served have ended (or ctx ends and they are drained).
func (s *Server) StopAccepting() {
	s.mu.Lock()
	s.stopped = true
	l := s.l
	s.mu.Unlock()
	if l != nil {
		_ = l.Close()
	}
}

// CloseAll closes the listener and every tracked connection and returns how many connections it
// closed. From then on conns.Add refuses (and closes) what a handler adds.
func (s *Server) CloseAll() int {
	s.init()
	s.StopAccepting()
	return s.conns.closeAll()
}

// Serve accepts on l and serves each connection until ctx ends, l is closed or Accept fails (see
// the package's lifecycle); it closes l.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	s.init()
	s.mu.Lock()
	s.l = l
	stopped := s.stopped
	s.mu.Unlock()
	if stopped {
		_ = l.Close()
	}
	// hctx is the handlers' context: ctx's values, cancelled once the connections are closed (a
	// drain over, or Accept failed by itself), not when ctx ends: a connection being drained goes
	// on with what its handler opened under hctx (the egress relay's gRPC stream, say).
	hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	if err := s.accept(ctx, l, func(c net.Conn, release func()) {
		wg.Go(func() {
			defer release()
			defer func() {
				if s.conns.Forget(c) {
					c.Close()
				}
			}()
			s.Handle(hctx, c, &s.conns)
		})
	}); err != nil {
		l.Close()
		cancel()
		s.conns.closeAll()
		wg.Wait()
		return err
	}
	drained := make(chan struct{})
	go func() {
		wg.Wait()
		close(drained)
	}()
	if ctx.Err() == nil { // l was closed by its owner: the connections go on
		select {
		case <-drained:
			return nil
		case <-ctx.Done():
		}
	}
	if s.DrainTimeout <= 0 {
		cancel()
		s.conns.closeAll()
		<-drained
		return nil
	}
	s.Log.Info("Draining", "connections", s.conns.Len(), "timeout", s.DrainTimeout.String())
	t := time.NewTimer(s.DrainTimeout)
	defer t.Stop()
	select {
	case <-drained:
	case <-t.C:
		cancel()
		s.conns.closeAll()
		<-drained
	}
	return nil
}

// accept hands every connection it accepts on l to serve, within the bounds, with the function
// that gives its places back, until ctx ends or l is closed (nil) or Accept fails by itself (its
// error).
func (s *Server) accept(ctx context.Context, l net.Listener, serve func(c net.Conn, release func())) error {
	var pause time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			if !s.RetryAccept {
				return err
			}
			if !Pause(ctx, s.Log, err, &pause) {
				return nil
			}
			continue
		}
		pause = 0
		release, reason := s.admit(c)
		if reason != "" {
			if s.Refused != nil {
				s.Refused(c, reason)
			}
			s.conns.close(c)
			continue
		}
		if !s.conns.Add(c) { // CloseAll was called: c is closed
			release()
			return nil
		}
		serve(c, release)
	}
}

// admit takes c's places within Max and MaxPerSource and returns the function that gives them
// back, or the reason of the bound it is beyond.
func (s *Server) admit(c net.Conn) (release func(), reason string) {
	if s.slots != nil {
		select {
		case s.slots <- struct{}{}:
		default:
			return nil, RefusedMax
		}
	}
	key, counted := remoteKey(c)
	counted = counted && s.MaxPerSource > 0
	if counted && !s.sources.take(key, s.MaxPerSource) {
		if s.slots != nil {
			<-s.slots
		}
		return nil, RefusedSource
	}
	return func() {
		if counted {
			s.sources.release(key)
		}
		if s.slots != nil {
			<-s.slots
		}
	}, ""
}

// Conns tracks open connections so that shutdown can close them. Once closed (CloseAll, or the
// end of a drain) it tracks nothing more: Add closes what it is given.
type Conns struct {
	mu sync.Mutex
	// m is nil once closed. peak is its largest size since it was last rebuilt (a Go map keeps
	// the table of its peak).
	m    map[net.Conn]struct{}
	peak int
	// abort closes what the Conns closes itself (Server.Abort); nil: Close.
	abort func(net.Conn)
}

// NewConns returns an empty, open Conns, for an owner that tracks connections outside a Server.
func NewConns() *Conns { return &Conns{m: map[net.Conn]struct{}{}} }

// CloseAll closes every tracked connection, stops tracking (Add refuses from now on), and
// returns how many it closed.
func (s *Conns) CloseAll() int { return s.closeAll() }

// Add tracks c until Remove or Forget and reports true; once the connections have been closed
// it closes c and reports false.
func (s *Conns) Add(c net.Conn) bool {
	s.mu.Lock()
	if s.m == nil {
		s.mu.Unlock()
		s.close(c)
		return false
	}
	s.m[c] = struct{}{}
	s.peak = max(s.peak, len(s.m))
	s.mu.Unlock()
	return true
}

// Remove forgets c and closes it.
func (s *Conns) Remove(c net.Conn) {
	s.Forget(c)
	c.Close()
}

// Forget stops tracking c without closing it, and reports whether it was tracked: a handler
// hands its connection over to another owner this way (the ingress's relay loops, the tunnel),
// and that owner closes it.
func (s *Conns) Forget(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[c]; !ok {
		return false
	}
	delete(s.m, c)
	if s.peak >= 1024 && len(s.m) < s.peak/4 {
		// After a peak, give the table back: a copy is sized for what is left.
		m := make(map[net.Conn]struct{}, len(s.m))
		for k, v := range s.m {
			m[k] = v
		}
		s.m, s.peak = m, len(m)
	}
	return true
}

// Len is the number of connections tracked.
func (s *Conns) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// closeAll closes every tracked connection, stops tracking, and returns how many it closed.
func (s *Conns) closeAll() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.m)
	for c := range s.m {
		s.close(c)
	}
	s.m = nil
	return n
}

// close closes c the way the Conns closes what it closes itself.
func (s *Conns) close(c net.Conn) {
	if s.abort != nil {
		s.abort(c)
		return
	}
	c.Close()
}
