package loops

import (
	"container/heap"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Handshake is an accepted connection in its handshake on a loop: read until its Handshaker
// decides, then dialed for, joined as a pair or handed off. Peer and Local are its addresses.
type Handshake struct {
	Peer, Local netip.AddrPort

	l  *loop
	g  *Group
	h  Handshaker
	fd int
	// Guarded by l.mu.
	buf             []byte
	max             int
	readable, ended bool
	// asked: the Handshaker has been asked at least once; end: why the client sends no more.
	asked bool
	end   error
	// up is the upstream being dialed (-1: none), addr its address; upReadable and upEnded its
	// readiness seen while connecting, for the pair.
	up                  int
	dial                Verdict
	upReadable, upEnded bool
	// deadline (since l.start) ends the read (the handshake's timeout) or the dial (its
	// Timeout); index is the handshake's place in l.timers.
	deadline time.Duration
	index    int
	over     bool // joined, handed off or closed
}

// RemoteAddr is the client's address.
func (hs *Handshake) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(hs.Peer) }

// Close closes a connection still in its handshake (its Handshaker is told: Closed); after the
// handshake it does nothing. It must not be called from the connection's own Handshaker.
func (hs *Handshake) Close() error {
	l := hs.l
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case hs.over:
	case hs.h == nil:
		// Accepted but not yet on its loop (another listener's accept evicted it between its
		// admission and its placing): handshake closes it when it gets there.
		hs.over = true
	default:
		hs.h.Closed()
		l.dropShake(hs, true)
	}
	return nil
}

// Listener is a TCP listener whose connections Serve runs on the loops. Its socket is in Go's
// poller only to wait for connections (net.Listener's raw connection cannot wait): accepted
// sockets bypass the poller (no registration to undo, no duplicate when they are joined) and
// inherit the listener's socket options (TCP_NODELAY and keepalive: Linux copies them on accept).
type Listener struct {
	f      *os.File
	addr   netip.AddrPort
	closed atomic.Bool
}

// Listen takes ln (a TCP listener) over: the Listener holds a duplicate of its socket, and ln is
// closed. Accepted connections have TCP_NODELAY (as Go's have) and, with keepAliveIdle > 0, TCP
// keepalive probes after that much idle time (the kernel's interval and count after it).
func Listen(ln net.Listener, keepAliveIdle time.Duration) (*Listener, error) {
	defer ln.Close()
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return nil, fmt.Errorf("relay: %T is not a TCP listener", ln)
	}
	f, err := tl.File() // a non-blocking duplicate, which os.File puts in Go's poller
	if err != nil {
		return nil, err
	}
	opts := [][3]int{{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1}}
	if keepAliveIdle > 0 {
		opts = append(opts, [3]int{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1}, [3]int{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(max(keepAliveIdle/time.Second, 1))})
	}
	rc, err := f.SyscallConn() // not f.Fd(), which would make the socket blocking
	if err == nil {
		cerr := rc.Control(func(fd uintptr) {
			for _, o := range opts {
				if err == nil {
					err = os.NewSyscallError("setsockopt", unix.SetsockoptInt(int(fd), o[0], o[1], o[2]))
				}
			}
		})
		err = errors.Join(cerr, err)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	ap := tl.Addr().(*net.TCPAddr).AddrPort()
	return &Listener{f: f, addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())}, nil
}

// Addr is the listener's address.
func (ln *Listener) Addr() netip.AddrPort { return ln.addr }

// Close closes the listener: the kernel refuses new connections, and Serve returns.
func (ln *Listener) Close() error {
	ln.closed.Store(true)
	return ln.f.Close()
}

// Serve accepts connections on ln until ln is closed, and runs each one's handshake on a loop,
// in g: accept decides whether to take it and who decides where it goes. It returns nil once ln
// is closed, or the error of an accept that failed otherwise (out of descriptors, say: the
// caller pauses and calls Serve again).
func (ls *Loops) Serve(g *Group, ln *Listener, accept Accept) error {
	rc, err := ln.f.SyscallConn()
	if err != nil {
		return err
	}
	// A listener on a wildcard address learns each connection's own destination.
	wildcard := ln.addr.Addr().IsUnspecified()
	var aerr error
	for aerr == nil {
		err = rc.Read(func(lfd uintptr) bool {
			// A batch, then back to Read: a flood of connections does not keep this goroutine
			// from seeing the listener close.
			for range acceptBatch {
				fd, peer, err := rawAccept(int(lfd))
				switch {
				case err == syscall.EAGAIN:
					return false
				case err == syscall.EINTR || err == syscall.ECONNABORTED:
					continue
				case err != nil:
					aerr = os.NewSyscallError("accept4", err)
					return true
				}
				hs := &Handshake{Peer: peer, Local: ln.addr, fd: fd, g: g, up: -1, index: -1}
				if wildcard {
					if own := rawLocal(fd); own.IsValid() {
						hs.Local = own
					}
				}
				ls.handshake(hs, accept)
			}
			return true
		})
		if err != nil {
			if ln.closed.Load() {
				return nil
			}
			return err
		}
	}
	return aerr
}

// acceptBatch is how many connections Serve accepts per wake-up before it looks at the
// listener's state again.
const acceptBatch = 64

// handshake places an accepted connection on a loop and reads what it sent.
func (ls *Loops) handshake(hs *Handshake, accept Accept) {
	hs.l = ls.pick()
	h, timeout, maxBytes := accept(hs)
	if h == nil {
		rawClose(hs.fd)
		return
	}
	l := hs.l
	l.mu.Lock()
	defer l.mu.Unlock()
	hs.h, hs.max = h, maxBytes
	if hs.over || l.closing || hs.g.closed.Load() { // closed already (Close), or shutting down
		hs.over = true
		h.Closed()
		rawClose(hs.fd)
		return
	}
	l.shakes[int32(hs.fd)] = hs
	hs.g.shakes.Add(1)
	l.setDeadline(hs, l.now()+timeout)
	// Its first bytes are often there already (the client sends them as its connect returns),
	// and they are read before the socket is registered: registered with bytes waiting, it
	// would report them again, a wake-up for nothing. Bytes that arrive after the read are
	// reported by the registration.
	hs.readable = true
	l.readShake(hs)
	if hs.over {
		return
	}
	if err := l.register(hs.fd, false); err != nil {
		h.Closed()
		l.dropShake(hs, true)
	}
}

// readShake reads what the client sent since the last call and asks the Handshaker. l.mu is held.
func (l *loop) readShake(hs *Handshake) {
	before := len(hs.buf)
	for hs.end == nil && hs.readable && len(hs.buf) < hs.max {
		want := min(len(l.buf), hs.max-len(hs.buf))
		n, err := rawRead(hs.fd, l.buf[:want])
		switch {
		case err == unix.EAGAIN:
			hs.readable = false
			continue
		case err == unix.EINTR:
			continue
		case err != nil:
			hs.end = os.NewSyscallError("read", err)
			continue
		case n == 0:
			hs.end = io.EOF
			continue
		}
		hs.buf = append(hs.buf, l.buf[:n]...)
		if n < want && !hs.ended {
			hs.readable = false
		}
	}
	if hs.asked && len(hs.buf) == before && hs.end == nil {
		return // an edge without news
	}
	hs.asked = true
	v := hs.h.Read(hs.buf, hs.end)
	if v.Step == StepMore && hs.end == nil && len(hs.buf) >= hs.max {
		hs.end = ErrTooLong
		v = hs.h.Read(hs.buf, hs.end)
	}
	l.apply(hs, v)
}

// apply carries out a Verdict. l.mu is held.
func (l *loop) apply(hs *Handshake, v Verdict) {
	for {
		switch v.Step {
		case StepMore:
			if hs.end == nil {
				return
			}
			l.dropShake(hs, true)
		case StepDial:
			fd, err := connect(v.Addr)
			if err == nil {
				if err = l.register(fd, true); err != nil {
					rawClose(fd)
				}
			}
			if err != nil {
				v = hs.h.DialFailed(dialError(v.Addr, err))
				continue
			}
			hs.up, hs.dial = fd, v
			l.upstreams[int32(fd)] = hs
			l.setDeadline(hs, l.now()+v.Timeout)
		case StepHandOff:
			l.handOff(hs)
		default:
			l.dropShake(hs, true)
		}
		return
	}
}

// handOff takes the connection out of the loop and gives it to the Handshaker as a net.Conn.
// l.mu is held.
func (l *loop) handOff(hs *Handshake) {
	// Out of the epoll set first: the descriptor Go's poller gets is a duplicate, which would
	// keep this registration alive after the close below.
	_ = rawEpollCtl(l.epfd, unix.EPOLL_CTL_DEL, hs.fd, nil)
	l.dropShake(hs, false)
	f := os.NewFile(uintptr(hs.fd), "handshake")
	c, err := net.FileConn(f)
	f.Close()
	hs.h.HandOff(c, err)
}

// upstreamEvent handles an event of the upstream a handshake dials: the first writable, hang-up
// or error edge ends the connect. l.mu is held.
func (l *loop) upstreamEvent(hs *Handshake, events uint32) {
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		hs.upReadable = true
	}
	if events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		hs.upEnded = true
	}
	if events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
		return
	}
	if err := connectResult(hs.up); err != nil {
		l.closeUpstream(hs)
		l.apply(hs, hs.h.DialFailed(dialError(hs.dial.Addr, err)))
		return
	}
	v := hs.dial
	// The client's socket is taken as writable, as every socket is until a write says EAGAIN.
	a := sock{fd: hs.fd, readable: hs.readable || hs.end != nil, ended: hs.ended || hs.end != nil, writable: true}
	b := sock{fd: hs.up, readable: hs.upReadable, ended: hs.upEnded, writable: true, outArmed: true}
	delete(l.upstreams, int32(hs.up))
	hs.up = -1
	l.dropShake(hs, false)
	// The Handshaker may keep hs; what it read is the pair's now (v.First), or done with.
	hs.buf, hs.dial = nil, Verdict{}
	p, err := l.join(hs.g, a, b, false, false, v.First, v.Idle, v.Done)
	if err != nil {
		hs.h.Closed()
		return
	}
	hs.h.Joined()
	l.pump(p, p.last)
}

// closeUpstream closes the upstream a handshake was dialing. l.mu is held.
func (l *loop) closeUpstream(hs *Handshake) {
	if hs.up < 0 {
		return
	}
	delete(l.upstreams, int32(hs.up))
	rawClose(hs.up)
	hs.up = -1
}

// dropShake ends a handshake on the loop: out of its maps and timers, its upstream closed, and
// its connection too if closeConn. l.mu is held.
func (l *loop) dropShake(hs *Handshake, closeConn bool) {
	if hs.over {
		return
	}
	hs.over = true
	l.closeUpstream(hs)
	delete(l.shakes, int32(hs.fd))
	if hs.index >= 0 {
		heap.Remove(&l.timers, hs.index)
	}
	// Counted out before the close: whoever sees the connection end sees the count without it.
	hs.g.shakes.Add(-1)
	if closeConn {
		rawClose(hs.fd)
	}
}

// setDeadline (re)sets hs's deadline and makes sure the loop wakes for it. l.mu is held.
func (l *loop) setDeadline(hs *Handshake, d time.Duration) {
	hs.deadline = d
	if hs.index >= 0 {
		heap.Fix(&l.timers, hs.index)
	} else {
		heap.Push(&l.timers, hs)
	}
	l.wakeBy(d)
}

// wakeBy makes sure the loop wakes by d (since l.start). l.mu is held.
func (l *loop) wakeBy(d time.Duration) {
	if l.wake == 0 || d < l.wake {
		l.wake = d
		_ = l.file.SetReadDeadline(l.start.Add(d))
	}
}

// expire ends the handshakes whose deadline has passed: a read is over (the Handshaker refuses
// it), a connect has failed. l.mu is held.
func (l *loop) expire(now time.Duration) {
	for len(l.timers) > 0 && l.timers[0].deadline <= now {
		hs := l.timers[0]
		heap.Pop(&l.timers)
		if hs.up >= 0 {
			l.closeUpstream(hs)
			l.apply(hs, hs.h.DialFailed(dialError(hs.dial.Addr, os.ErrDeadlineExceeded)))
			continue
		}
		if hs.end == nil {
			hs.end = os.ErrDeadlineExceeded
		}
		l.apply(hs, hs.h.Read(hs.buf, hs.end))
	}
}

// closeShakes closes the handshakes that match and returns how many. l.mu is held.
func (l *loop) closeShakes(match func(*Handshake) bool) int {
	n := 0
	for _, hs := range l.shakes {
		if match(hs) {
			hs.h.Closed()
			l.dropShake(hs, true)
			n++
		}
	}
	return n
}

// connect starts a connect to addr from a non-blocking socket.
func connect(addr netip.AddrPort) (int, error) {
	family := unix.AF_INET
	if !addr.Addr().Unmap().Is4() {
		family = unix.AF_INET6
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0) // raw already
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	if err := rawSetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		rawClose(fd)
		return -1, os.NewSyscallError("setsockopt", err)
	}
	if err := rawConnect(fd, addr); err != nil && err != unix.EINPROGRESS {
		rawClose(fd)
		return -1, os.NewSyscallError("connect", err)
	}
	return fd, nil
}

// connectResult is the outcome of a non-blocking connect once its socket is writable.
func connectResult(fd int) error {
	errno, err := rawSoError(fd)
	switch {
	case err != nil:
		return os.NewSyscallError("getsockopt", err)
	case errno != 0:
		return os.NewSyscallError("connect", errno)
	}
	return nil
}

// timers orders a loop's handshakes by deadline.
type timers []*Handshake

func (t timers) Len() int           { return len(t) }
func (t timers) Less(i, j int) bool { return t[i].deadline < t[j].deadline }
func (t timers) Swap(i, j int) {
	t[i], t[j] = t[j], t[i]
	t[i].index, t[j].index = i, j
}
func (t *timers) Push(x any) {
	hs := x.(*Handshake)
	hs.index = len(*t)
	*t = append(*t, hs)
}
func (t *timers) Pop() any {
	old := *t
	hs := old[len(old)-1]
	old[len(old)-1] = nil
	hs.index = -1
	*t = old[:len(old)-1]
	return hs
}
