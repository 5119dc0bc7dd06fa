package tundev

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tendril-net/tendril/edge/accept"
)

// Handler serves one TCP connection from the device into Config.Forward, in its own goroutine:
// the kernel has completed the peer's handshake with this end (its table redirected the
// connection to the Stack's listener), dst is where the peer sent it. The Handler dials dst
// and relays, or, if that fails, closes c with a reset (Reset). ctx ends at StopForwarding,
// which closes c too and waits for every Handler to return.
type Handler func(ctx context.Context, c *net.TCPConn, dst netip.AddrPort)

// redirectAddr4 is put on the device when IPv4 connections are redirected and the device has
// no IPv4 address of its own: the kernel redirects to the receiving device's first address of
// the family, and drops the packet if there is none. It never appears on the wire (replies
// leave with the original destination as their source) and is link-local, so no route of the
// namespace leads to it.
var redirectAddr4 = netip.AddrFrom4([4]byte{169, 254, 0, 2})

// forwarder accepts the redirected connections of one family each (an accept.Server a listener)
// and runs the Handler.
type forwarder struct {
	handler  Handler
	prefixes []netip.Prefix
	cancel   context.CancelFunc
	lns      []net.Listener
	srvs     []*accept.Server // a listener's each
	ports    map[int]uint16   // listening port per family (unix.NFPROTO_IPV4, unix.NFPROTO_IPV6)
	wg       sync.WaitGroup

	accepted, outside atomic.Uint64
}

// startForwarder listens for the redirected connections of each family of prefixes, bound to
// the device, on a port the kernel picks.
func (s *Stack) startForwarder(h Handler) (*forwarder, error) {
	f := &forwarder{handler: h, prefixes: s.cfg.Forward, ports: make(map[int]uint16)}
	for _, fam := range []struct {
		nfproto int
		network string
		addr    string
		is4     bool
	}{{unix.NFPROTO_IPV4, "tcp4", "0.0.0.0:0", true}, {unix.NFPROTO_IPV6, "tcp6", "[::]:0", false}} {
		if !hasFamily(s.cfg.Forward, fam.is4) {
			continue
		}
		lc := net.ListenConfig{Control: s.bindToDevice}
		l, err := lc.Listen(context.Background(), fam.network, fam.addr)
		if err != nil {
			for _, l := range f.lns {
				l.Close()
			}
			return nil, fmt.Errorf("tundev: listen for forwarded connections: %w", err)
		}
		f.lns = append(f.lns, l)
		f.ports[fam.nfproto] = l.Addr().(*net.TCPAddr).AddrPort().Port()
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	for _, l := range f.lns {
		// No descriptor left, say: the Server pauses before the next try while the listen
		// backlog holds the connections. What it closes itself (at stop) it resets, as the real
		// destination's end would have been seen to break.
		srv := &accept.Server{Handle: f.serve, RetryAccept: true, Abort: func(c net.Conn) { Reset(c.(*net.TCPConn)) }}
		f.srvs = append(f.srvs, srv)
		f.wg.Go(func() { _ = srv.Serve(ctx, l) }) // with RetryAccept it ends only with ctx
	}
	return f, nil
}

func hasFamily(prefixes []netip.Prefix, is4 bool) bool {
	for _, p := range prefixes {
		if p.Addr().Is4() == is4 {
			return true
		}
	}
	return false
}

// serve runs the Handler for a redirected connection, and resets one that was not redirected (a
// peer dialled the listener's port itself): there is nothing to forward it to.
func (f *forwarder) serve(ctx context.Context, nc net.Conn, _ *accept.Conns) {
	c := nc.(*net.TCPConn)
	dst, err := originalDst(c)
	if err != nil || !inside(f.prefixes, dst.Addr()) {
		f.outside.Add(1)
		Reset(c)
		return
	}
	f.accepted.Add(1)
	f.handler(ctx, c, dst)
}

// active is the number of connections being served.
func (f *forwarder) active() int {
	n := 0
	for _, srv := range f.srvs {
		n += srv.Open()
	}
	return n
}

// stop closes the listeners, resets every forwarded connection, ends the Handlers' ctx and waits
// for them.
func (f *forwarder) stop() {
	f.cancel()
	f.wg.Wait()
}

// Reset closes c with a reset instead of an orderly close: the peer sees the connection
// refused or broken, as it would have seen the real destination's.
func Reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}

// originalDst is where a connection was going before the table redirected it (netfilter's
// SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST for IPv6: the same option number at SOL_IPV6).
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	is4 := c.LocalAddr().(*net.TCPAddr).IP.To4() != nil
	var dst netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		var sa [unix.SizeofSockaddrInet6]byte // sockaddr_in fits too
		level := unix.SOL_IPV6
		if is4 {
			level = unix.SOL_IP
		}
		size := uint32(len(sa))
		_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), unix.SO_ORIGINAL_DST,
			uintptr(unsafe.Pointer(&sa[0])), uintptr(unsafe.Pointer(&size)), 0)
		if e != 0 {
			serr = fmt.Errorf("getsockopt SO_ORIGINAL_DST: %w", syscall.Errno(e))
			return
		}
		// sockaddr_in: family, port (big-endian), 4 address bytes; sockaddr_in6: family, port,
		// flow info (4 bytes), 16 address bytes.
		port := binary.BigEndian.Uint16(sa[2:4])
		if is4 {
			dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(sa[4:8])), port)
		} else {
			dst = netip.AddrPortFrom(netip.AddrFrom16([16]byte(sa[8:24])), port)
		}
	})
	return dst, errors.Join(err, serr)
}
