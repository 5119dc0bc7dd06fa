package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/tendril-net/tendril/bench/tunnel"
)

// tunnelCommand is the configuration of "tendril-bench tunnel".
type tunnelCommand struct {
	Config         tunnel.Config
	JSON           bool
	Markdown       string
	MarkdownAppend string
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
	fs.IntVar(&c.Config.UpRuns, "up-runs", 3, "agent starts per stack for the tunnel up time (median)")
	fs.StringVar(&c.Config.BinDir, "bin-dir", "bin", "directory with the tendril binaries (make build)")
	fs.StringVar(&c.Config.CacheDir, "cache-dir", "", "where konnectivity's proxy-server and proxy-agent are built once (default: the user cache directory/tendril-bench)")
	fs.BoolVar(&c.Config.NoBuild, "no-build", false, "skip konnectivity if it is not built yet instead of building it")
	fs.BoolVar(&c.JSON, "json", false, "print machine-readable JSON instead of tables")
	fs.StringVar(&c.Markdown, "markdown", "", "also write a Markdown report to `file`, replacing it")
	fs.StringVar(&c.MarkdownAppend, "markdown-append", "", "also append the Markdown report as a section to `file` (created if missing)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	if c.Markdown != "" && c.Markdown == c.MarkdownAppend {
		return nil, fmt.Errorf("%w: --markdown and --markdown-append name the same file", errUsage)
	}
	if c.Config.Duration <= 0 || c.Config.Warmup < 0 || c.Config.UpRuns < 1 {
		return nil, fmt.Errorf("%w: --duration must be > 0, --warmup ≥ 0, --up-runs ≥ 1", errUsage)
	}
	c.Config.Targets, c.Config.Conns, c.Config.DialWorkers = targets, conns, workers
	c.Config.Konnectivity = konnectivityDial
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also when it was
// interrupted (then marked partial).
func (c *tunnelCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := tunnel.Run(ctx, c.Config)
	if rep == nil {
		return err
	}
	var werr error
	if c.JSON {
		werr = rep.WriteJSON(stdout)
	} else {
		fmt.Fprintln(stdout)
		werr = rep.WriteTable(stdout)
	}
	if c.Markdown != "" {
		werr = errors.Join(werr, writeFile(c.Markdown, false, rep.WriteMarkdown))
	}
	if c.MarkdownAppend != "" {
		werr = errors.Join(werr, writeFile(c.MarkdownAppend, true, rep.WriteMarkdown))
	}
	return errors.Join(err, werr)
}
