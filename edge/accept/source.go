package accept

import (
	"net"
	"net/netip"
	"sync"
)

// SourceKey is the address a per-source bound counts: the IPv4 address, or the /64 of an IPv6 one
// (a single host is commonly given a whole /64, so counting its addresses one by one would bound
// nothing).
func SourceKey(a netip.Addr) netip.Addr {
	a = a.Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.Addr()
	}
	return a
}

// remoteKey is c's per-source key, or false for a peer without an IP address (a Unix socket's):
// it is not counted.
func remoteKey(c net.Conn) (netip.Addr, bool) {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return SourceKey(a.AddrPort().Addr()), true
	}
	return netip.Addr{}, false
}

// sources counts the connections open per source key. It holds an entry only while its source
// has a connection open, so its size is bounded by the connections open (about 64 bytes an
// entry: a 24-byte netip.Addr key, an int and the map's share).
type sources struct {
	mu sync.Mutex
	n  map[netip.Addr]int
}

// take counts one more connection of key and reports true, or false if key has max open.
func (s *sources) take(key netip.Addr, max int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n[key] >= max {
		return false
	}
	if s.n == nil {
		s.n = make(map[netip.Addr]int)
	}
	s.n[key]++
	return true
}

// release gives back one of key's connections.
func (s *sources) release(key netip.Addr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n[key] <= 1 {
		delete(s.n, key)
		return
	}
	s.n[key]--
}

// len is the number of sources with a connection open.
func (s *sources) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.n)
}
