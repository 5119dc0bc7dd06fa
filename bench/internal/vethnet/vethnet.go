// Package vethnet holds what the benchmark modes that build a network of
// their own (tunnel, failover) share in laying it out: a run's namespaces
// and addresses named after its process ID, so that two runs on one machine
// do not collide and the namespaces a killed run left behind are recognised;
// the ip(8) commands that join two namespaces by a veth pair; and the
// deletion of the run's namespaces at its end.
//
// It runs ip through internal/host/netns and does not decide a topology:
// which namespaces there are, their addresses, routes and forwarding stay
// with each mode.
package vethnet

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"

	"github.com/tendril-net/tendril/internal/host/netns"
)

// Run is one run's share of the machine's namespaces and addresses.
type Run struct {
	// Prefix starts the name of every namespace of the mode's runs.
	Prefix string
	// PID is this process's ID, in every namespace's name.
	PID int
	// N, 1..250, is derived from PID: the third octet of the run's
	// addresses.
	N int
}

// Start checks that network namespaces can be made here, removes those of
// earlier runs whose process is gone (the names stale matches, its first
// submatch the PID), and returns this run's.
func Start(ctx context.Context, prefix string, stale *regexp.Regexp) (Run, error) {
	if err := netns.Check(); err != nil {
		return Run{}, err
	}
	netns.RemoveStale(ctx, stale)
	pid := os.Getpid()
	return Run{Prefix: prefix, PID: pid, N: pid%250 + 1}, nil
}

// NS is the name of the run's namespace called name.
func (r Run) NS(name string) string { return fmt.Sprintf("%s%d-%s", r.Prefix, r.PID, name) }

// ID is the PID in decimal, for the names of the run's veth devices (at
// most 15 bytes each).
func (r Run) ID() string { return strconv.Itoa(r.PID) }

// Addr is the run's address 10.b.N.d.
func (r Run) Addr(b, d byte) netip.Addr { return netip.AddrFrom4([4]byte{10, b, byte(r.N), d}) }

// Veth is the ip commands that join namespace a ("" for this process's) to
// the named namespace b by a veth pair made in a: its end devA in a with
// addrA, its end devB moved into b with addrB, both up.
func Veth(a, devA string, addrA netip.Prefix, b, devB string, addrB netip.Prefix) [][]string {
	return [][]string{
		in(a, "link", "add", devA, "type", "veth", "peer", "name", devB),
		in(a, "link", "set", devB, "netns", b),
		in(a, "addr", "add", addrA.String(), "dev", devA),
		in(a, "link", "set", devA, "up"),
		in(b, "addr", "add", addrB.String(), "dev", devB),
		in(b, "link", "set", devB, "up"),
	}
}

// in is the ip arguments args run in namespace ns ("" for this process's).
func in(ns string, args ...string) []string {
	if ns == "" {
		return args
	}
	return append([]string{"-n", ns}, args...)
}

// IP runs ip with each of steps in turn, up to the first that fails.
func IP(ctx context.Context, steps ...[]string) error {
	for _, st := range steps {
		if err := netns.IP(ctx, st...); err != nil {
			return err
		}
	}
	return nil
}

// Delete deletes those of the namespaces names that exist, and with them
// the veth ends inside them.
func Delete(ctx context.Context, names ...string) error {
	var errs []error
	for _, ns := range names {
		if _, err := os.Stat(filepath.Join("/run/netns", ns)); err == nil {
			errs = append(errs, netns.IP(ctx, "netns", "del", ns))
		}
	}
	return errors.Join(errs...)
}
