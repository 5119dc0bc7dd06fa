package accept

import (
	"net"
	"sync"
	"sync/atomic"
)

// Limit is Server.Max for an accept loop that is not a Server's (gRPC's, which serves a listener
// itself): its Listener refuses a connection beyond Max open at once, passing it to Refused and
// closing it at once, so that the client's dial fails fast and it retries rather than waiting in
// the backlog. An accepted connection counts until it is closed. Max must be positive.
type Limit struct {
	Max int
	// Refused, if set, is told of a refused connection (before it is closed): count and log it.
	Refused func(c net.Conn)

	open atomic.Int64
}

// Listener is l with the limit.
func (m *Limit) Listener(l net.Listener) net.Listener { return &limitListener{Listener: l, m: m} }

// Open is the number of connections accepted and not yet closed.
func (m *Limit) Open() int { return int(m.open.Load()) }

type limitListener struct {
	net.Listener
	m *Limit
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.m.open.Add(1) > int64(l.m.Max) {
			l.m.open.Add(-1)
			if l.m.Refused != nil {
				l.m.Refused(c)
			}
			c.Close()
			continue
		}
		return &countedConn{Conn: c, m: l.m}, nil
	}
}

// countedConn gives its place back at its first Close.
type countedConn struct {
	net.Conn
	m    *Limit
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.m.open.Add(-1) })
	return c.Conn.Close()
}
