package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/tendril-net/tendril/bench/tunnel"
	"github.com/tendril-net/tendril/cmd/tendril-bench/konnectivity"
)

// tunnelCommand is the configuration of "tendril-bench tunnel".
type tunnelCommand struct {
	Config tunnel.Config
	output
}

func parseTunnel(args []string, stderr io.Writer) (*tunnelCommand, error) {
	c := &tunnelCommand{}
	fs := flag.NewFlagSet("tendril-bench tunnel", flag.ContinueOnError)
	fs.SetOutput(stderr)
	targets := stringList(tunnel.Targets)
	conns := intList{1, 4}
	workers := intList{1, 32}
	fs.Var(&targets, "targets", "comma-separated targets: "+fmt.Sprint(tunnel.Targets))
	fs.DurationVar(&c.Config.Duration, "duration", 2*time.Second, "duration of each measurement window")
	fs.DurationVar(&c.Config.Warmup, "warmup", 500*time.Millisecond, "warm-up before each measurement window")
	fs.Var(&conns, "conns", "comma-separated connection counts of the bulk test")
	fs.Var(&workers, "dial-workers", "comma-separated concurrency levels of the dial test")
	fs.DurationVar(&c.Config.DialDuration, "dial-duration", 0, "window of each dial test (default: --duration); ~40 s for 20,000 dials")
	fs.BoolVar(&c.Config.DialsOnly, "dials-only", false, "measure dials only: no bulk or head-of-line tests")
	fs.IntVar(&c.Config.Loads, "loads", 1, "run each stack's load this many times, --settle apart, and read the RSS after each (the figures are the first load's)")
	fs.DurationVar(&c.Config.Settle, "settle", 0, "read each stack's RSS again this long after its last measurement, and its idle RSS again this long after the first reading (e.g. 60s; 0: not measured)")
	fs.BoolVar(&c.Config.Profiling, "profiling", false, "serve the Go profiler on tendril-server's and tendril-egress-relay's metrics address (their heap sampling then costs memory)")
	fs.IntVar(&c.Config.UpRuns, "up-runs", 3, "agent starts per stack for the tunnel up time (median)")
	fs.IntVar(&c.Config.Rounds, "rounds", 1, "repeat each measurement this often in a row and report the median round (1..20)")
	fs.StringVar(&c.Config.BinDir, "bin-dir", binDir(), "directory with the tendril binaries (make build)")
	fs.StringVar(&c.Config.CacheDir, "cache-dir", "", "where konnectivity's proxy-server and proxy-agent are built once (default: the user cache directory/tendril-bench)")
	fs.BoolVar(&c.Config.NoBuild, "no-build", false, "skip konnectivity if it is not built yet instead of building it")
	impairments := fs.String("impair", "", `measure the tunnels with the carrier link (seed ⇄ shoot) impaired, once per cell: "grid" (0, 0.5, 2 % loss × 0, 50, 150 ms RTT) or RTT/LOSS% cells, e.g. "0/0,50ms/0.5,150ms/2" (half the RTT and the whole loss each way)`)
	c.addFlags(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return nil, err
	}
	if *impairments != "" {
		var err error
		if c.Config.Impairments, err = tunnel.ParseImpairments(*impairments); err != nil {
			return nil, fmt.Errorf("%w: --impair: %v", errUsage, err)
		}
	}
	if c.Config.Duration <= 0 || c.Config.Warmup < 0 || c.Config.UpRuns < 1 || c.Config.Rounds < 1 || c.Config.Rounds > 20 ||
		c.Config.DialDuration < 0 || c.Config.Settle < 0 {
		return nil, fmt.Errorf("%w: --duration must be > 0, --warmup ≥ 0, --up-runs ≥ 1, --rounds 1..20, --dial-duration and --settle ≥ 0", errUsage)
	}
	c.Config.Targets, c.Config.Conns, c.Config.DialWorkers = targets, conns, workers
	c.Config.Konnectivity = konnectivity.Dial
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also when it was
// interrupted (then marked partial).
func (c *tunnelCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := tunnel.Run(ctx, c.Config)
	return printReport(&c.output, stdout, rep, err)
}

func (c *tunnelCommand) setCommandLine(s string) { c.Config.CommandLine = s }
