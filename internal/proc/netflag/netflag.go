// Package netflag provides flag.Value types for comma-separated lists of IP addresses and
// prefixes, as tendril's binaries take them (--shoot-cidrs, --addresses). It parses; it does not
// check what the addresses are for.
package netflag

import (
	"fmt"
	"net/netip"
	"strings"
)

// Prefixes is a comma-separated list of CIDR prefixes.
type Prefixes []netip.Prefix

func (p *Prefixes) String() string { return join(*p) }

// Set replaces the list with the prefixes in v; empty elements are skipped.
func (p *Prefixes) Set(v string) error {
	var out []netip.Prefix
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return err
		}
		out = append(out, pfx)
	}
	*p = out
	return nil
}

// Addrs is a comma-separated list of IP addresses.
type Addrs []netip.Addr

func (a *Addrs) String() string { return join(*a) }

// Set replaces the list with the addresses in v; empty elements are skipped.
func (a *Addrs) Set(v string) error {
	var out []netip.Addr
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		addr, err := netip.ParseAddr(s)
		if err != nil {
			return err
		}
		out = append(out, addr)
	}
	*a = out
	return nil
}

func join[T fmt.Stringer](xs []T) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = x.String()
	}
	return strings.Join(s, ",")
}
