package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/tendril-net/tendril/bench/xdsbench"
)

// xdsCommand is the configuration of "tendril-bench xds".
type xdsCommand struct {
	Config xdsbench.Config
	output
}

// The defaults keep "tendril-bench xds" under about three minutes on 2 cores:
// at 10,000 shoots the 300 changes (~0.4 s each there, with three replicas
// sharing the cores) take most of it; 100 per kind make the p99 the second
// largest of each kind (see docs/performance.md).
func parseXDS(args []string, stderr io.Writer) (*xdsCommand, error) {
	c := &xdsCommand{}
	fs := flag.NewFlagSet("tendril-bench xds", flag.ContinueOnError)
	fs.SetOutput(stderr)
	shoots := intList{100, 1000, 10000}
	dir := binDir()
	fs.Var(&shoots, "shoots", "comma-separated numbers of shoots; each is loaded into a fresh control plane")
	fs.IntVar(&c.Config.Replicas, "replicas", 3, "tendril-ingress replicas connected (node ids differ)")
	fs.IntVar(&c.Config.Changes, "changes", 300, "measured single-shoot changes per number of shoots (endpoint, add, remove in turn)")
	fs.IntVar(&c.Config.Warmup, "warmup", 6, "unmeasured changes before them")
	fs.DurationVar(&c.Config.Timeout, "timeout", 2*time.Minute, "longest wait for the replicas' acknowledgement of a change or of the initial load")
	fs.StringVar(&dir, "bin-dir", dir, "directory with tendril-ingress (make build); without it the replicas run the ingress package in tendril-bench")
	fs.StringVar(&c.Config.CPUProfile, "cpuprofile", "", "write a CPU profile of the control plane process to `file`.<shoots> per number of shoots")
	c.addFlags(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return nil, err
	}
	if c.Config.Replicas < 1 || c.Config.Changes < 1 || c.Config.Warmup < 0 || len(shoots) == 0 {
		return nil, fmt.Errorf("%w: --replicas and --changes must be ≥ 1, --warmup ≥ 0, --shoots not empty", errUsage)
	}
	for _, n := range shoots {
		if n < 1 {
			return nil, fmt.Errorf("%w: --shoots: %d", errUsage, n)
		}
	}
	c.Config.Shoots = shoots
	if bin := filepath.Join(dir, "tendril-ingress"); dir != "" {
		if st, err := os.Stat(bin); err == nil && !st.IsDir() {
			c.Config.IngressBinary = bin
		} else {
			fmt.Fprintf(stderr, "tendril-bench xds: %s not found; the replicas run the ingress package in tendril-bench\n", bin)
		}
	}
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report, also when it was
// interrupted (then marked partial).
func (c *xdsCommand) Run(ctx context.Context, stdout io.Writer) error {
	rep, err := xdsbench.Run(ctx, c.Config)
	return printReport(&c.output, stdout, rep, err)
}

func (c *xdsCommand) setCommandLine(s string) { c.Config.CommandLine = s }
