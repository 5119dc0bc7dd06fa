//go:build linux

package h2relay

import (
	"fmt"
	"os"
	"sync"
	"syscall"
)

// canPark: parked connections wait in the lot's epoll instance.
const canPark = true

// lot is where a relay's parked connections wait: one epoll instance that each parked
// connection's socket is armed in, one-shot (an event wakes that connection once, and a later
// park arms it again), read by one goroutine through the runtime's poller (the instance is
// itself pollable). A goroutine per parked connection, each blocked in its socket's read, cost
// that goroutine and its stack per idle connection (4 KiB from the runtime's adaptive start
// while most connections are busy, as when they open: a stack that size never shrinks), the
// largest part of an idle connection the relay owned.
//
// An event carries the park's id, never the socket's descriptor: a socket closed while its
// event was on its way may have its number reused by another connection by then. Closing a
// socket takes it out of the instance (the kernel does, with its last descriptor), so only the
// lot's map needs forgetting a parked connection that closes. The instance and its goroutine
// live while a connection is parked.
type lot struct {
	r  *Relay
	mu sync.Mutex
	ep *os.File // nil while none is parked
	// epfd is ep's descriptor, used under mu while ep is open.
	epfd   int
	next   uint64
	parked map[uint64]*peer
}

// add parks p: it is woken (resume) when its socket is readable, has an error or its end.
func (l *lot) add(p *peer) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ep == nil {
		if err := l.open(); err != nil {
			return err
		}
	}
	l.next++
	id := l.next
	// The event's data is 64 bits, which syscall names Fd and Pad.
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT,
		Fd: int32(uint32(id)), Pad: int32(uint32(id >> 32))}
	var cerr error
	err := p.raw.Control(func(fd uintptr) {
		// Armed before, in this instance: re-armed; else added.
		if cerr = syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_MOD, int(fd), &ev); cerr == syscall.ENOENT {
			cerr = syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_ADD, int(fd), &ev)
		}
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		if len(l.parked) == 0 {
			l.closeLocked()
		}
		return fmt.Errorf("h2relay: parking: %w", err)
	}
	l.parked[id] = p
	p.lotID = id
	p.markParked()
	return nil
}

// open makes the epoll instance and starts its goroutine; l.mu is held.
func (l *lot) open() error {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return fmt.Errorf("h2relay: epoll: %w", err)
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return fmt.Errorf("h2relay: epoll: %w", err)
	}
	ep := os.NewFile(uintptr(fd), "h2relay-lot") // non-blocking: the runtime's poller waits on it
	rc, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return fmt.Errorf("h2relay: epoll: %w", err)
	}
	if l.parked == nil {
		l.parked = map[uint64]*peer{}
	}
	l.ep, l.epfd = ep, fd
	l.r.wg.Add(1)
	go l.run(ep, rc)
	return nil
}

func (l *lot) closeLocked() {
	l.ep.Close()
	l.ep = nil
}

// take unparks p if it is parked (its reader does not resume: the caller closes it).
func (l *lot) take(p *peer) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if p.lotID == 0 {
		return false
	}
	l.leaveLocked(p)
	if len(l.parked) == 0 {
		l.closeLocked()
	}
	return true
}

// leaveLocked takes parked p out of the lot; l.mu is held.
func (l *lot) leaveLocked(p *peer) {
	delete(l.parked, p.lotID)
	p.lotID = 0
	p.markWoken()
}

// count is how many connections are parked.
func (l *lot) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.parked)
}

// run wakes the connections whose sockets have something to read, until ep closes.
func (l *lot) run(ep *os.File, rc syscall.RawConn) {
	defer l.r.wg.Done()
	var evs [64]syscall.EpollEvent
	var woken []*peer
	for {
		var n int
		var werr error
		err := rc.Read(func(fd uintptr) bool {
			for {
				n, werr = syscall.EpollWait(int(fd), evs[:], 0)
				if werr != syscall.EINTR {
					return n > 0 || werr != nil
				}
			}
		})
		if err != nil || werr != nil {
			return // ep closed: none is parked
		}
		l.mu.Lock()
		woken = woken[:0]
		for _, ev := range evs[:n] {
			id := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			if p := l.parked[id]; p != nil {
				l.leaveLocked(p)
				woken = append(woken, p)
			}
		}
		last := l.ep == ep && len(l.parked) == 0
		if last {
			l.closeLocked()
		}
		l.mu.Unlock()
		for _, p := range woken {
			l.r.wg.Add(1)
			go p.resume()
		}
		clear(woken)
		if last {
			return
		}
	}
}
