package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/idle"
)

// idleCommand is the configuration of "tendril-bench idle".
type idleCommand struct {
	Config idle.Config
	output
}

func parseIdle(args []string, stderr io.Writer) (*idleCommand, error) {
	c := &idleCommand{}
	fs := flag.NewFlagSet("tendril-bench idle", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listeners := stringList(idle.Listeners)
	targets := stringList(idle.Targets)
	fs.IntVar(&c.Config.Conns, "conns", 0, "idle connections per target (default: the most the descriptor limit fits, (hard RLIMIT_NOFILE − 400) / 2)")
	fs.Var(&listeners, "listeners", "comma-separated listeners: "+strings.Join(idle.Listeners, ", "))
	fs.Var(&targets, "targets", "comma-separated targets: "+strings.Join(idle.Targets, ", "))
	fs.DurationVar(&c.Config.Hold, "hold", 10*time.Second, "how long the connections stay idle before every one is pinged")
	fs.DurationVar(&c.Config.Release, "release", 30*time.Second, "how long memory and descriptors are sampled after the connections close")
	fs.DurationVar(&c.Config.OpenTimeout, "open-timeout", 10*time.Second, "bound of opening one connection and of one ping")
	fs.IntVar(&c.Config.MaxFailures, "max-failures", 64, "stop opening connections to a target after this many failed")
	fs.IntVar(&c.Config.Parallel, "parallel", 32, "connections opened (and pinged) at once")
	fs.IntVar(&c.Config.Shoots, "shoots", 4, "number of shoots: routes and upstream TLS servers")
	fs.StringVar(&c.Config.BinDir, "bin-dir", binDir(), "directory with tendril-seed and tendril-ingress")
	c.addFlags(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return nil, err
	}
	if c.Config.Conns < 0 || c.Config.Hold <= 0 || c.Config.Release <= 0 || c.Config.OpenTimeout <= 0 ||
		c.Config.MaxFailures < 1 || c.Config.Parallel < 1 || c.Config.Shoots < 1 {
		return nil, fmt.Errorf("%w: --conns must be ≥ 0, --hold, --release, --open-timeout > 0, --max-failures, --parallel, --shoots ≥ 1", errUsage)
	}
	c.Config.Listeners, c.Config.Targets = listeners, targets
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also when it was
// interrupted (then marked partial).
func (c *idleCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := idle.Run(ctx, c.Config)
	return printReport(&c.output, stdout, rep, err)
}

func (c *idleCommand) setCommandLine(s string) { c.Config.CommandLine = s }
