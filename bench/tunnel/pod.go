package tunnel

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"

	"github.com/tendril-net/tendril/bench/internal/inflight"
)

// Pod commands: the client sends one byte first (konnectivity-client drops
// data that arrives before it has registered a connection, so the pod never
// speaks first).
const (
	cmdPing   = 'P' // the pod answers pingReply and closes: a dial's round trip
	cmdSink   = 'U' // the pod reads and discards until EOF, counting into sunk
	cmdSource = 'D' // the pod writes until the connection breaks, counting into sourced
	cmdStall  = 'S' // the pod never reads: the connection's receive side stalls
)

var pingReply = []byte("ok\n")

// podBuf is the pod's read and write size: small enough that a stalled
// connection's last write is seen to block early.
const podBuf = 32 << 10

// pod is the shoot's "pod": a TCP server in the pod namespace, run by this
// process (its listening socket was made inside the namespace), so that the
// benchmark reads the bytes it received straight from its counters. It
// listens on all the pod's addresses: the shoot address for the tunnels, the
// direct link's for direct.
type pod struct {
	l       net.Listener
	sunk    atomic.Int64 // bytes read by cmdSink connections
	sourced atomic.Int64 // bytes written by cmdSource connections
	pings   atomic.Int64

	conns inflight.Set
	wg    sync.WaitGroup
	out   []byte
}

func newPod(l net.Listener) *pod {
	p := &pod{l: l, out: make([]byte, podBuf)}
	for i := range p.out {
		p.out[i] = byte(i)
	}
	p.wg.Add(1)
	go p.serve()
	return p
}

func (p *pod) port() int { return p.l.Addr().(*net.TCPAddr).Port }

func (p *pod) serve() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.conns.Add(c) // never refused: reset, not Close, ends the connections
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			if p.handle(c) {
				p.conns.Done(c)
			}
		}()
	}
}

// handle serves one connection and reports whether it is done with it (a
// stalled one stays open until reset).
func (p *pod) handle(c net.Conn) bool {
	var cmd [1]byte
	if _, err := io.ReadFull(c, cmd[:]); err != nil {
		return true
	}
	switch cmd[0] {
	case cmdPing:
		p.pings.Add(1)
		_, _ = c.Write(pingReply)
	case cmdSink:
		buf := make([]byte, podBuf)
		for {
			n, err := c.Read(buf)
			p.sunk.Add(int64(n))
			if err != nil {
				break
			}
		}
	case cmdSource:
		for {
			n, err := c.Write(p.out)
			p.sourced.Add(int64(n))
			if err != nil {
				break
			}
		}
	case cmdStall:
		return false
	}
	return true
}

// reset closes every open connection: a measurement leaves nothing behind
// for the next (a stalled connection, a transfer a tunnel did not end).
func (p *pod) reset() { p.conns.Reset() }

func (p *pod) close() error {
	err := p.l.Close()
	p.reset()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
