// Package netns runs network namespaces for the benchmarks and for tests that cross one: it
// checks that they can be made, runs ip(8), removes the namespaces a killed run left behind,
// runs code or programs inside one, and cuts one off (a lost host). It does not decide a topology: its users (bench/tunnel,
// bench/failover, tunnel/wg's kernel-stack test) lay out their own.
package netns

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// IP runs ip with args.
func IP(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Check reports why network namespaces cannot be made here.
func Check() error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: creates network namespaces and veth pairs")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("ip (iproute2) not found: %w", err)
	}
	return nil
}

// RemoveStale deletes the namespaces of earlier runs whose process is gone: those whose name
// matches named, whose first submatch is the process ID that made them.
func RemoveStale(ctx context.Context, named *regexp.Regexp) {
	entries, _ := os.ReadDir("/run/netns")
	for _, e := range entries {
		m := named.FindStringSubmatch(e.Name())
		if len(m) < 2 {
			continue
		}
		pid, _ := strconv.Atoi(m[1])
		if pid == os.Getpid() || syscall.Kill(pid, 0) == nil {
			continue
		}
		_ = IP(ctx, "netns", "del", e.Name())
	}
}

// Exec is the command prefix that runs a program in namespace ns.
func Exec(ns string) []string { return []string{"ip", "netns", "exec", ns} }

// In runs f on an OS thread that has joined namespace ns: sockets f creates belong to ns for
// good, whichever thread later uses them. The thread returns to this process's namespace
// afterwards, or is discarded if it cannot.
func In(ns string, f func() error) error {
	target, err := os.Open(filepath.Join("/run/netns", ns))
	if err != nil {
		return fmt.Errorf("netns %s: %w", ns, err)
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Left locked (and so discarded when this goroutine ends) unless the thread is back in
		// the original namespace.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			errc <- fmt.Errorf("own netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", ns, err)
			return
		}
		ferr := f()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("setns back: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// Listen opens a TCP listener on addr in namespace ns.
func Listen(ns, addr string) (net.Listener, error) {
	var l net.Listener
	err := In(ns, func() (err error) {
		l, err = net.Listen("tcp", addr)
		return err
	})
	return l, err
}

// Cut makes network namespace ns drop every packet in, out of and through it, by an nftables
// table named table: a host that lost power or its network, where nothing is reset and nothing
// answers. Uncut removes the table again.
func Cut(ctx context.Context, ns, table string) error {
	return nft(ctx, ns, fmt.Sprintf("add table inet %[1]s; "+
		"add chain inet %[1]s lost_in { type filter hook input priority -500; policy drop; }; "+
		"add chain inet %[1]s lost_out { type filter hook output priority -500; policy drop; }; "+
		"add chain inet %[1]s lost_forward { type filter hook forward priority -500; policy drop; }", table))
}

// Uncut lets ns's packets through again.
func Uncut(ctx context.Context, ns, table string) error {
	return nft(ctx, ns, "delete table inet "+table)
}

func nft(ctx context.Context, ns, ruleset string) error {
	args := append(Exec(ns), "nft", ruleset)
	if out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("nft in %s: %w: %s", ns, err, bytes.TrimSpace(out))
	}
	return nil
}
