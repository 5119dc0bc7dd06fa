package loops

import (
	"errors"
	"net"
	"net/netip"
	"time"
)

// Step is what a Handshaker wants done with a connection in its handshake.
type Step int

const (
	// StepMore waits for more bytes (or the connection's end, or its handshake deadline).
	StepMore Step = iota
	// StepClose closes the connection: the Handshaker has counted why.
	StepClose
	// StepDial connects to Verdict.Addr and, once connected, relays the pair.
	StepDial
	// StepHandOff gives the connection to the Handshaker as a net.Conn (HandOff): a protocol the
	// loops do not speak (an HTTP request) goes on in a goroutine of its own.
	StepHandOff
)

// Verdict is a Handshaker's decision.
type Verdict struct {
	Step Step
	// StepDial: the upstream, the time its connect may take, the bytes written to it before
	// anything else read from the client (the part of the client's first bytes that is relayed),
	// and the pair's idle time and done func (as Join's).
	Addr    netip.AddrPort
	Timeout time.Duration
	First   []byte
	Idle    time.Duration
	Done    func(aToB, bToA int64)
}

// Handshaker owns an accepted connection while the loops read its first bytes (a PROXY header,
// a ClientHello) and decides where it goes. Its methods run on a loop, one at a time for a
// connection, while the loop's lock is held: they must not block or call into Loops (a
// Handshake's Close included).
type Handshaker interface {
	// Read is given every byte the connection has sent so far (data is the handshake's own
	// buffer: the Handshaker may keep it) and end: nil while more may come, or why nothing more
	// will — io.EOF, a read error, os.ErrDeadlineExceeded (the handshake's time is up) or
	// ErrTooLong (the most the handshake may read has been read). It is called once at
	// once with no data, so that a protocol whose server speaks first (or that needs no bytes
	// to decide) is not held up. With end set, StepMore means StepClose.
	Read(data []byte, end error) Verdict
	// DialFailed says that the last StepDial failed (err wraps os.ErrDeadlineExceeded for a
	// connect that took its Timeout) and asks what next: another StepDial or StepClose.
	DialFailed(err error) Verdict
	// Joined says the pair is relayed: the Verdict's Done is called when it ends.
	Joined()
	// HandOff receives the connection after StepHandOff (or the error that stopped it from being
	// made a net.Conn: then it is closed). It must start its own goroutine for it.
	HandOff(c net.Conn, err error)
	// Closed says the connection is closed in its handshake by Handshake.Close, CloseGroup or
	// Loops.Close (told just before the close, so that its peer sees the close after it).
	Closed()
}

// ErrTooLong: a connection sent the most its handshake may read without a decision.
var ErrTooLong = errors.New("handshake too long")

// Accept is called for every connection Serve accepts, on Serve's goroutine: it returns the
// connection's Handshaker, the time its handshake may take until a StepDial, and the most bytes
// it may read; a nil Handshaker closes the connection (the callback has counted why). It may
// close other connections' Handshakes (to make room).
type Accept func(hs *Handshake) (h Handshaker, timeout time.Duration, maxBytes int)
