package peers

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Squid runs the distribution's squid as the CONNECT endpoint of JobConnect:
// an ACL on X-Gardener-Destination admits a CONNECT and selects the shoot's
// upstream, a cache_peer marked originserver; squid connects to it, answers
// 200 and tunnels. It is a forward proxy doing the job as a seed would need
// it, with one difference the benchmark has to bridge: squid tunnels to such
// a peer only on the port the CONNECT names, so the client names the
// upstream's port rather than 443 (in a seed both are 443).
//
// Squid is single-threaded; its SMP mode runs one worker process per CPU
// (plus a coordinator) when its IPC directory exists (squidIPCDir, made by
// the Debian package), and a single worker otherwise. The zero value uses
// "squid" from PATH, DefaultTimeouts and one worker per CPU.
type Squid struct {
	Bin      string   // path or name in PATH; "" means "squid"
	Timeouts Timeouts // zero means DefaultTimeouts
	Workers  int      // 0 means one per CPU, if squidIPCDir exists
}

// squidIPCDir is where squid's SMP processes meet (Debian's build:
// --runstatedir=/run); it must exist and belong to squid's user.
const squidIPCDir = "/run/squid"

// workers returns the worker count to run and, if it is fewer than asked,
// why.
func (s Squid) workers() (int, string) {
	n := s.Workers
	if n <= 0 {
		n = cores()
	}
	if n > 1 {
		if st, err := os.Stat(squidIPCDir); err != nil || !st.IsDir() {
			return 1, "one worker: no " + squidIPCDir + " for SMP"
		}
	}
	return n, ""
}

var _ Peer = Squid{}

// SquidConfig is the data for squid.conf.tmpl.
type SquidConfig struct {
	Listen   string // ip:port of http_port
	Workers  int
	Dir      string // pid file and cache log live here
	MaxConn  int
	Timeouts Timeouts
	Routes   []Route
}

// RenderSquid renders the squid configuration for c.
func RenderSquid(c SquidConfig) (string, error) {
	if err := validateRoutes(c.Routes); err != nil {
		return "", err
	}
	if !filepath.IsAbs(c.Dir) {
		return "", fmt.Errorf("squid dir %q is not absolute", c.Dir)
	}
	return render(squidTmpl, c)
}

// Name implements Peer.
func (Squid) Name() string { return "squid" }

func (s Squid) bin() (string, error) { return lookBin(s.Bin, "squid", "squid") }

// Check implements Peer.
func (s Squid) Check(context.Context) error {
	_, err := s.bin()
	return err
}

// Config returns the configuration Start would write for routes on listen,
// with its files in dir.
func (s Squid) Config(dir, listen string, routes []Route) (string, error) {
	workers, _ := s.workers()
	return RenderSquid(SquidConfig{Listen: listen, Workers: workers, Dir: dir, MaxConn: maxConn, Timeouts: s.Timeouts.orDefault(), Routes: routes})
}

// CheckConfig runs "squid -k parse -f path".
func (s Squid) CheckConfig(ctx context.Context, path string) error {
	bin, err := s.bin()
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, bin, "-k", "parse", "-f", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("squid -k parse -f %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	// squid -k parse exits 0 on some errors; its output says so.
	for l := range strings.Lines(string(out)) {
		if strings.Contains(l, "ERROR") || strings.Contains(l, "FATAL") || strings.Contains(l, "unrecognized") {
			return fmt.Errorf("squid -k parse -f %s: %s", path, strings.TrimSpace(l))
		}
	}
	return nil
}

// Version returns the first line of "squid -v".
func (s Squid) Version(ctx context.Context) string {
	return versionOf(ctx, s.bin, "-v")
}

// Start implements Peer: "squid --foreground -n NAME -f dir/squid.conf",
// master, coordinator and workers in the foreground, or "squid -N" for one
// worker. NAME, unique per port, keeps the IPC sockets of two instances
// apart. Squid started by root runs as its own user (proxy on Debian), which
// must be able to write its cache log in dir: dir is made writable for it,
// and its parent must let it pass.
func (s Squid) Start(ctx context.Context, dir string, routes []Route) (*Instance, error) {
	bin, err := s.bin()
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		return nil, fmt.Errorf("squid: %w", err)
	}
	version := s.Version(ctx)
	workers, why := s.workers()
	if why != "" {
		version += " (" + why + ")"
	} else {
		version += fmt.Sprintf(" (%d workers)", workers)
	}
	return fileStart{name: "squid", bin: bin, version: version, dir: dir, file: "squid.conf", ready: 20 * time.Second,
		config: func(addr string) (string, error) { return s.Config(dir, addr, routes) },
		args: func(addr, path string) []string {
			// A pid file left by an attempt that failed would stop the next.
			_ = os.Remove(filepath.Join(dir, "squid.pid"))
			if workers > 1 {
				return []string{"--foreground", "-n", "tendrilbench" + addr[strings.LastIndex(addr, ":")+1:], "-f", path}
			}
			return []string{"-N", "-f", path}
		},
	}.start(ctx)
}
