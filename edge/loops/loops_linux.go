package loops

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Loops joins TCP connection pairs on a few epoll event loops, one thread each, instead of two
// goroutines per pair as Pipe does. An idle pair then costs its two sockets and about 400 bytes
// (the pair, two map entries, the caller's done func): no goroutine stack (2 × 8 KiB once a
// goroutine has grown), no pipe pair for splice(2) (2 fds and 2 kernel pipe buffers per
// direction), no copy buffer. A seed ingress holds tens of thousands of idle watches, so what
// Pipe costs per connection adds up (docs/performance.md, "Ingress connections: what an idle
// one costs, and a new one").
//
// Bytes move through one read buffer per loop: a read of up to loopBuffer bytes is written on at
// once; what the destination does not take is kept in a pooled buffer for that direction, and the
// source is not read again until it has been written (back-pressure, as Pipe has). So a pair
// holds a buffer only while its destination is slower than its source.
//
// The semantics are Pipe's, except for the idle timeout: a pair is idle when neither direction
// has moved a byte for the pair's idle time (Envoy's tcp_proxy idle_timeout), so a watch whose
// client never sends lives as long as events arrive.
type Loops struct {
	loops []*loop
	next  atomic.Uint32
	wg    sync.WaitGroup
	once  sync.Once
}

// loopBuffer is each loop's read buffer and the size of a direction's pending buffer: 64 KiB is
// what one read of a TCP socket typically returns on a fast local path, so a bulk transfer moves
// in few system calls, and at most one per direction is held by a stalled destination.
const loopBuffer = 64 << 10

// pumpBudget bounds the bytes one pair moves before the loop turns to the other pairs' events:
// 16 reads of loopBuffer, so a bulk transfer keeps the system call count low without making the
// loop's other pairs wait more than about a millisecond.
const pumpBudget = 16 * loopBuffer

// maxSweep is the longest time between two checks of the loop's idle timeouts; a pair ends
// between its idle time and that plus the loop's sweep interval, a 64th of the shortest idle time
// of its pairs within [minSweep, maxSweep]: 56 s for the routes' 1 h. A sweep visits every pair,
// which is cheap enough (BenchmarkIdleSweep; docs/performance.md, "Ingress connections") that a
// replica holding 100,000 idle connections spends under 0.01% of a core on it.
const (
	maxSweep = time.Minute
	minSweep = 10 * time.Millisecond
)

// pending are the buffers of directions whose destination has not taken everything read.
var pending = sync.Pool{New: func() any { return new([loopBuffer]byte) }}

// NewLoops starts the event loops. Close stops them.
func NewLoops(cfg LoopsConfig) (*Loops, error) {
	n := cfg.Loops
	if n <= 0 {
		n = runtime.GOMAXPROCS(0)
	}
	ls := &Loops{}
	for range n {
		l, err := newLoop()
		if err != nil {
			ls.Close()
			return nil, err
		}
		ls.loops = append(ls.loops, l)
		ls.wg.Add(1)
		go func() {
			defer ls.wg.Done()
			l.run()
		}()
	}
	return ls, nil
}

// Join hands a and b (TCP connections) to the loops and returns at once. From then on the loops
// own them: the caller must not use a or b again (they are closed here; the loops move bytes on
// duplicates of their sockets). first is written to b before anything read from a: the bytes the
// caller read from a while deciding where it goes. done is called exactly once, after both sockets
// are closed, with the bytes moved each way (first included): on a loop's goroutine while it holds
// its lock, so done must be quick and must not call into Loops. On error a and b are closed and
// done is not called.
func (ls *Loops) Join(g *Group, a, b net.Conn, first []byte, idle time.Duration, done func(aToB, bToA int64)) error {
	fa, err := takeFD(a)
	if err != nil {
		b.Close()
		return err
	}
	fb, err := takeFD(b)
	if err != nil {
		rawClose(fa)
		return err
	}
	l := ls.pick()
	l.mu.Lock()
	defer l.mu.Unlock()
	_, err = l.join(g, sock{fd: fa, writable: true}, sock{fd: fb, writable: true}, true, true, first, idle, done)
	return err
}

// JoinDialed is Join for an upstream the loops dialed: b is consumed (closed on error).
func (ls *Loops) JoinDialed(g *Group, a net.Conn, b *Socket, first []byte, idle time.Duration, done func(aToB, bToA int64)) error {
	fa, err := takeFD(a)
	if err != nil {
		b.Close()
		return err
	}
	l := b.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if b.closed {
		rawClose(fa)
		return ErrClosed
	}
	b.closed = true
	delete(l.dialing, int32(b.fd))
	p, err := l.join(g, sock{fd: fa, writable: true}, sock{fd: b.fd, readable: b.readable, ended: b.ended, writable: true, outArmed: true}, true, false, first, idle, done)
	if err == nil {
		// b's connect was its last writable edge: no event will come for the first bytes.
		l.pump(p, p.last)
	}
	return err
}

func (ls *Loops) pick() *loop { return ls.loops[ls.next.Add(1)%uint32(len(ls.loops))] }

// join makes the pair of a and b on l, registering those that are not registered already (a
// dialed socket, an accepted one read on the loop: their readiness comes with them). l.mu is held.
// The caller pumps the pair when its sockets will bring no new edge for what is to move.
func (l *loop) join(g *Group, a, b sock, registerA, registerB bool, first []byte, idle time.Duration, done func(aToB, bToA int64)) (*pair, error) {
	fa := a.fd
	if l.closing || g.closed.Load() {
		rawClose(fa)
		rawClose(b.fd)
		return nil, ErrClosed
	}
	p := &pair{g: g, idle: idle, done: done, a: a, b: b}
	p.a.p = p
	p.b.p = p
	p.ab.src, p.ab.dst = &p.a, &p.b
	p.ba.src, p.ba.dst = &p.b, &p.a
	p.ab.pend = first
	p.last = l.now()
	if idle > 0 && (l.minIdle == 0 || idle < l.minIdle) {
		l.minIdle = idle
		// The loop may be waiting out a longer sweep interval.
		l.wakeBy(l.now() + l.sweepEvery())
	}
	if registerA {
		if err := l.register(fa, false); err != nil {
			rawClose(fa)
			rawClose(b.fd)
			return nil, err
		}
	}
	if registerB {
		if err := l.register(b.fd, false); err != nil {
			rawClose(fa) // also leaves the epoll set
			rawClose(b.fd)
			return nil, err
		}
	}
	l.socks[int32(fa)], l.socks[int32(b.fd)] = &p.a, &p.b
	l.peak = max(l.peak, len(l.socks))
	g.open.Add(1)
	return p, nil
}

// register adds fd to the loop's epoll set, edge-triggered, for reading (and hang-ups), and for
// writing too if out (a socket being connected: its first writable edge ends the connect). The
// loop remembers readiness until a read or write says EAGAIN; a socket is taken as writable until
// a write says otherwise, and only then asks for writable edges (armOut). A socket registered for
// writing from the start reports a writable edge at once, which wakes the loop for nothing on
// every connection; most small exchanges never fill a socket.
func (l *loop) register(fd int, out bool) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	if out {
		ev.Events |= unix.EPOLLOUT
	}
	if err := rawEpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	return nil
}

// armOut asks for s's writable edges from now on: a write said EAGAIN. The change reports the
// socket's state at once, so an edge that came before it is not lost.
func (l *loop) armOut(s *sock) bool {
	if s.outArmed {
		return true
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(s.fd)}
	if err := rawEpollCtl(l.epfd, unix.EPOLL_CTL_MOD, s.fd, &ev); err != nil {
		return false
	}
	s.outArmed = true
	return true
}

// Socket is a TCP connection the loops are dialing or have dialed, not yet joined. Its owner
// joins it (JoinDialed) or closes it.
type Socket struct {
	l  *loop
	fd int
	// result receives the connect's outcome once.
	result chan error
	// Guarded by l.mu: readiness seen while dialing, and whether the socket has been handed on
	// or closed.
	readable, ended, reported, closed bool
}

// Dial connects to addr from a non-blocking socket that one loop watches, without Go's poller:
// the socket goes to the pair as it is (no duplicate, no keepalive options; TCP_NODELAY as Go
// sets it). It returns when the connection is established, refused, or ctx ends.
func (ls *Loops) Dial(ctx context.Context, addr netip.AddrPort) (*Socket, error) {
	// A context already done dials nothing: without this check a refusal that arrived as fast
	// as the cancellation (loopback) raced it in the select below.
	if err := ctx.Err(); err != nil {
		return nil, dialError(addr, err)
	}
	fd, err := connect(addr)
	if err != nil {
		return nil, dialError(addr, err)
	}
	l := ls.pick()
	d := &Socket{l: l, fd: fd, result: make(chan error, 1)}
	l.mu.Lock()
	if l.closing {
		l.mu.Unlock()
		rawClose(fd)
		return nil, ErrClosed
	}
	// Registered before the connect completes or right after: either way the first writable
	// (or error) edge reports it.
	if err := l.register(fd, true); err != nil {
		l.mu.Unlock()
		rawClose(fd)
		return nil, err
	}
	l.dialing[int32(fd)] = d
	l.mu.Unlock()
	select {
	case err := <-d.result:
		if err != nil {
			d.Close()
			return nil, dialError(addr, err)
		}
		return d, nil
	case <-ctx.Done():
		d.Close()
		return nil, dialError(addr, ctx.Err())
	}
}

func dialError(addr netip.AddrPort, err error) error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(addr), Err: err}
}

// Close closes a socket that was not joined; after JoinDialed it does nothing.
func (d *Socket) Close() {
	d.l.mu.Lock()
	defer d.l.mu.Unlock()
	if d.closed {
		return
	}
	d.closed = true
	delete(d.l.dialing, int32(d.fd))
	rawClose(d.fd)
}

// dialEvent handles an event of a socket being dialed: the first writable, hang-up or error edge
// ends the connect; a readable edge is remembered for the pair. l.mu is held.
func (l *loop) dialEvent(d *Socket, events uint32) {
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		d.readable = true
	}
	if events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		d.ended = true
	}
	if d.reported || events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
		return
	}
	d.reported = true
	d.result <- connectResult(d.fd)
}

// CloseGroup closes every pair of g (calling their done funcs) and every connection of g in its
// handshake, and refuses new ones for it; it returns how many connections it closed.
func (ls *Loops) CloseGroup(g *Group) int {
	g.closed.Store(true)
	n := 0
	for _, l := range ls.loops {
		l.mu.Lock()
		n += l.closeWhere(func(p *pair) bool { return p.g == g })
		n += l.closeShakes(func(hs *Handshake) bool { return hs.g == g })
		l.mu.Unlock()
	}
	return n
}

// Close closes every pair and stops the loops, and returns once they have stopped.
func (ls *Loops) Close() {
	ls.once.Do(func() {
		for _, l := range ls.loops {
			l.mu.Lock()
			l.closing = true
			l.mu.Unlock()
			// Wakes run from Go's poller (the close itself waits until run is out of
			// epoll_wait); run closes the pairs.
			_ = l.file.SetReadDeadline(time.Now())
		}
		ls.wg.Wait()
	})
}

// takeFD returns a duplicate of c's socket and closes c, which leaves the duplicate the only
// reference: it is non-blocking (the flag belongs to the shared open file) and in no poller.
func takeFD(c net.Conn) (int, error) {
	defer c.Close()
	sc, ok := c.(syscall.Conn)
	if !ok {
		return -1, fmt.Errorf("relay: %T has no socket", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(f uintptr) { fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, fmt.Errorf("dup: %w", derr)
	}
	return fd, nil
}

// loop is one event loop: an epoll instance, the sockets registered in it and its read buffer.
// Everything but epfd and file is guarded by mu, which the loop holds while it handles a batch
// of events and releases while it waits.
type loop struct {
	epfd int
	// file is epfd in Go's poller; closing it ends run.
	file  *os.File
	start time.Time

	mu    sync.Mutex
	socks map[int32]*sock
	// dialing are the sockets Dial is connecting and their owners have not joined or closed.
	dialing map[int32]*Socket
	// shakes are the accepted connections in their handshake, upstreams the sockets dialed for
	// them, timers their deadlines; wake is the deadline set on file (since start; 0: none
	// earlier than the sweep's).
	shakes    map[int32]*Handshake
	upstreams map[int32]*Handshake
	timers    timers
	wake      time.Duration
	// peak is the most sockets socks held since it was last rebuilt: a Go map keeps the table
	// of its largest size, and after a peak of connections that is most of an idle loop's memory.
	peak    int
	again   []*pair // pairs that used their budget with bytes left to read
	minIdle time.Duration
	closing bool
	buf     []byte
}

type pair struct {
	g      *Group
	a, b   sock
	ab, ba direction
	idle   time.Duration
	last   time.Duration // since l.start, when a byte last moved
	done   func(aToB, bToA int64)
	closed bool
	queued bool // in l.again
}

// sock is one side of a pair with the readiness the loop last learned for it: set by an event,
// cleared by EAGAIN.
type sock struct {
	fd                 int
	p                  *pair
	readable, writable bool
	// outArmed: the socket is registered for writable edges (armOut).
	outArmed bool
	// ended: an event said the peer finished or failed (RDHUP, HUP, ERR). Until then a read
	// shorter than the buffer has emptied the socket, and bytes arriving after it bring a new
	// edge, so the loop does not read again just to be told EAGAIN (a third of the reads).
	ended bool
}

// direction is one direction of a pair.
type direction struct {
	src, dst *sock
	// pend are bytes read from src that dst has not taken yet; src is not read while there are.
	pend []byte
	// buf is pend's pooled backing array, if it has one.
	buf *[loopBuffer]byte
	eof bool // src reached end of stream
	// shut: dst's write side was shut after eof, this direction is over.
	shut bool
	n    int64
}

func newLoop() (*loop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	// Non-blocking, so os.NewFile hands it to Go's poller: the loop waits there (run).
	if err := unix.SetNonblock(epfd, true); err != nil {
		rawClose(epfd)
		return nil, fmt.Errorf("epoll fd: %w", err)
	}
	return &loop{epfd: epfd, file: os.NewFile(uintptr(epfd), "epoll"), start: time.Now(),
		socks: map[int32]*sock{}, dialing: map[int32]*Socket{}, shakes: map[int32]*Handshake{}, upstreams: map[int32]*Handshake{},
		buf: make([]byte, loopBuffer)}, nil
}

func (l *loop) now() time.Duration { return time.Since(l.start) }

// run waits for events and moves bytes until the loop is closing; then it closes its pairs.
func (l *loop) run() {
	defer l.file.Close()
	rc, err := l.file.SyscallConn()
	if err != nil {
		l.mu.Lock()
		l.stop()
		l.mu.Unlock()
		return
	}
	events := make([]unix.EpollEvent, 256)
	var lastSweep time.Duration
	for {
		l.mu.Lock()
		// The loop is a goroutine parked in Go's poller until the epoll set has events (the
		// epoll descriptor is readable then), not a thread blocked in epoll_wait: no thread
		// hand-off per wake-up, and the scheduler runs it like any other goroutine. The
		// deadline wakes it for the idle sweep or the first handshake's deadline.
		l.wake = l.now() + l.sweepEvery()
		if len(l.timers) > 0 {
			l.wake = min(l.wake, l.timers[0].deadline)
		}
		_ = l.file.SetReadDeadline(l.start.Add(l.wake))
		l.mu.Unlock()
		err := rc.Read(func(uintptr) bool {
			for {
				n, err := rawEpollWait(l.epfd, events)
				if err != nil && err != unix.EINTR {
					return true // only a closed or broken epoll descriptor
				}
				l.mu.Lock()
				if l.closing {
					l.mu.Unlock()
					return true
				}
				now := l.now()
				l.handle(events[:max(n, 0)], now)
				l.expire(now)
				l.sweep(&lastSweep, now)
				more := n == len(events) || len(l.again) > 0
				l.mu.Unlock()
				if !more {
					return false // wait for the next event
				}
			}
		})
		l.mu.Lock()
		if l.closing || (err != nil && !errors.Is(err, os.ErrDeadlineExceeded)) {
			l.stop()
			l.mu.Unlock()
			return
		}
		now := l.now()
		l.expire(now)
		l.sweep(&lastSweep, now)
		l.mu.Unlock()
	}
}

// sweep closes the idle pairs if a sweep interval has passed since *last. l.mu is held.
func (l *loop) sweep(last *time.Duration, now time.Duration) {
	if now-*last < l.sweepEvery() {
		return
	}
	*last = now
	l.closeWhere(func(p *pair) bool { return p.idle > 0 && now-p.last >= p.idle })
}

// sweepEvery is the time between two idle sweeps (see maxSweep). l.mu is held.
func (l *loop) sweepEvery() time.Duration {
	if l.minIdle > 0 {
		return min(maxSweep, max(l.minIdle/64, minSweep))
	}
	return maxSweep
}

// handle takes a batch of events and then the pairs that used their budget. l.mu is held.
func (l *loop) handle(events []unix.EpollEvent, now time.Duration) {
	for _, ev := range events {
		s := l.socks[ev.Fd]
		if s == nil {
			l.otherEvent(ev)
			continue
		}
		if ev.Events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			s.readable = true
		}
		if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			s.ended = true
		}
		if ev.Events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			s.writable = true
		}
		l.pump(s.p, now)
	}
	again := l.again
	l.again = nil
	for _, p := range again {
		p.queued = false
		l.pump(p, now)
	}
	l.shrink()
}

// otherEvent handles an event of a socket that is not in a pair: one being dialed, or in its
// handshake, or dialed for one; or none (closed earlier in this batch). l.mu is held.
func (l *loop) otherEvent(ev unix.EpollEvent) {
	if d := l.dialing[ev.Fd]; d != nil {
		l.dialEvent(d, ev.Events)
		return
	}
	if hs := l.upstreams[ev.Fd]; hs != nil {
		l.upstreamEvent(hs, ev.Events)
		return
	}
	hs := l.shakes[ev.Fd]
	if hs == nil {
		return
	}
	if ev.Events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		hs.readable = true
	}
	if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		hs.ended = true
	}
	if hs.up < 0 { // while it dials, what the client sends waits for the pair
		l.readShake(hs)
	}
}

// stop closes every pair and handshake and fails every dial in progress. l.mu is held.
func (l *loop) stop() {
	l.closing = true
	l.closeWhere(func(*pair) bool { return true })
	l.closeShakes(func(*Handshake) bool { return true })
	for _, d := range l.dialing {
		if !d.reported {
			d.reported = true
			d.result <- ErrClosed
		}
	}
}

// pump moves what it can both ways and closes the pair once both directions are over or one
// failed.
func (l *loop) pump(p *pair, now time.Duration) {
	if p.closed {
		return
	}
	budget := pumpBudget
	if !l.move(p, &p.ab, &budget, now) || !l.move(p, &p.ba, &budget, now) || (p.ab.shut && p.ba.shut) {
		l.closePair(p)
	}
}

// move moves h's bytes until its source or destination would block, the budget is used, or the
// source ended; it reports false if the pair must close (a reset, a write to a closed peer).
func (l *loop) move(p *pair, h *direction, budget *int, now time.Duration) bool {
	for {
		if len(h.pend) > 0 {
			if !h.dst.writable {
				return true
			}
			n, err := rawWrite(h.dst.fd, h.pend)
			if n > 0 {
				h.pend = h.pend[n:]
				h.n += int64(n)
				p.last = now
			}
			switch {
			case err == unix.EAGAIN:
				h.dst.writable = false
				return l.armOut(h.dst)
			case err == unix.EINTR:
				continue
			case err != nil:
				return false
			}
			if len(h.pend) == 0 {
				h.release()
			}
			continue
		}
		if h.shut {
			return true
		}
		if h.eof {
			// Pass the end of stream on as a direction-close, as Pipe does. ENOTCONN: the peer
			// is gone already; the other direction will say so.
			if err := rawShutdown(h.dst.fd, unix.SHUT_WR); err != nil && err != unix.ENOTCONN {
				return false
			}
			h.shut = true
			return true
		}
		if !h.src.readable {
			return true
		}
		if *budget <= 0 {
			if !p.queued {
				p.queued = true
				l.again = append(l.again, p)
			}
			return true
		}
		n, err := rawRead(h.src.fd, l.buf)
		switch {
		case err == unix.EAGAIN:
			h.src.readable = false
			return true
		case err == unix.EINTR:
			continue
		case err != nil:
			return false
		case n == 0:
			h.eof = true
			continue
		}
		*budget -= n
		p.last = now
		if n < len(l.buf) && !h.src.ended {
			h.src.readable = false
		}
		data := l.buf[:n]
		if h.dst.writable {
			m, err := rawWrite(h.dst.fd, data)
			if m > 0 {
				data = data[m:]
				h.n += int64(m)
			}
			switch {
			case err == unix.EAGAIN:
				h.dst.writable = false
				if !l.armOut(h.dst) {
					return false
				}
			case err != nil && err != unix.EINTR:
				return false
			}
		}
		if len(data) > 0 {
			h.buf = pending.Get().(*[loopBuffer]byte)
			h.pend = append(h.buf[:0], data...)
		}
	}
}

// release returns h's pending buffer to the pool.
func (h *direction) release() {
	h.pend = nil
	if h.buf != nil {
		pending.Put(h.buf)
		h.buf = nil
	}
}

// shrinkBelow is the smallest peak worth rebuilding the socket map for: 4,096 entries are a table
// of about 4,096 / (7/8 load) × 16 bytes ≈ 75 KiB.
const shrinkBelow = 4096

// shrink rebuilds socks at its current size once it holds less than a quarter of its peak.
func (l *loop) shrink() {
	if l.peak < shrinkBelow || len(l.socks) >= l.peak/4 {
		return
	}
	m := make(map[int32]*sock, len(l.socks))
	for fd, s := range l.socks {
		m[fd] = s
	}
	l.socks, l.peak = m, len(m)
}

// closeWhere closes the pairs that match and returns how many.
func (l *loop) closeWhere(match func(*pair) bool) int {
	n := 0
	for _, s := range l.socks {
		if s != &s.p.a {
			continue // each pair once, by its first socket
		}
		if match(s.p) {
			l.closePair(s.p)
			n++
		}
	}
	return n
}

func (l *loop) closePair(p *pair) {
	if p.closed {
		return
	}
	p.closed = true
	for _, s := range []*sock{&p.a, &p.b} {
		delete(l.socks, int32(s.fd))
		rawClose(s.fd) // also drops it from the epoll set: no other descriptor refers to it
	}
	p.ab.release()
	p.ba.release()
	p.g.open.Add(-1)
	if p.done != nil {
		p.done(p.ab.n, p.ba.n)
	}
}
