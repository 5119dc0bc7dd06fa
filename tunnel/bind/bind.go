// Package bind is a WireGuard conn.Bind whose network is a set of framed byte streams (tendril
// agents' TCP connections, dialed out through an HTTP CONNECT proxy) instead of a UDP socket.
// Each attached stream is one path to one peer and is its own Endpoint; WireGuard learns which
// peer is behind a stream from the first authenticated packet on it, and roams to the newest.
// The package moves packets and counts them. It does not dial or accept streams, authenticate
// anything (WireGuard does) or retry: a stream that fails is detached, and the side that dialed
// it dials again.
//
// Receive path: one reader goroutine per stream reads frames into pooled buffers (at most
// Config.StreamBuffers at once per stream) and queues them; the device's ReceiveFunc copies them
// out in batches. A stream whose buffers are all queued waits for WireGuard to take them before
// it reads more: backpressure on that stream's TCP flow, never a drop. Drops would only make
// the inner TCP connections retransmit across a transport that is already reliable, and a
// buffer count per stream keeps a slow or hostile stream from holding buffers that another
// stream needs.
//
// Authentication: anyone who can reach the listener can attach a stream and send frames, so
// frames alone prove nothing. A stream counts as authenticated once its owner, which reads
// WireGuard's state, marks it so (Endpoint.MarkAuthenticated: WireGuard accepted a packet that
// came on it). Only authenticated streams are safe from the Bind's two defences against streams
// that hold a slot with junk: a stream not marked within Config.AuthTimeout is detached however
// much it sends (DetachUnauthenticated), and when every slot is taken, a new stream displaces
// the oldest stream never marked (DetachEvicted) instead of being refused. An agent's new stream
// therefore always gets a slot, and keeps it once its first handshake has been seen (until
// then, being the newest, it goes only after MaxStreams newer unmarked streams arrived); Attach
// is refused (RefuseFull) only when every slot holds an authenticated stream.
//
// Lifecycle of a stream: attached (unauthenticated, its AuthTimeout running) → marked
// authenticated (the first mark stops the deadline; later ones only move LastAuthenticated) →
// detached, for exactly one DetachReason.
//
// Send path: Send appends a batch as frames to the stream's pending buffer and returns; the
// stream's writer goroutine takes everything pending and writes it in one call, so packets
// that queue up while a write is in progress go out together (wireguard-go's netstack hands
// the sender one packet at a time, so batches form here, not in WireGuard). The pending buffer
// is bounded (maxPending); Send waits for room, which is backpressure on the sending peer,
// and a write that makes no progress within WriteTimeout detaches the stream.
package bind

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"golang.zx2c4.com/wireguard/conn"

	"github.com/tendril-net/tendril/internal/host/idlemem"
	"github.com/tendril-net/tendril/tunnel/frame"
)

const (
	// DefaultMaxStreams bounds the attached streams. A shoot's agent runs one stream per
	// replica (two for high availability); the rest is room for reconnections that overlap a
	// stream not yet known to be dead.
	DefaultMaxStreams = 16

	// DefaultStreamBuffers is how many received packets one stream may have waiting for
	// WireGuard: four ReceiveFunc batches (DefaultBatchSize) from a single stream, so the
	// reader keeps reading while WireGuard takes a batch. More would only hold more memory
	// under load: 32 frames are 1.9 MB at the default MTU (60,032-byte frames in 64 KiB
	// pooled buffers: 2 MiB), 64 KiB at 1420; none once WireGuard took them.
	DefaultStreamBuffers = 32

	// DefaultBatchSize is how many packets one ReceiveFunc call returns at most and Send
	// accepts. wireguard-go keeps the device's batch size (the larger of the Bind's and the
	// TUN's: netstack's is 4) in 64 KiB message buffers twice for as long as the device lives,
	// in its receive goroutine and in its TUN reader: 8 holds 2 × 8 × 64 KiB = 1 MiB where 32
	// held 4 MiB (live in tendril-server's heap 60 s after a dial run) and conn.IdealBatchSize
	// (128) would hold 16 MiB. Their pages leave the resident set once the packets have been
	// small for a while (idlemem.Held, in receive and in netstack's Read). With 60 KB packets a batch
	// of 8 is 480 KB, and it moves no less than a batch of 32 (tunnel/wg BenchmarkThroughput;
	// docs/performance.md, "Dial stalls and memory after a load").
	DefaultBatchSize = 8

	// DefaultAuthTimeout is how long a stream may go unauthenticated. An agent's first packet
	// on a new stream is a handshake initiation, answered within milliseconds; a WireGuard
	// under load answers it with a cookie instead and the agent retries after RekeyTimeout (5 s)
	// plus up to 334 ms of jitter; the owner notices an accepted packet within its reading
	// interval (tendril-server: 250 ms). 5 s + 0.334 s + 0.25 s ≈ 5.6 s, so 10 s leaves room for
	// that one retry, and a junk sender holds a slot for at most 10 s per connection.
	DefaultAuthTimeout = 10 * time.Second

	// DefaultWriteTimeout is how long one write to a stream may make no progress before the
	// stream is declared dead. The peer's reader only waits for its own WireGuard device, so a
	// write stuck this long means the path is gone (a half-open TCP connection), not that the
	// peer is busy.
	DefaultWriteTimeout = 30 * time.Second

	// maxPending bounds the frames a stream holds for its writer: 256 KiB is four frames of
	// the largest size or 180 at MTU 1420, enough that the writer always has a full write
	// ready while the sender fills the next one. A batch larger than this still goes out
	// whole once the buffer is empty.
	maxPending = 256 << 10

	// endpointPrefix starts the name of every endpoint: "stream/" and the stream's number.
	endpointPrefix = "stream/"
)

var (
	// ErrDetached reports a Send to an endpoint whose stream has ended.
	ErrDetached = errors.New("bind: stream detached")
	// ErrTooManyStreams reports an Attach beyond Config.MaxStreams when every attached stream
	// is authenticated (an unauthenticated one would have been evicted instead).
	ErrTooManyStreams = errors.New("bind: too many streams")
	// ErrUnknownEndpoint reports an endpoint string that names no attached stream.
	ErrUnknownEndpoint = errors.New("bind: unknown endpoint")
)

// Config tunes a Bind. The zero value is valid: every zero field takes the default named in
// its comment.
type Config struct {
	// MaxStreams bounds the streams attached at once. Attach beyond it evicts the oldest
	// unauthenticated stream, or fails when every stream is authenticated. 0 means
	// DefaultMaxStreams.
	MaxStreams int
	// AuthTimeout detaches a stream that has not been marked authenticated this long after
	// Attach (DetachUnauthenticated), whatever it sends. 0 means DefaultAuthTimeout; negative
	// means no deadline (every stream is then trusted as long as it lives, but can still be
	// evicted while unmarked).
	AuthTimeout time.Duration
	// StreamBuffers is how many received packets of one stream may wait for WireGuard.
	// 0 means DefaultStreamBuffers. The worst-case memory of a Bind's streams is
	// MaxStreams × (StreamBuffers × MaxFrameSize + 2 × maxPending + a 64 KiB read buffer):
	// 16 × (32 × 64 KiB + 512 KiB + 64 KiB) = 41 MiB with the defaults and frame.MaxSize, less
	// for a smaller MTU. The buffers are pooled (getBuf), held only while a packet waits for
	// WireGuard, and sized to the frame's power of two (2 KiB at MTU 1420).
	StreamBuffers int
	// BatchSize is the Bind's BatchSize. 0 means DefaultBatchSize.
	BatchSize int
	// MaxFrameSize is the largest frame accepted or sent. 0 means frame.MaxSize (65,535),
	// which carries any MTU up to 65,503.
	MaxFrameSize int
	// WriteTimeout bounds one write to a stream; a stream whose write times out is detached.
	// 0 means DefaultWriteTimeout; negative means no deadline.
	WriteTimeout time.Duration
	// Logger receives stream lifecycle events: attach at V(1), detach with its reason at V(0)
	// (V(1) for DetachClosed, DetachPruned, DetachEvicted and DetachUnauthenticated). The zero
	// Logger discards.
	Logger logr.Logger
}

// DetachReason says why a stream ended. Each reason has its own counter in Stats.
type DetachReason int

const (
	// DetachEOF: the peer closed the stream between two frames.
	DetachEOF DetachReason = iota
	// DetachReadError: reading failed (reset, timeout, a stream cut inside a frame).
	DetachReadError
	// DetachBadFrame: the peer sent a zero or oversized length; the stream cannot be
	// resynchronised after that.
	DetachBadFrame
	// DetachWriteError: a write failed or exceeded WriteTimeout.
	DetachWriteError
	// DetachClosed: Endpoint.Close or Bind.Close.
	DetachClosed
	// DetachUnauthenticated: not marked authenticated within AuthTimeout.
	DetachUnauthenticated
	// DetachEvicted: never marked authenticated, and the oldest such stream when a new one
	// arrived with every slot taken.
	DetachEvicted
	// DetachPruned: Endpoint.Prune, the owner's decision that the stream is no longer used
	// (tendril-server: no agent's endpoint, no authenticated packet for a while).
	DetachPruned

	numDetachReasons
)

func (r DetachReason) String() string {
	switch r {
	case DetachEOF:
		return "eof"
	case DetachReadError:
		return "read-error"
	case DetachBadFrame:
		return "bad-frame"
	case DetachWriteError:
		return "write-error"
	case DetachClosed:
		return "closed"
	case DetachUnauthenticated:
		return "unauthenticated"
	case DetachEvicted:
		return "evicted"
	case DetachPruned:
		return "pruned"
	}
	return "unknown"
}

// RefuseReason says why Attach refused a stream. Each reason has its own counter in Stats.
type RefuseReason int

const (
	// RefuseFull: MaxStreams streams are attached and every one is authenticated.
	RefuseFull RefuseReason = iota
	// RefuseClosed: the Bind is not open.
	RefuseClosed

	numRefuseReasons
)

func (r RefuseReason) String() string {
	switch r {
	case RefuseFull:
		return "full"
	case RefuseClosed:
		return "closed"
	}
	return "unknown"
}

// SendDropReason says why packets given to Send were not written.
type SendDropReason int

const (
	// SendDropDetached: the endpoint's stream had ended at Send, or ended while the packets
	// were still pending.
	SendDropDetached SendDropReason = iota
	// SendDropWriteError: the write carrying the packets failed (the stream is detached too).
	SendDropWriteError
	// SendDropRefused: a packet was empty or larger than MaxFrameSize.
	SendDropRefused

	numSendDropReasons
)

func (r SendDropReason) String() string {
	switch r {
	case SendDropDetached:
		return "detached"
	case SendDropWriteError:
		return "write-error"
	case SendDropRefused:
		return "refused"
	}
	return "unknown"
}

// Stats is a snapshot of a Bind's counters. All counters only grow (StreamsActive excepted).
type Stats struct {
	StreamsAttached uint64
	StreamsActive   int
	// StreamsDetached counts ended streams by reason (index: DetachReason).
	StreamsDetached [numDetachReasons]uint64
	// AttachRefused counts refused Attach calls by reason (index: RefuseReason).
	AttachRefused [numRefuseReasons]uint64
	PacketsIn     uint64
	BytesIn       uint64
	PacketsOut    uint64
	BytesOut      uint64
	// FramesRejected counts received frames with an invalid length (each also detached its
	// stream with DetachBadFrame).
	FramesRejected uint64
	// SendDropped counts packets given to Send and not written, by reason (index:
	// SendDropReason).
	SendDropped [numSendDropReasons]uint64
}

// Bind is a conn.Bind over framed streams. Create it with New, hand it to device.NewDevice,
// and Attach streams once the device is up (the device opens the Bind in Up).
type Bind struct {
	cfg Config
	log logr.Logger

	mu       sync.Mutex
	open     bool
	closed   chan struct{}      // closed by Close; replaced by Open
	queue    chan *packet       // received packets for the ReceiveFunc; replaced by Open
	streams  map[uint64]*stream // attached streams by number
	nextID   uint64
	routines sync.WaitGroup // two per stream: its reader and its writer

	attached             atomic.Uint64
	refused              [numRefuseReasons]atomic.Uint64
	detached             [numDetachReasons]atomic.Uint64
	packetsIn, bytesIn   atomic.Uint64
	packetsOut, bytesOut atomic.Uint64
	framesRejected       atomic.Uint64
	sendDropped          [numSendDropReasons]atomic.Uint64
}

var _ conn.Bind = (*Bind)(nil)

// New returns a closed Bind; the WireGuard device opens it.
func New(cfg Config) *Bind {
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	if cfg.StreamBuffers <= 0 {
		cfg.StreamBuffers = DefaultStreamBuffers
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.MaxFrameSize <= 0 || cfg.MaxFrameSize > frame.MaxSize {
		cfg.MaxFrameSize = frame.MaxSize
	}
	cfg.WriteTimeout = cmp.Or(cfg.WriteTimeout, DefaultWriteTimeout)
	cfg.AuthTimeout = cmp.Or(cfg.AuthTimeout, DefaultAuthTimeout)
	return &Bind{cfg: cfg, log: cfg.Logger, streams: make(map[uint64]*stream)}
}

// Open starts receiving. The port means nothing to streams; it is reported back unchanged so
// that the device's configuration reads as it was set. It returns one ReceiveFunc, which
// returns packets from every attached stream.
func (b *Bind) Open(port uint16) ([]conn.ReceiveFunc, uint16, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.open {
		return nil, 0, conn.ErrBindAlreadyOpen
	}
	b.open = true
	b.closed = make(chan struct{})
	// Room for every buffer that attached streams can own, so a reader never blocks on the
	// queue itself, only on its own buffers (MaxStreams × StreamBuffers pointers: 4 KiB).
	b.queue = make(chan *packet, b.cfg.MaxStreams*b.cfg.StreamBuffers)
	closed, queue := b.closed, b.queue
	// The device calls its ReceiveFunc from one goroutine, with the same buffers each time.
	held := new(idlemem.Held)
	recv := func(packets [][]byte, sizes []int, eps []conn.Endpoint) (int, error) {
		return b.receive(closed, queue, held, packets, sizes, eps)
	}
	return []conn.ReceiveFunc{recv}, port, nil
}

// Close detaches every stream (closing its connection), waits for their goroutines to end and
// makes the ReceiveFunc return net.ErrClosed. The Bind can be opened again; streams must then
// be attached anew. Closing a closed Bind does nothing.
func (b *Bind) Close() error {
	b.mu.Lock()
	if !b.open {
		b.mu.Unlock()
		return nil
	}
	b.open = false
	close(b.closed)
	streams := make([]*stream, 0, len(b.streams))
	for _, s := range b.streams {
		streams = append(streams, s)
	}
	b.mu.Unlock()
	for _, s := range streams {
		s.detach(DetachClosed, nil)
	}
	b.routines.Wait()
	return nil
}

// SetMark does nothing: there is no socket of the Bind's own to mark.
func (b *Bind) SetMark(uint32) error { return nil }

// BatchSize reports Config.BatchSize.
func (b *Bind) BatchSize() int { return b.cfg.BatchSize }

// ParseEndpoint returns the endpoint of an attached stream from its name ("stream/7", as
// Endpoint.DstToString prints it). A well-formed name of a stream that is not attached (never
// was, or already detached) yields ErrUnknownEndpoint: WireGuard learns endpoints from received
// packets, so a configuration never needs to name a stream that is gone.
func (b *Bind) ParseEndpoint(s string) (conn.Endpoint, error) {
	num, ok := strings.CutPrefix(s, endpointPrefix)
	if !ok {
		return nil, fmt.Errorf("bind: parse endpoint %q: want %s<number>", s, endpointPrefix)
	}
	id, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return nil, fmt.Errorf("bind: parse endpoint %q: %w", s, err)
	}
	b.mu.Lock()
	st := b.streams[id]
	b.mu.Unlock()
	if st == nil {
		return nil, fmt.Errorf("bind: parse endpoint %q: %w", s, ErrUnknownEndpoint)
	}
	return st.ep, nil
}

// Attach adds c as a stream and returns its endpoint; from then on the Bind owns c and closes
// it when the stream is detached. A reader goroutine feeds c's frames into the ReceiveFunc and
// a writer goroutine writes what Send queues, until c ends, a frame is malformed, a write
// fails, the endpoint is closed, the stream stays unauthenticated beyond AuthTimeout, it is
// evicted or the Bind is closed. With MaxStreams attached, Attach evicts the oldest stream
// never marked authenticated; it fails with ErrTooManyStreams when there is none, and with
// net.ErrClosed when the Bind is not open; c is closed then too.
func (b *Bind) Attach(c net.Conn) (*Endpoint, error) {
	b.mu.Lock()
	var victim *stream
	if b.open && len(b.streams) >= b.cfg.MaxStreams {
		for _, s := range b.streams {
			if s.authAt.Load() == 0 && (victim == nil || s.ep.id < victim.ep.id) {
				victim = s
			}
		}
		if victim != nil {
			// Its slot is the new stream's from now; detach (below, outside the lock) counts
			// and closes it.
			delete(b.streams, victim.ep.id)
		}
	}
	if !b.open || len(b.streams) >= b.cfg.MaxStreams {
		open := b.open
		b.mu.Unlock()
		_ = c.Close()
		if !open {
			b.refused[RefuseClosed].Add(1)
			return nil, fmt.Errorf("bind: attach: %w", net.ErrClosed)
		}
		b.refused[RefuseFull].Add(1)
		return nil, fmt.Errorf("bind: attach %s: %w (%d, all authenticated)", c.RemoteAddr(), ErrTooManyStreams, b.cfg.MaxStreams)
	}
	b.nextID++
	s := &stream{
		bind:  b,
		conn:  c,
		queue: b.queue,
		free:  make(chan *packet, b.cfg.StreamBuffers),
		kick:  make(chan struct{}, 1),
		done:  make(chan struct{}),
	}
	s.wcond = sync.NewCond(&s.wmu)
	s.ep = &Endpoint{id: b.nextID, s: s}
	if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		s.ep.dstIP = ta.AddrPort().Addr().Unmap()
	}
	for range b.cfg.StreamBuffers {
		s.free <- &packet{home: s}
	}
	s.attachedAt = time.Now()
	s.lastRecv.Store(s.attachedAt.UnixNano())
	b.streams[s.ep.id] = s
	b.routines.Add(2)
	if b.cfg.AuthTimeout > 0 {
		// The timer's function runs only if the stream is still unmarked; MarkAuthenticated
		// and detach stop it. Set under b.mu, before any of them can run.
		s.authTimer = time.AfterFunc(b.cfg.AuthTimeout, func() {
			if s.authAt.Load() == 0 {
				s.detach(DetachUnauthenticated, fmt.Errorf("no authenticated packet within %v", b.cfg.AuthTimeout))
			}
		})
	}
	b.mu.Unlock()
	if victim != nil {
		victim.detach(DetachEvicted, fmt.Errorf("unauthenticated, displaced by %s with all %d slots taken", s.ep.DstToString(), b.cfg.MaxStreams))
	}

	b.attached.Add(1)
	b.log.V(1).Info("stream attached", "endpoint", s.ep.DstToString(), "remote", c.RemoteAddr().String())
	go s.routineRead()
	go s.routineWrite()
	return s.ep, nil
}

// Endpoints returns the endpoints of the streams attached now, in attach order.
func (b *Bind) Endpoints() []*Endpoint {
	b.mu.Lock()
	eps := make([]*Endpoint, 0, len(b.streams))
	for _, s := range b.streams {
		eps = append(eps, s.ep)
	}
	b.mu.Unlock()
	slices.SortFunc(eps, func(x, y *Endpoint) int { return cmp.Compare(x.id, y.id) })
	return eps
}

// Stats returns a snapshot of the counters.
func (b *Bind) Stats() Stats {
	b.mu.Lock()
	active := len(b.streams)
	b.mu.Unlock()
	st := Stats{
		StreamsAttached: b.attached.Load(),
		StreamsActive:   active,
		PacketsIn:       b.packetsIn.Load(),
		BytesIn:         b.bytesIn.Load(),
		PacketsOut:      b.packetsOut.Load(),
		BytesOut:        b.bytesOut.Load(),
		FramesRejected:  b.framesRejected.Load(),
	}
	for i := range st.StreamsDetached {
		st.StreamsDetached[i] = b.detached[i].Load()
	}
	for i := range st.SendDropped {
		st.SendDropped[i] = b.sendDropped[i].Load()
	}
	for i := range st.AttachRefused {
		st.AttachRefused[i] = b.refused[i].Load()
	}
	return st
}

// receive is the ReceiveFunc of one Open: it waits for one packet, then takes whatever else is
// already queued, up to the batch. held gives the pages of the device's buffers back once the
// packets have been small for a while.
func (b *Bind) receive(closed <-chan struct{}, queue <-chan *packet, held *idlemem.Held, packets [][]byte, sizes []int, eps []conn.Endpoint) (int, error) {
	// Closed wins over queued packets: after Close the device must see net.ErrClosed, not
	// what was still in flight.
	select {
	case <-closed:
		return 0, net.ErrClosed
	default:
	}
	held.Waiting(packets)
	var p *packet
	select {
	case <-closed:
		return 0, net.ErrClosed
	case p = <-queue:
	}
	n := 0
	for {
		// wireguard-go's receive buffers are MaxMessageSize (65,535) and frames never exceed
		// MaxFrameSize ≤ 65,535, so the copy is whole.
		sizes[n] = copy(packets[n], p.buf[:p.n])
		held.Filled(sizes[n])
		eps[n] = p.home.ep
		b.packetsIn.Add(1)
		b.bytesIn.Add(uint64(p.n))
		p.release()
		p.home.free <- p // never blocks: free holds every packet of its stream
		n++
		if n == len(packets) {
			return n, nil
		}
		select {
		case p = <-queue:
		default:
			return n, nil
		}
	}
}

// Send queues bufs as frames for ep's stream and returns once they are queued (waiting while
// the stream's pending buffer is full). It fails with ErrDetached (wrapped) once the stream has
// ended; a write error is therefore reported by the Sends after it. Packets that are not
// written are counted by reason.
func (b *Bind) Send(bufs [][]byte, ep conn.Endpoint) error {
	e, ok := ep.(*Endpoint)
	if !ok {
		return conn.ErrWrongEndpointType
	}
	return e.s.send(bufs)
}

// packet is one received frame, a slot of one stream (StreamBuffers of them) that holds a
// pooled buffer while it is queued. It travels free → reader → queue → ReceiveFunc → free.
type packet struct {
	buf    []byte
	pooled *[]byte // buf's pool entry (getBuf)
	n      int
	home   *stream
}

// release returns the packet's buffer to its pool.
func (p *packet) release() {
	if p.pooled != nil {
		putBuf(p.pooled)
	}
	p.buf, p.pooled = nil, nil
}

// stream is one attached connection.
type stream struct {
	bind  *Bind
	conn  net.Conn
	ep    *Endpoint
	queue chan<- *packet // the queue of the Open that was current at Attach
	free  chan *packet   // this stream's idle buffers; capacity StreamBuffers

	wmu      sync.Mutex
	wcond    *sync.Cond    // on wmu; broadcast when pending was taken or the stream ended
	pending  []byte        // frames queued by Send, not yet taken by routineWrite
	pendingN int           // packets in pending
	kick     chan struct{} // capacity 1: wakes routineWrite

	// lastRecv is when the last frame arrived (Unix nanoseconds; the attach time before the
	// first). Any sender's frames move it, junk included: it says the connection moves, not who
	// is behind it (Endpoint.LastReceive).
	lastRecv atomic.Int64
	// authAt is when the owner last marked the stream authenticated (Unix nanoseconds; 0:
	// never). Only WireGuard's verdict moves it (Endpoint.MarkAuthenticated).
	authAt     atomic.Int64
	attachedAt time.Time
	// authTimer enforces AuthTimeout (nil without one); set before the stream is published.
	// One runtime timer per stream, about 100 bytes: 16 streams, 1.6 KB.
	authTimer *time.Timer

	detachOnce sync.Once
	done       chan struct{} // closed on detach
	reason     DetachReason  // set before done is closed
	err        error         // set before done is closed
}

// routineRead feeds the stream's frames to the queue until the stream ends.
func (s *stream) routineRead() {
	defer s.bind.routines.Done()
	fr := frame.NewReader(s.conn, s.bind.cfg.MaxFrameSize)
	for {
		// Wait for a frame before taking a buffer, so an idle stream holds none.
		n, err := fr.PeekLen()
		if err != nil {
			s.readFailed(err)
			return
		}
		var p *packet
		select {
		case p = <-s.free:
		case <-s.done:
			return
		}
		// The buffer comes from the shared pools and goes back once WireGuard copied the
		// packet out (receive): a stream keeps packet slots, not memory, between frames.
		p.pooled = getBuf(n)
		p.buf = *p.pooled
		p.n, err = fr.ReadFrame(p.buf[:cap(p.buf)])
		if err != nil {
			p.release()
			s.free <- p
			s.readFailed(err)
			return
		}
		// One clock read per frame (tens of nanoseconds against a frame of up to 64 KiB).
		s.lastRecv.Store(time.Now().UnixNano())
		select {
		case s.queue <- p:
		case <-s.done:
			return
		}
	}
}

func (s *stream) readFailed(err error) {
	switch {
	case errors.Is(err, frame.ErrInvalidLength), errors.Is(err, frame.ErrTooLarge):
		s.bind.framesRejected.Add(1)
		s.detach(DetachBadFrame, err)
	case errors.Is(err, io.EOF):
		s.detach(DetachEOF, nil)
	default:
		s.detach(DetachReadError, err)
	}
}

// send queues one batch. See Bind.Send.
func (s *stream) send(bufs [][]byte) error {
	b := s.bind
	need := 0
	for _, p := range bufs {
		need += frame.HeaderSize + len(p)
	}
	s.wmu.Lock()
	for !s.ended() && len(s.pending) > 0 && len(s.pending)+need > maxPending {
		s.wcond.Wait()
	}
	if s.ended() {
		s.wmu.Unlock()
		b.sendDropped[SendDropDetached].Add(uint64(len(bufs)))
		return fmt.Errorf("bind: send to %s: %w", s.ep.DstToString(), ErrDetached)
	}
	var refused error
	for _, p := range bufs {
		var err error
		if s.pending, err = frame.AppendFrame(s.pending, p, b.cfg.MaxFrameSize); err != nil {
			// WireGuard never sends these; refuse the packet, keep the stream.
			b.sendDropped[SendDropRefused].Add(1)
			refused = fmt.Errorf("bind: send to %s: %w", s.ep.DstToString(), err)
			continue
		}
		s.pendingN++
	}
	s.wmu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default: // already kicked; the writer will take these frames too
	}
	return refused
}

func (s *stream) ended() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// routineWrite writes what Send queued, everything pending at once, until the stream ends. It
// owns two buffers, swapping the one it has written for the one Send filled.
func (s *stream) routineWrite() {
	b := s.bind
	defer b.routines.Done()
	var spare []byte
	for {
		select {
		case <-s.kick:
		case <-s.done:
			s.wmu.Lock()
			b.sendDropped[SendDropDetached].Add(uint64(s.pendingN))
			s.pending, s.pendingN = nil, 0
			s.wmu.Unlock()
			return
		}
		s.wmu.Lock()
		buf, n := s.pending, s.pendingN
		s.pending, s.pendingN = spare[:0], 0
		s.wcond.Broadcast()
		s.wmu.Unlock()
		if n == 0 {
			spare = buf
			continue
		}
		if b.cfg.WriteTimeout > 0 {
			// Failing to set a deadline on a closing connection shows up as a write error.
			_ = s.conn.SetWriteDeadline(time.Now().Add(b.cfg.WriteTimeout))
		}
		if _, err := s.conn.Write(buf); err != nil {
			// What part of a failed write reached the peer is unknown; it will not read
			// the rest of the stream anyway, so the whole write counts as lost.
			b.sendDropped[SendDropWriteError].Add(uint64(n))
			s.detach(DetachWriteError, err)
			continue // to the done case: count what is still pending and return
		}
		b.packetsOut.Add(uint64(n))
		b.bytesOut.Add(uint64(len(buf) - n*frame.HeaderSize))
		spare = buf
		if len(buf) < smallWrite && cap(buf) > keepWriteBuf {
			// The load that grew it is over: an idle stream keeps no large buffers (both
			// go after two small writes) and a new load grows them again.
			spare = nil
		}
	}
}

// An idle stream's write buffers: a write of fewer than smallWrite bytes (keepalives,
// heartbeats, a lone small packet) drops a buffer larger than keepWriteBuf, which only a
// load fills. Under load the two buffers stay (each maxPending plus a frame, or a whole Send
// batch when one is larger: 549 KB after batches of 8 frames at MTU 60,000).
const (
	smallWrite   = 4 << 10
	keepWriteBuf = 64 << 10
)

// detach ends the stream once: it leaves the Bind's set, its connection is closed (which ends
// the reader), its endpoint's Done is closed and the reason is counted and logged.
func (s *stream) detach(reason DetachReason, err error) {
	s.detachOnce.Do(func() {
		b := s.bind
		b.mu.Lock()
		if b.streams[s.ep.id] == s { // an evicted stream has left the set already
			delete(b.streams, s.ep.id)
		}
		b.mu.Unlock()
		if s.authTimer != nil {
			s.authTimer.Stop()
		}
		s.reason, s.err = reason, err
		b.detached[reason].Add(1) // before done, so that whoever waits on Done sees it counted
		close(s.done)
		_ = s.conn.Close()
		// Wake Sends waiting for room; they see the stream ended.
		s.wmu.Lock()
		s.wcond.Broadcast()
		s.wmu.Unlock()
		kv := []any{"endpoint", s.ep.DstToString(), "remote", s.conn.RemoteAddr().String(), "reason", reason.String()}
		if err != nil {
			kv = append(kv, "error", err.Error())
		}
		// A stream closed on purpose is routine; one that ended by itself is news. Streams
		// that never authenticated are whoever can reach the listener, at a rate they choose:
		// counted, logged only verbosely.
		if reason == DetachClosed || reason == DetachPruned || reason == DetachEvicted || reason == DetachUnauthenticated {
			b.log.V(1).Info("stream detached", kv...)
		} else {
			b.log.Info("stream detached", kv...)
		}
	})
}

// Endpoint is one attached stream as WireGuard sees it. Its name is "stream/<n>", numbered
// from 1 in attach order per Bind and never reused. Beyond conn.Endpoint it tells when the
// stream ended and why, so that the dialing side knows when to dial again.
type Endpoint struct {
	id    uint64
	s     *stream
	dstIP netip.Addr // the TCP peer's address, when there is one
}

var _ conn.Endpoint = (*Endpoint)(nil)

// ID returns the stream's number.
func (e *Endpoint) ID() uint64 { return e.id }

// Done is closed when the stream has been detached.
func (e *Endpoint) Done() <-chan struct{} { return e.s.done }

// Err reports why the stream was detached: nil while attached; the DetachReason and the error
// that caused it (nil for DetachEOF and DetachClosed) after Done is closed.
func (e *Endpoint) Err() (DetachReason, error) {
	select {
	case <-e.s.done:
		return e.s.reason, e.s.err
	default:
		return 0, nil
	}
}

// LastReceive is when the stream's last frame arrived, or when it was attached if none has.
func (e *Endpoint) LastReceive() time.Time { return time.Unix(0, e.s.lastRecv.Load()) }

// MarkAuthenticated records that WireGuard accepted a packet that came on the stream, seen at
// t (the owner learns it from WireGuard's state, not from the packet itself). From the first
// mark on, the stream is safe from AuthTimeout and from eviction. A t older than the last
// mark is ignored.
func (e *Endpoint) MarkAuthenticated(t time.Time) {
	n := t.UnixNano()
	for {
		old := e.s.authAt.Load()
		if n <= old {
			return
		}
		if e.s.authAt.CompareAndSwap(old, n) {
			if old == 0 && e.s.authTimer != nil {
				e.s.authTimer.Stop()
			}
			return
		}
	}
}

// LastAuthenticated is the last MarkAuthenticated time, the zero Time if the stream never was.
func (e *Endpoint) LastAuthenticated() time.Time {
	if n := e.s.authAt.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Attached is when the stream was attached.
func (e *Endpoint) Attached() time.Time { return e.s.attachedAt }

// Prune detaches the stream as no longer used (DetachPruned) and closes its connection.
func (e *Endpoint) Prune() {
	e.s.detach(DetachPruned, nil)
}

// Close detaches the stream and closes its connection.
func (e *Endpoint) Close() error {
	e.s.detach(DetachClosed, nil)
	return nil
}

// RemoteAddr is the stream connection's remote address.
func (e *Endpoint) RemoteAddr() net.Addr { return e.s.conn.RemoteAddr() }

// ClearSrc does nothing: a stream has no source address to choose.
func (e *Endpoint) ClearSrc() {}

// SrcToString returns "": a stream has no source address to choose.
func (e *Endpoint) SrcToString() string { return "" }

// DstToString returns the endpoint's name, "stream/<n>", which ParseEndpoint accepts.
func (e *Endpoint) DstToString() string { return endpointPrefix + strconv.FormatUint(e.id, 10) }

// DstToBytes identifies the stream for WireGuard's cookie MACs (the stream number, big endian).
func (e *Endpoint) DstToBytes() []byte {
	return binary.BigEndian.AppendUint64(nil, e.id)
}

// DstIP returns the TCP peer's address (the invalid Addr for other connections). WireGuard
// rate-limits handshakes per DstIP under load; on the seed every stream arrives from the
// ingress, so they share one budget there.
func (e *Endpoint) DstIP() netip.Addr { return e.dstIP }

// SrcIP returns the invalid Addr: a stream has no source address to choose.
func (e *Endpoint) SrcIP() netip.Addr { return netip.Addr{} }

func (e *Endpoint) String() string { return e.DstToString() }

// Receive buffers are pooled by size class, powers of two from minBufShift (2 KiB: a frame at
// MTU 1420) to maxBufShift (64 KiB: frame.MaxSize), and shared by all streams. Kept per stream,
// up to StreamBuffers buffers of the largest size it had read would stay for as long as it
// lived: 1.9 MB per stream at MTU 60,000 after any load, resident for good. Pooled, the buffers
// in use are still bounded by the streams' slots (MaxStreams × StreamBuffers), and those left
// in the pools after a load go with the garbage collector's next two cycles
// (internal/host/idlemem runs them once the process is idle). A buffer is at most twice its
// frame.
const (
	minBufShift = 11
	maxBufShift = 16
)

var bufPools [maxBufShift - minBufShift + 1]sync.Pool

// bufClass is the pool index for a frame of n bytes (n ≤ 1 << maxBufShift).
func bufClass(n int) int {
	c := 0
	for n > 1<<(minBufShift+c) {
		c++
	}
	return c
}

// getBuf returns a buffer with a capacity of at least n bytes (n ≤ frame.MaxSize), its
// contents undefined, to be given back with putBuf.
func getBuf(n int) *[]byte {
	c := bufClass(n)
	if b, ok := bufPools[c].Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 1<<(minBufShift+c))
	return &b
}

// putBuf returns a buffer from getBuf to its pool.
func putBuf(b *[]byte) {
	bufPools[bufClass(cap(*b))].Put(b)
}
