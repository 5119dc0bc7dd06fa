package h2relay

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"time"
)

// Parking. A client connection spends most of its life with its reader goroutine blocked in a
// read, also while its streams are open (a watch's client sends next to nothing), and that
// goroutine's stack (4–8 KiB: a TLS record read is deep) is the largest part of an idle
// connection that the relay owns; the garbage collector's headroom, in proportion to it,
// doubles it. So a connection quiet for ParkAfter gives its reader up: its socket waits in the
// relay's lot (park_linux.go: no goroutine of its own), and a goroutine made anew reads on once
// it is readable, with a framer made anew (its buffer is sized by the largest frame the
// connection had). Its streams go on meanwhile: their frames to the client go through its
// writer, not its reader.
//
// The quiet check is a one-byte read with ParkAfter's deadline at a frame boundary, through the
// same readers the framer reads from: a byte that came is the next frame's first (probeReader
// gives it to the framer), and a deadline that passed took nothing: everything buffered above
// the socket (a TLS record's rest, a bufio) would have been returned without the socket's
// deadline applying, so only the socket can have what comes next. A deadline on the frame read
// itself would not do: it may pass inside a frame, and the framer drops what it had of it.

// probeReader is what a connection's framer reads: the byte the quiet check took, then r.
type probeReader struct {
	r   io.Reader
	b   [1]byte
	has bool
}

func (pr *probeReader) Read(b []byte) (int, error) {
	if pr.has && len(b) > 0 {
		b[0], pr.has = pr.b[0], false
		return 1, nil
	}
	return pr.r.Read(b)
}

// errParked: the reader parked its connection (read ends without closing it).
var errParked = errors.New("h2relay: parked")

// checkAt is when a quiet check that begins at now ends: ParkAfter later (parking off: a second),
// rounded up to a multiple of half of that, so that the connections that went quiet within the
// same half share one timer's wake-up (on an idle machine here one costs ~200 µs of CPU: the
// BenchmarkParkCycle note in park_test.go).
func (c Config) checkAt(now time.Time) time.Time {
	every := c.ParkAfter
	if every <= 0 {
		every = time.Second
	}
	t := now.Add(every)
	if r := t.Truncate(every / 2); !r.Equal(t) {
		t = r.Add(every / 2)
	}
	return t
}

// waitFrame waits until a client's next frame begins (its first byte read, in p.in), the
// connection's idle deadline (IdleTimeout after its last stream ended) holding throughout. A
// connection quiet for ParkAfter is parked: errParked.
func (p *peer) waitFrame() error {
	var idleUntil time.Time
	for !p.in.has {
		p.mu.Lock()
		if len(p.streams) > 0 {
			p.idleUntil = time.Time{}
		} else if p.idleUntil.IsZero() {
			p.idleUntil = time.Now().Add(p.r.cfg.IdleTimeout)
		}
		idleUntil = p.idleUntil
		p.mu.Unlock()
		check, last := p.r.cfg.checkAt(time.Now()), false
		if !idleUntil.IsZero() && !check.Before(idleUntil) {
			check, last = idleUntil, true
		}
		_ = p.conn.SetReadDeadline(check)
		n, err := p.in.r.Read(p.in.b[:])
		switch {
		case n == 1:
			p.in.has = true
		case err == nil:
		case last || !errors.Is(err, os.ErrDeadlineExceeded):
			return err
		case p.raw != nil && p.r.cfg.ParkAfter > 0:
			p.park()
			return errParked
		}
	}
	// The frame's rest comes within the idle deadline, if there is one. (The loop ran: the
	// framer took the last byte it read.)
	_ = p.conn.SetReadDeadline(idleUntil)
	return nil
}

// forgetLocked forgets stream id of p; p.mu is held. A parked client connection left without
// streams gets its idle deadline here, where its reader would otherwise set it.
func (p *peer) forgetLocked(id uint32) {
	delete(p.streams, id)
	if p.client && p.parked && len(p.streams) == 0 && p.idleUntil.IsZero() {
		p.idleUntil = time.Now().Add(p.r.cfg.IdleTimeout)
		p.armIdleLocked()
	}
}

// armIdleLocked starts a parked connection's idle timer, to idleUntil; p.mu is held.
func (p *peer) armIdleLocked() {
	p.idle = time.AfterFunc(time.Until(p.idleUntil), p.idleOut)
}

// park ends the reader's part: the relay's lot wakes the connection when its socket is readable
// (resume), and it closes at its idle deadline meanwhile (idleOut).
func (p *peer) park() {
	p.fr, p.in.r = nil, nil
	p.w.release()
	if err := p.r.lot.add(p); err != nil {
		p.close(err)
	}
}

// markParked marks p parked; the lot's mu is held (and p.mu taken after it). Its idle deadline,
// if it has one, is a timer's now.
func (p *peer) markParked() {
	p.mu.Lock()
	p.parked = true
	if !p.idleUntil.IsZero() {
		p.armIdleLocked()
	}
	p.mu.Unlock()
}

// markWoken marks p no longer parked; the lot's mu is held.
func (p *peer) markWoken() {
	p.mu.Lock()
	p.parked = false
	if p.idle != nil {
		p.idle.Stop()
		p.idle = nil
	}
	p.mu.Unlock()
}

// idleOut closes p at its idle deadline, unless it woke meanwhile. The deadline is looked at
// again: a timer stopped too late (its function already started) may run after p woke and
// parked again, with a deadline of its own.
func (p *peer) idleOut() {
	p.mu.Lock()
	due := !p.idleUntil.IsZero() && !time.Now().Before(p.idleUntil)
	p.mu.Unlock()
	if due && p.r.lot.take(p) {
		p.close(errIdle)
	}
}

var errIdle = errors.New("h2relay: idle")

// resume reads on on a connection the lot woke, with a framer made anew.
func (p *peer) resume() {
	defer p.r.wg.Done()
	p.in.r = frameSource(p.conn)
	p.fr = newReadFramer(&p.in, p.dec, p.r.cfg.MaxHeaderListSize)
	p.read()
}

// rawConnOf is the socket under c, through the connections that name the one they wrap
// (NetConn, as *tls.Conn does); nil if there is none.
func rawConnOf(c net.Conn) syscall.RawConn {
	if !canPark {
		return nil
	}
	for range 8 {
		if sc, ok := c.(syscall.Conn); ok {
			rc, err := sc.SyscallConn()
			if err != nil {
				return nil
			}
			return rc
		}
		w, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil
		}
		c = w.NetConn()
	}
	return nil
}
