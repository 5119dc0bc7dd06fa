package h2relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// peer is one HTTP/2 connection of the relay, a client's (the relay serves it) or an
// upstream's (the relay is its client). Its reader goroutine handles every frame it receives;
// frames to it go through its writer.
type peer struct {
	r      *Relay
	client bool // a client connection (the relay is the server)
	conn   net.Conn
	fr     *http2.Framer // reads from in; nil while parked
	dec    *hpack.Decoder
	in     probeReader
	raw    syscall.RawConn // a client connection's socket, armed in the lot while parked; nil: never parked
	w      *writer
	up     *Upstream // an upstream connection's pool
	// director decides a client connection's requests.
	director Director

	mu          sync.Mutex
	streams     map[uint32]*stream
	sendWindow  int64     // the peer's connection window for the relay
	connUnacked uint32    // bytes the peer sent, not yet given back on the connection's window
	blocked     []*stream // streams with data held for the peer's connection window
	initWindow  int64     // the peer's SETTINGS_INITIAL_WINDOW_SIZE
	maxFrame    uint32    // the peer's SETTINGS_MAX_FRAME_SIZE
	maxStreams  uint32    // an upstream's SETTINGS_MAX_CONCURRENT_STREAMS
	nextID      uint32    // an upstream connection's next stream id
	lastID      uint32    // a client connection's highest stream id
	goingAway   bool      // an upstream sent GOAWAY: no new streams
	closed      bool
	ctx         context.Context
	cancel      context.CancelFunc
	stop        func() bool // ends a client connection's tie to its ServeConn context
	// idleUntil is when a client connection without streams is closed: IdleTimeout after it
	// had none (zero while it has).
	idleUntil time.Time
	parked    bool        // a client connection's reader ended until its socket is readable (park.go)
	idle      *time.Timer // a parked connection's idle deadline
	lotID     uint64      // the park's id in the relay's lot (under the lot's mu); 0: not parked
}

// stream is one request relayed: its client stream and its upstream stream.
type stream struct {
	mu     sync.Mutex
	client *peer
	// up is the upstream connection, nil while one is dialed; it is set, and read on the
	// client's side, under client.mu (attach), and cancelled tells attach that the client's
	// side is gone meanwhile.
	up             *peer
	cancelled      bool
	pool           *Upstream // up's pool, whose count of requests the stream is in
	cid, uid       uint32
	toUp, toClient flow
	// credit is what each sender may still send on the stream before the relay grants more:
	// the client's (upCredit) and the upstream's (clientCredit).
	upCredit, clientCredit int64
	responded              bool // the response head went to the client
	done                   bool
}

func (r *Relay) newPeer(c net.Conn, client bool, up *Upstream) *peer {
	p := &peer{r: r, client: client, conn: c, up: up, dec: hpack.NewDecoder(4096, nil),
		streams: map[uint32]*stream{}, sendWindow: 65535, initWindow: 65535, maxFrame: 16384, maxStreams: 100, nextID: 1}
	p.in.r = frameSource(c)
	p.fr = newReadFramer(&p.in, p.dec, r.cfg.MaxHeaderListSize)
	if client && r.cfg.ParkAfter > 0 {
		p.raw = rawConnOf(c)
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.w = newWriter(c, r.cfg.WriteTimeout, func(err error) { p.close(err) })
	return p
}

// settings are what the relay tells every peer: its stream window, the connection's, the
// header list it takes, and (as a server) the streams a client may open.
func (p *peer) settings() error {
	cfg := p.r.cfg
	return p.w.frames(func(fr *http2.Framer) error {
		ss := []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: cfg.StreamWindow},
			{ID: http2.SettingMaxHeaderListSize, Val: cfg.MaxHeaderListSize}}
		if p.client {
			ss = append(ss, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: cfg.MaxStreams})
		} else {
			ss = append(ss, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
		}
		if err := fr.WriteSettings(ss...); err != nil {
			return err
		}
		return fr.WriteWindowUpdate(0, cfg.connWindow()-65535)
	})
}

// close ends the connection and every stream on it: the other side of each is reset.
func (p *peer) close(err error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	streams := make([]*stream, 0, len(p.streams))
	for _, s := range p.streams {
		streams = append(streams, s)
	}
	p.streams = map[uint32]*stream{}
	p.mu.Unlock()
	if p.raw != nil {
		p.r.lot.take(p)
	}
	p.cancel()
	if p.stop != nil {
		p.stop()
	}
	p.conn.Close()
	if p.client {
		p.r.mu.Lock()
		delete(p.r.clients, p)
		p.r.mu.Unlock()
	}
	for _, s := range streams {
		if p.client {
			s.cancelUp()
		} else {
			s.failClient(http2.ErrCodeInternal)
		}
	}
	if p.up != nil {
		p.up.forget(p)
	}
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		p.r.cfg.Log.V(1).Info("HTTP/2 connection ended", "client", p.client, "remote", p.conn.RemoteAddr().String(), "error", err.Error())
	}
}

// read handles the peer's frames until its connection ends or, a client's, parks.
func (p *peer) read() {
	var err error
	parked := false
	defer func() {
		if !parked {
			p.close(err)
		}
	}()
	for {
		if p.client {
			if err = p.waitFrame(); err != nil {
				parked = err == errParked
				return
			}
		}
		var f http2.Frame
		f, err = p.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				p.resetStream(se.StreamID, se.Code)
				err = nil
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				_ = p.w.frames(func(fr *http2.Framer) error { return fr.WriteGoAway(p.lastID, http2.ErrCode(ce), nil) })
			}
			return
		}
		if err = p.handle(f); err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				_ = p.w.frames(func(fr *http2.Framer) error { return fr.WriteGoAway(p.lastID, http2.ErrCode(ce), nil) })
			}
			return
		}
	}
}

func (p *peer) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if err := p.applySettings(f); err != nil {
			return err
		}
		return p.w.frames(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
	case *http2.PingFrame:
		if f.IsAck() {
			return nil
		}
		return p.w.frames(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
	case *http2.WindowUpdateFrame:
		return p.windowUpdate(f.StreamID, f.Increment)
	case *http2.MetaHeadersFrame:
		if p.client {
			return p.clientHeaders(f)
		}
		return p.upstreamHeaders(f)
	case *http2.DataFrame:
		return p.data(f)
	case *http2.RSTStreamFrame:
		p.peerReset(f.StreamID, f.ErrCode)
		return nil
	case *http2.GoAwayFrame:
		return p.goAway(f)
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(http2.ErrCodeProtocol) // push is off
	}
	return nil // PRIORITY and unknown frames: ignored
}

func (p *peer) applySettings(f *http2.SettingsFrame) error {
	return f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingInitialWindowSize:
			p.mu.Lock()
			delta := int64(s.Val) - p.initWindow
			p.initWindow = int64(s.Val)
			var grown []*stream
			for _, st := range p.streams {
				st.mu.Lock()
				fl := st.flowTo(p)
				fl.window += delta
				if delta > 0 && len(fl.held) > 0 {
					grown = append(grown, st)
				}
				st.mu.Unlock()
			}
			p.mu.Unlock()
			for _, st := range grown {
				p.pump(st)
			}
		case http2.SettingMaxFrameSize:
			p.mu.Lock()
			p.maxFrame = s.Val
			p.mu.Unlock()
		case http2.SettingMaxConcurrentStreams:
			p.mu.Lock()
			p.maxStreams = s.Val
			p.mu.Unlock()
		case http2.SettingHeaderTableSize:
			p.w.mu.Lock()
			p.w.enc.SetMaxDynamicTableSizeLimit(s.Val)
			p.w.mu.Unlock()
		}
		return nil
	})
}

// flowTo is the direction of s whose receiver is p.
func (s *stream) flowTo(p *peer) *flow {
	if p == s.client {
		return &s.toClient
	}
	return &s.toUp
}

// flowFrom is the direction of s whose sender is p.
func (s *stream) flowFrom(p *peer) *flow {
	if p == s.client {
		return &s.toUp
	}
	return &s.toClient
}

// idOn is s's stream id on p.
func (s *stream) idOn(p *peer) uint32 {
	if p == s.client {
		return s.cid
	}
	return s.uid
}

// otherLocked is the peer on the other side of s from p, p.mu held; nil while the upstream
// connection is dialed.
func (s *stream) otherLocked(p *peer) *peer {
	if p == s.client {
		return s.up
	}
	return s.client
}

// other is otherLocked with p.mu taken.
func (s *stream) other(p *peer) *peer {
	if p != s.client {
		return s.client
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return s.up
}

// clientHeaders starts a request, or takes its trailers.
func (p *peer) clientHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	p.mu.Lock()
	if s := p.streams[id]; s != nil {
		p.mu.Unlock()
		if !f.StreamEnded() {
			return http2.ConnectionError(http2.ErrCodeProtocol) // a second head that does not end it
		}
		return p.forwardTrailers(s, f.Fields)
	}
	if id%2 == 0 || id <= p.lastID {
		p.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	p.lastID = id
	full := uint32(len(p.streams)) >= p.r.cfg.MaxStreams
	p.mu.Unlock()
	if full {
		p.resetStream(id, http2.ErrCodeRefusedStream)
		return nil
	}
	h := &Head{Method: f.PseudoValue("method"), Scheme: f.PseudoValue("scheme"), Authority: f.PseudoValue("authority"),
		Path: f.PseudoValue("path"), Fields: append([]hpack.HeaderField(nil), f.RegularFields()...), EndStream: f.StreamEnded()}
	if h.Method == "CONNECT" {
		p.resetStream(id, http2.ErrCodeRefusedStream) // no extended CONNECT here
		return nil
	}
	up, ans := p.director.Direct(p.ctx, h)
	if up == nil {
		if ans == nil {
			ans = &Answer{Status: 502}
		}
		return p.answer(id, ans, !h.EndStream)
	}
	return p.r.open(p, id, up, h)
}

// answer sends the relay's own response on stream id; reset stops a body still coming.
func (p *peer) answer(id uint32, a *Answer, reset bool) error {
	size := p.frameSize() // before the writer's lock: p.mu comes first where both are taken
	return p.w.frames(func(fr *http2.Framer) error {
		if err := p.w.headers(fr, id, statusFields(a), len(a.Body) == 0, size); err != nil {
			return err
		}
		for b := a.Body; len(b) > 0; {
			n := min(len(b), int(size))
			if err := fr.WriteData(id, n == len(b), b[:n]); err != nil {
				return err
			}
			b = b[n:]
		}
		if reset {
			return fr.WriteRSTStream(id, http2.ErrCodeNo)
		}
		return nil
	})
}

func (p *peer) frameSize() uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxFrame
}

// upstreamHeaders forwards a response head (informational ones too) or trailers to the client.
func (p *peer) upstreamHeaders(f *http2.MetaHeadersFrame) error {
	p.mu.Lock()
	s := p.streams[f.StreamID]
	p.mu.Unlock()
	if s == nil {
		return nil // reset meanwhile
	}
	s.mu.Lock()
	if s.responded && f.StreamEnded() {
		s.mu.Unlock()
		return p.forwardTrailers(s, f.Fields)
	}
	s.responded = true
	end := f.StreamEnded()
	if end {
		s.toClient.ended = true
	}
	s.mu.Unlock()
	c := s.client
	// A client that cannot be written to closes on its own; the upstream goes on.
	size := c.frameSize()
	_ = c.w.frames(func(fr *http2.Framer) error { return c.w.headers(fr, s.cid, f.Fields, end, size) })
	if end {
		s.finish()
	}
	return nil
}

// forwardTrailers sends trailers from p to the other side of s, after the data held for it.
func (p *peer) forwardTrailers(s *stream, fields []hpack.HeaderField) error {
	s.mu.Lock()
	fl := s.flowFrom(p)
	fl.trailers = append([]hpack.HeaderField(nil), fields...)
	fl.heldEnd = true
	s.mu.Unlock()
	// Read after the trailers are held: an upstream attached since sends them itself.
	if to := s.other(p); to != nil {
		to.pump(s)
	}
	return nil
}

// data takes a DATA frame from p: its bytes are held for the other side and sent on as that
// side's windows allow; the connection's window is given back to p at once (a stream holds at
// most its own window), the stream's as its bytes go on.
func (p *peer) data(f *http2.DataFrame) error {
	n := f.Length // padding included: it counts against the windows
	p.mu.Lock()
	s := p.streams[f.StreamID]
	// The connection's window goes back once a stream window's worth was taken, not per
	// frame: a WINDOW_UPDATE for each small response would be a write to the replica per
	// request. The sender is never held back by it: the connection's window is MaxStreams
	// stream windows (connWindow), and what is not yet given back is less than one.
	p.connUnacked += n
	var refund uint32
	if p.connUnacked >= p.r.cfg.StreamWindow {
		refund, p.connUnacked = p.connUnacked, 0
	}
	p.mu.Unlock()
	if refund > 0 {
		if err := p.w.frames(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, refund) }); err != nil {
			return ignoreClosed(err)
		}
	}
	if s == nil {
		return nil // a stream reset meanwhile: its window is given back, its bytes dropped
	}
	s.mu.Lock()
	credit := &s.upCredit
	if !p.client {
		credit = &s.clientCredit
	}
	if int64(n) > *credit {
		s.mu.Unlock()
		p.resetStream(f.StreamID, http2.ErrCodeFlowControl)
		s.resetOther(p)
		return nil
	}
	*credit -= int64(n)
	fl := s.flowFrom(p)
	fl.held = append(fl.held, f.Data()...)
	fl.unacked += n - uint32(len(f.Data())) // the padding, given back with the next grant
	if f.StreamEnded() {
		fl.heldEnd = true
	}
	s.mu.Unlock()
	// Read after the bytes are held: an upstream attached since sends them itself.
	if to := s.other(p); to != nil {
		to.pump(s)
	}
	return nil
}

// pump sends what s holds for p as far as p's windows allow, gives the sender back the window
// of what went on, and, when the direction ended both ways, finishes the stream.
func (p *peer) pump(s *stream) {
	p.mu.Lock()
	from := s.otherLocked(p) // nil while dialed: then nothing is held for the client
	s.mu.Lock()
	fl := s.flowTo(p)
	if fl.ended || p.closed {
		s.mu.Unlock()
		p.mu.Unlock()
		return
	}
	id := s.idOn(p)
	maxFrame := int64(p.maxFrame)
	var sent int64
	err := p.w.frames(func(fr *http2.Framer) error {
		for len(fl.held) > 0 {
			n := min(int64(len(fl.held)), fl.window, p.sendWindow, maxFrame)
			if n <= 0 {
				break
			}
			last := n == int64(len(fl.held)) && fl.heldEnd && fl.trailers == nil
			if err := fr.WriteData(id, last, fl.held[:n]); err != nil {
				return err
			}
			fl.held = fl.held[n:]
			fl.window -= n
			p.sendWindow -= n
			sent += n
			if last {
				fl.ended = true
			}
		}
		if len(fl.held) == 0 {
			fl.held = nil
			switch {
			case fl.trailers != nil && !fl.ended:
				if err := p.w.headers(fr, id, fl.trailers, true, p.maxFrame); err != nil {
					return err
				}
				fl.ended, fl.trailers = true, nil
			case fl.heldEnd && !fl.ended:
				if err := fr.WriteData(id, true, nil); err != nil {
					return err
				}
				fl.ended = true
			}
		}
		return nil
	})
	if len(fl.held) > 0 && fl.window > 0 && p.sendWindow <= 0 && !fl.queued {
		fl.queued = true
		p.blocked = append(p.blocked, s)
	}
	grant := uint32(sent) + fl.unacked
	fl.unacked = 0
	if p == s.client {
		s.clientCredit += int64(grant)
	} else {
		s.upCredit += int64(grant)
	}
	ended := fl.ended
	var sid uint32
	if from != nil {
		sid = s.idOn(from)
	}
	s.mu.Unlock()
	p.mu.Unlock()
	if err != nil {
		return
	}
	if grant > 0 && !ended && from != nil {
		_ = from.w.frames(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(sid, grant) })
	}
	if ended {
		s.finish()
	}
}

// windowUpdate grows one of p's windows for the relay and sends on what waited for it.
func (p *peer) windowUpdate(id, n uint32) error {
	if id == 0 {
		p.mu.Lock()
		p.sendWindow += int64(n)
		if p.sendWindow > 1<<31-1 {
			p.mu.Unlock()
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		blocked := p.blocked
		p.blocked = nil
		for _, s := range blocked {
			s.mu.Lock()
			s.flowTo(p).queued = false
			s.mu.Unlock()
		}
		p.mu.Unlock()
		for _, s := range blocked {
			p.pump(s)
		}
		return nil
	}
	p.mu.Lock()
	s := p.streams[id]
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	fl := s.flowTo(p)
	fl.window += int64(n)
	s.mu.Unlock()
	p.pump(s)
	return nil
}

// resetStream resets stream id on p (and forgets it there).
func (p *peer) resetStream(id uint32, code http2.ErrCode) {
	p.mu.Lock()
	p.forgetLocked(id)
	p.mu.Unlock()
	_ = p.w.frames(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
}

// peerReset: p reset stream id; the other side is reset too (a refusal passed on as it is,
// so that a client retries it).
func (p *peer) peerReset(id uint32, code http2.ErrCode) {
	p.mu.Lock()
	s := p.streams[id]
	p.forgetLocked(id)
	p.mu.Unlock()
	if s == nil {
		return
	}
	if p.client {
		s.cancelUp()
	} else {
		s.resetClient(code)
	}
}

// goAway: an upstream ends; streams it never took are refused to their clients, which retry.
func (p *peer) goAway(f *http2.GoAwayFrame) error {
	p.mu.Lock()
	p.goingAway = true
	var refused []*stream
	for id, s := range p.streams {
		if !p.client && id > f.LastStreamID {
			refused = append(refused, s)
			delete(p.streams, id)
		}
	}
	n := len(p.streams)
	p.mu.Unlock()
	for _, s := range refused {
		s.resetClient(http2.ErrCodeRefusedStream)
		s.forget()
	}
	if n == 0 {
		return errClosed
	}
	return nil
}

// cancelUp ends s's upstream side: its upstream stream reset or, while the connection is
// dialed, its attach called off.
func (s *stream) cancelUp() {
	c := s.client
	c.mu.Lock()
	s.cancelled = true
	up := s.up
	c.mu.Unlock()
	if up != nil {
		up.resetStream(s.uid, http2.ErrCodeCancel)
	}
	s.forget()
}

func (s *stream) resetClient(code http2.ErrCode) {
	s.client.resetStream(s.cid, code)
	s.forget()
}

// failClient ends the client's side of a stream whose upstream went away: a 502 if nothing of
// the response was sent, else a reset.
func (s *stream) failClient(code http2.ErrCode) {
	s.mu.Lock()
	responded := s.responded
	s.responded = true
	s.mu.Unlock()
	if !responded {
		s.client.r.upstreamFailed(fmt.Errorf("the replica's connection ended before the response: %v", code))
		_ = s.client.answer(s.cid, s.client.r.cfg.BadGateway, false)
		s.client.mu.Lock()
		s.client.forgetLocked(s.cid)
		s.client.mu.Unlock()
		s.forget()
		return
	}
	s.resetClient(code)
}

// resetOther resets s on the side across from p.
func (s *stream) resetOther(p *peer) {
	if p == s.client {
		s.cancelUp()
	} else {
		s.resetClient(http2.ErrCodeCancel)
	}
}

// finish forgets s once both directions ended.
func (s *stream) finish() {
	s.mu.Lock()
	done := s.toUp.ended && s.toClient.ended
	s.mu.Unlock()
	if done {
		s.client.mu.Lock()
		s.client.forgetLocked(s.cid)
		s.client.mu.Unlock()
		s.forget()
	}
}

// forget releases s's place on its upstream, once.
func (s *stream) forget() {
	s.mu.Lock()
	if s.done {
		s.mu.Unlock()
		return
	}
	s.done = true
	s.mu.Unlock()
	if up := s.other(s.client); up != nil {
		up.mu.Lock()
		delete(up.streams, s.uid)
		up.mu.Unlock()
	}
	s.pool.release()
}

func ignoreClosed(err error) error {
	if err != nil && (errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) || errors.Is(err, errClosed)) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("h2relay: %w", err)
	}
	return nil
}
