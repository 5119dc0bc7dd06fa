package h2relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Relay relays the requests of the client connections it serves.
type Relay struct {
	cfg Config
	wg  sync.WaitGroup
	lot lot

	mu      sync.Mutex
	clients map[*peer]struct{}
	closing bool
}

// New returns a Relay.
func New(cfg Config) *Relay {
	r := &Relay{cfg: cfg.withDefaults(), clients: map[*peer]struct{}{}}
	r.lot.r = r
	return r
}

// Shutdown drains: every client connection gets a GOAWAY and is closed once its streams
// ended; those still open when ctx ends are closed then. New connections are refused.
func (r *Relay) Shutdown(ctx context.Context) error {
	r.mu.Lock()
	r.closing = true
	peers := make([]*peer, 0, len(r.clients))
	for p := range r.clients {
		peers = append(peers, p)
	}
	r.mu.Unlock()
	for _, p := range peers {
		p.mu.Lock()
		last := p.lastID
		p.mu.Unlock()
		_ = p.w.frames(func(fr *http2.Framer) error { return fr.WriteGoAway(last, http2.ErrCodeNo, nil) })
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		open := 0
		for _, p := range peers {
			p.mu.Lock()
			idle, closed := len(p.streams) == 0, p.closed
			p.mu.Unlock()
			switch {
			case closed:
			case idle || ctx.Err() != nil:
				p.close(errClosed)
			default:
				open++
			}
		}
		if open == 0 {
			return ctx.Err()
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// ServeConn serves one client connection that negotiated h2 (its TLS handshake done) until it
// ends or ctx does, asking d about each of its requests. It returns at once; the Relay owns c.
func (r *Relay) ServeConn(ctx context.Context, c net.Conn, d Director) {
	p := r.newPeer(c, true, nil)
	p.director = d
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		c.Close()
		return
	}
	r.clients[p] = struct{}{}
	r.mu.Unlock()
	r.wg.Add(1)
	// Tied to ctx until it closes (close ends the tie): a parked connection has no goroutine
	// that could.
	p.stop = context.AfterFunc(ctx, func() { p.close(ctx.Err()) })
	go func() {
		defer r.wg.Done()
		_ = c.SetReadDeadline(time.Now().Add(r.cfg.PrefaceTimeout))
		var preface [len(http2.ClientPreface)]byte
		if _, err := io.ReadFull(c, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
			p.close(fmt.Errorf("h2relay: no client preface: %v", err))
			return
		}
		if err := p.settings(); err != nil {
			p.close(err)
			return
		}
		// The client's first frame must be its SETTINGS, within the preface's time.
		f, err := p.fr.ReadFrame()
		if sf, ok := f.(*http2.SettingsFrame); err != nil || !ok || sf.IsAck() {
			p.close(fmt.Errorf("h2relay: the client's first frame is not SETTINGS: %T %v", f, err))
			return
		}
		if err := p.handle(f); err != nil {
			p.close(err)
			return
		}
		p.read()
	}()
}

// Parked is how many client connections are parked (Config.ParkAfter).
func (r *Relay) Parked() int64 { return int64(r.lot.count()) }

// Wait waits for the client connections' readers to end.
func (r *Relay) Wait() { r.wg.Wait() }

// Upstream is one kube-apiserver replica: HTTP/2 connections to it, made as needed (one dial at
// a time), each carrying as many streams as it allows.
type Upstream struct {
	r    *Relay
	dial func(ctx context.Context) (net.Conn, error)

	mu      sync.Mutex
	conns   []*peer
	active  int       // requests open or waiting for a connection
	dialing *dialCall // the dial under way
	// failures counts the dials that failed in a row; none is tried again before downUntil.
	failures  int
	downUntil time.Time
	retired   bool
	closed    bool
}

// dialCall is one dial of an upstream that the requests waiting for a connection share.
type dialCall struct {
	done chan struct{}
	p    *peer
	err  error
}

// Backoff after a failed dial: 1 s, doubled per failure in a row up to 16 s (five failures).
const (
	firstBackoff = time.Second
	maxBackoff   = 16 * time.Second
)

// NewUpstream returns an upstream whose connections dial makes (TLS done, h2 negotiated).
func (r *Relay) NewUpstream(dial func(ctx context.Context) (net.Conn, error)) *Upstream {
	return &Upstream{r: r, dial: dial}
}

// Outstanding is how many requests are open on the upstream or waiting for its connection.
func (u *Upstream) Outstanding() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.active
}

// Failing: the upstream's last dial failed, and its backoff has not run out. A Director should
// send requests to it only when every other upstream fails too.
func (u *Upstream) Failing() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return time.Now().Before(u.downUntil)
}

// Close ends every connection to the upstream, and those dialed later at once.
func (u *Upstream) Close() {
	u.mu.Lock()
	u.closed = true
	conns := u.conns
	u.conns = nil
	u.mu.Unlock()
	for _, p := range conns {
		p.close(errClosed)
	}
}

// Retire closes the upstream's connections as their streams end (idle ones at once): its
// address or its TLS configuration is gone, and a Director no longer picks it.
func (u *Upstream) Retire() {
	u.mu.Lock()
	u.retired = true
	u.mu.Unlock()
	u.closeIdle()
}

func (u *Upstream) closeIdle() {
	u.mu.Lock()
	var idle []*peer
	for _, p := range u.conns {
		p.mu.Lock()
		if len(p.streams) == 0 {
			idle = append(idle, p)
		}
		p.mu.Unlock()
	}
	u.mu.Unlock()
	for _, p := range idle {
		p.close(errClosed)
	}
}

// readyLocked is a connection with room for one more stream, or nil; u.mu is held.
func (u *Upstream) readyLocked() *peer {
	for _, p := range u.conns {
		p.mu.Lock()
		ok := !p.closed && !p.goingAway && uint32(len(p.streams)) < p.maxStreams && p.nextID < 1<<31-1
		p.mu.Unlock()
		if ok {
			return p
		}
	}
	return nil
}

func (u *Upstream) ready() *peer {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.readyLocked()
}

// get is a connection with room for one more stream: an open one, the one being dialed, or a
// new one. Requests that wait for the same dial share it, so that a burst of them makes one
// connection, not one each.
func (u *Upstream) get(ctx context.Context) (*peer, error) {
	for {
		u.mu.Lock()
		if p := u.readyLocked(); p != nil {
			u.mu.Unlock()
			return p, nil
		}
		if d := u.dialing; d != nil {
			u.mu.Unlock()
			select {
			case <-d.done:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			if d.err != nil {
				return nil, d.err
			}
			continue // its connection may be full already
		}
		d := &dialCall{done: make(chan struct{})}
		u.dialing = d
		u.mu.Unlock()
		// Not the request's context: the others waiting for it need it when this one goes.
		// The dial function bounds it.
		d.p, d.err = u.connect(context.WithoutCancel(ctx))
		u.mu.Lock()
		u.dialing = nil
		u.mu.Unlock()
		close(d.done)
		return d.p, d.err
	}
}

// connect dials a connection, sends the preface and settings and starts its reader.
func (u *Upstream) connect(ctx context.Context) (*peer, error) {
	c, err := u.dial(ctx)
	var p *peer
	if err == nil {
		p = u.r.newPeer(c, false, u)
		if _, err = c.Write([]byte(http2.ClientPreface)); err == nil {
			err = p.settings()
		}
		if err != nil {
			c.Close()
		}
	}
	u.mu.Lock()
	if err != nil {
		u.failures++
		u.downUntil = time.Now().Add(min(firstBackoff<<(min(u.failures, 6)-1), maxBackoff))
		u.mu.Unlock()
		return nil, err
	}
	u.failures, u.downUntil = 0, time.Time{}
	if u.closed { // closed while dialling
		u.mu.Unlock()
		p.close(errClosed)
		return nil, errClosed
	}
	u.conns = append(u.conns, p)
	u.mu.Unlock()
	u.r.wg.Add(1)
	go func() {
		defer u.r.wg.Done()
		p.read()
	}()
	return p, nil
}

func (u *Upstream) forget(p *peer) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for i, q := range u.conns {
		if q == p {
			u.conns = append(u.conns[:i], u.conns[i+1:]...)
			return
		}
	}
}

func (u *Upstream) release() {
	u.mu.Lock()
	u.active--
	retired := u.retired
	u.mu.Unlock()
	if retired {
		u.closeIdle()
	}
}

// open starts stream cid of client c on upstream u with head h: at once on a connection with
// room, else once a connection is dialed, in a goroutine of its own, so that the client's other
// streams go on meanwhile (a replica that does not answer a dial holds up only the requests
// sent to it). The request's body is held for the upstream up to the stream's window until then.
func (r *Relay) open(c *peer, cid uint32, u *Upstream, h *Head) error {
	s := &stream{client: c, pool: u, cid: cid, upCredit: int64(r.cfg.StreamWindow), clientCredit: int64(r.cfg.StreamWindow)}
	fields := make([]hpack.HeaderField, 0, 4+len(h.Fields))
	fields = append(fields, hpack.HeaderField{Name: ":method", Value: h.Method}, hpack.HeaderField{Name: ":scheme", Value: h.Scheme},
		hpack.HeaderField{Name: ":authority", Value: h.Authority}, hpack.HeaderField{Name: ":path", Value: h.Path})
	fields = append(fields, h.Fields...)
	if h.EndStream {
		s.toUp.ended = true
	}
	u.mu.Lock()
	u.active++
	u.mu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		u.release()
		return errClosed
	}
	c.streams[cid] = s
	s.toClient.window = c.initWindow
	c.mu.Unlock()
	if p := u.ready(); p != nil {
		r.attach(s, p, fields, h.EndStream)
		return nil
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		p, err := u.get(c.ctx)
		if err != nil {
			c.mu.Lock()
			gone := s.cancelled || c.closed
			c.mu.Unlock()
			// Forgotten before the answer: the replica's count is right once the client knows.
			s.forget()
			if !gone {
				r.upstreamFailed(err)
				c.mu.Lock()
				delete(c.streams, cid)
				c.mu.Unlock()
				_ = c.answer(cid, r.cfg.BadGateway, !h.EndStream)
			}
			return
		}
		r.attach(s, p, fields, h.EndStream)
	}()
	return nil
}

// attach opens s's upstream stream on p with its head, then sends on what the client sent
// meanwhile. The stream becomes visible to the client's side (s.up) only once its head is
// queued, so that its data cannot go before it.
func (r *Relay) attach(s *stream, p *peer, fields []hpack.HeaderField, endStream bool) {
	c := s.client
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		s.failClient(http2.ErrCodeRefusedStream)
		return
	}
	// The id is taken and the head written under the writer's lock, so that ids go out in
	// order, as HTTP/2 requires.
	werr := p.w.frames(func(fr *http2.Framer) error {
		s.mu.Lock()
		s.uid = p.nextID
		s.toUp.window = p.initWindow
		s.mu.Unlock()
		p.nextID += 2
		p.streams[s.uid] = s
		return p.w.headers(fr, s.uid, fields, endStream, p.maxFrame)
	})
	c.mu.Lock()
	cancelled := s.cancelled
	if !cancelled {
		s.up = p
	}
	c.mu.Unlock()
	p.mu.Unlock()
	switch {
	case cancelled:
		p.resetStream(s.uid, http2.ErrCodeCancel)
		s.forget()
	case werr != nil && !errors.Is(werr, errClosed):
		s.failClient(http2.ErrCodeRefusedStream)
	default:
		p.pump(s)
	}
}

// upstreamFailed reports a replica that could not take a request (Config.OnUpstreamFailure).
func (r *Relay) upstreamFailed(err error) {
	if r.cfg.OnUpstreamFailure != nil {
		r.cfg.OnUpstreamFailure(err)
	}
}
