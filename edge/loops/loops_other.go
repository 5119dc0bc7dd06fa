//go:build !linux

package loops

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/tendril-net/tendril/edge/pipe"
)

// Loops joins connection pairs. Without epoll (not Linux) each pair runs Pipe on a goroutine of
// its own; the API is the Linux one, so callers need no build tags.
type Loops struct {
	mu     sync.Mutex
	pairs  map[*Group]map[[2]net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// NewLoops returns Loops.
func NewLoops(LoopsConfig) (*Loops, error) {
	return &Loops{pairs: map[*Group]map[[2]net.Conn]struct{}{}}, nil
}

// Join runs Pipe(a, b) after writing first to b; see the Linux documentation.
func (ls *Loops) Join(g *Group, a, b net.Conn, first []byte, idle time.Duration, done func(aToB, bToA int64)) error {
	k := [2]net.Conn{a, b}
	ls.mu.Lock()
	if ls.closed || g.closed.Load() {
		ls.mu.Unlock()
		a.Close()
		b.Close()
		return ErrClosed
	}
	if ls.pairs[g] == nil {
		ls.pairs[g] = map[[2]net.Conn]struct{}{}
	}
	ls.pairs[g][k] = struct{}{}
	g.open.Add(1)
	ls.wg.Add(1)
	ls.mu.Unlock()
	go func() {
		defer ls.wg.Done()
		var aToB, bToA int64
		if _, err := b.Write(first); err == nil {
			aToB, bToA = pipe.Pipe(a, b, idle)
		}
		a.Close()
		b.Close()
		ls.mu.Lock()
		delete(ls.pairs[g], k)
		ls.mu.Unlock()
		g.open.Add(-1)
		if done != nil {
			done(aToB+int64(len(first)), bToA)
		}
	}()
	return nil
}

// CloseGroup closes every pair of g and refuses new ones for it; it returns how many it closed.
func (ls *Loops) CloseGroup(g *Group) int {
	g.closed.Store(true)
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for k := range ls.pairs[g] {
		k[0].Close()
		k[1].Close()
	}
	return len(ls.pairs[g])
}

// Close closes every pair and returns once their goroutines have ended.
func (ls *Loops) Close() {
	ls.mu.Lock()
	ls.closed = true
	for _, m := range ls.pairs {
		for k := range m {
			k[0].Close()
			k[1].Close()
		}
	}
	ls.mu.Unlock()
	ls.wg.Wait()
}

// Socket is a dialed TCP connection not yet joined.
type Socket struct{ c net.Conn }

// Close closes a socket that was not joined.
func (d *Socket) Close() { d.c.Close() }

// Dial connects to addr.
func (ls *Loops) Dial(ctx context.Context, addr netip.AddrPort) (*Socket, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr.String())
	if err != nil {
		return nil, err
	}
	return &Socket{c}, nil
}

// JoinDialed is Join for a dialed upstream.
func (ls *Loops) JoinDialed(g *Group, a net.Conn, b *Socket, first []byte, idle time.Duration, done func(aToB, bToA int64)) error {
	return ls.Join(g, a, b.c, first, idle, done)
}

// Handshake is an accepted connection in its handshake; see the Linux documentation.
type Handshake struct{ Peer, Local netip.AddrPort }

// RemoteAddr is the client's address.
func (hs *Handshake) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(hs.Peer) }

// Close does nothing: without epoll no handshake runs on the loops.
func (hs *Handshake) Close() error { return nil }

// Listener is a TCP listener for Serve.
type Listener struct{ net.Listener }

// Listen takes ln over.
func Listen(ln net.Listener, _ time.Duration) (*Listener, error) { return &Listener{ln}, nil }

// Addr is the listener's address.
func (ln *Listener) Addr() netip.AddrPort {
	ap, _ := netip.ParseAddrPort(ln.Listener.Addr().String())
	return ap
}

// Serve needs epoll: handshakes on the loops are Linux only.
func (ls *Loops) Serve(*Group, *Listener, Accept) error {
	return errors.New("relay: handshakes on the loops need epoll (Linux)")
}
