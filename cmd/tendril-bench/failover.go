package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"

	"github.com/tendril-net/tendril/bench/failover"
)

// failoverCommand is the configuration of "tendril-bench failover".
type failoverCommand struct {
	Config failover.Config
	output
}

// The defaults keep "tendril-bench failover" at about five minutes (312 s on 2026-12-04): ten
// kills or cuts of each kind, each a second or two plus the wait until the part is back, and for
// the kinds that hold connections a 1 s settle per cut (konnectivity builds once, a few minutes,
// on a machine that has never built it).
func parseFailover(args []string, stderr io.Writer) (*failoverCommand, error) {
	c := &failoverCommand{}
	fs := flag.NewFlagSet("tendril-bench failover", flag.ContinueOnError)
	fs.SetOutput(stderr)
	kinds := stringList(failover.Kinds)
	fs.Var(&kinds, "kinds", "comma-separated kinds of failure: "+fmt.Sprint(failover.Kinds))
	fs.IntVar(&c.Config.Repetitions, "repetitions", 10, "kills per kind (1..100)")
	fs.StringVar(&c.Config.BinDir, "bin-dir", binDir(), "directory with the tendril binaries (make build)")
	fs.DurationVar(&c.Config.CutEvery, "cut-every", 0, "with the kinds that hold connections, the time from one cut to the next (0: once the last settled, about 1 s; soak with 10 repetitions and 50s: a 10-minute run)")
	c.addFlags(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return nil, err
	}
	if c.Config.Repetitions < 1 || c.Config.Repetitions > 100 {
		return nil, fmt.Errorf("%w: --repetitions must be 1..100", errUsage)
	}
	for _, k := range kinds {
		if !slices.Contains(failover.Kinds, k) {
			return nil, fmt.Errorf("%w: --kinds: unknown kind %q (known: %v)", errUsage, k, failover.Kinds)
		}
	}
	c.Config.Kinds = kinds
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also when it was interrupted (then marked
// partial).
func (c *failoverCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := failover.Run(ctx, c.Config)
	return printReport(&c.output, stdout, rep, err)
}

func (c *failoverCommand) setCommandLine(s string) { c.Config.CommandLine = s }
