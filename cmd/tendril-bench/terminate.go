package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/tendril-net/tendril/bench/terminate"
)

// terminateCommand is the configuration of "tendril-bench terminate".
type terminateCommand struct {
	Config   terminate.Config
	JSONFile string
}

func parseTerminate(args []string, stderr io.Writer) (*terminateCommand, error) {
	c := &terminateCommand{}
	fs := flag.NewFlagSet("tendril-bench terminate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	clients := intList{1, 16, 128}
	fs.Var(&clients, "clients", "comma-separated client counts, one HTTP/2 connection each")
	fs.DurationVar(&c.Config.Duration, "duration", 5*time.Second, "measuring time per peer and client count")
	fs.IntVar(&c.Config.IdleConns, "idle-conns", 1000, "idle HTTP/2 client connections of the memory figure")
	fs.IntVar(&c.Config.Shoots, "shoots", 100, "opted-in shoots of the memory-per-shoot figure")
	fs.DurationVar(&c.Config.Settle, "settle", terminate.DefaultSettle, "how long the process after its load, and the idle connections, are left alone before the settled memory readings")
	fs.StringVar(&c.Config.BinDir, "bin-dir", binDir(), "directory with tendril-seed and tendril-ingress")
	fs.StringVar(&c.JSONFile, "json-file", "", "also write the report as JSON to `file`")
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	if c.Config.Duration <= 0 || c.Config.IdleConns < 1 || c.Config.Shoots < 2 || len(clients) == 0 || c.Config.Settle <= 2*time.Second {
		return nil, fmt.Errorf("%w: --duration > 0, --idle-conns ≥ 1, --shoots ≥ 2, --clients not empty, --settle > 2s", errUsage)
	}
	c.Config.Clients = clients
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also the part measured before an error.
func (c *terminateCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := terminate.Run(ctx, c.Config)
	if rep != nil {
		if werr := rep.Write(stdout, c.JSONFile); werr != nil && err == nil {
			err = werr
		}
	}
	return err
}

func (c *terminateCommand) setCommandLine(string) {}
