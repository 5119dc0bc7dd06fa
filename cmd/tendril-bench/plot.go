package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/tendril-net/tendril/bench/plot"
	"github.com/tendril-net/tendril/bench/tunnel"
	"github.com/tendril-net/tendril/bench/xdsbench"
)

// runPlot is "tendril-bench plot": PNG plots from the JSON reports that
// "xds" and "tunnel" write with --json-file.
func runPlot(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("tendril-bench plot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var xdsIn, xdsOut, tunnelIn, tunnelOut string
	fs.StringVar(&xdsIn, "xds", "", "JSON report of tendril-bench xds (--json-file) to plot")
	fs.StringVar(&xdsOut, "xds-out", "docs/bench/xds.png", "PNG of the xDS ACK latency p50/p99 versus the number of shoots")
	fs.StringVar(&tunnelIn, "tunnel", "", "JSON report of tendril-bench tunnel (--json-file) to plot")
	fs.StringVar(&tunnelOut, "tunnel-out", "docs/bench/tunnel.png", "PNG of the tunnel throughput per target")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 || xdsIn == "" && tunnelIn == "" {
		return fmt.Errorf("%w: give --xds and/or --tunnel reports, and no arguments", errUsage)
	}
	if xdsIn != "" {
		var rep xdsbench.Report
		if err := plot.ReadJSON(xdsIn, &rep); err != nil {
			return err
		}
		p, err := plot.XDSLatency(&rep)
		if err == nil {
			err = plot.Save(p, xdsOut)
		}
		if err != nil {
			return fmt.Errorf("plot %s: %w", xdsIn, err)
		}
		fmt.Fprintln(stdout, "wrote", xdsOut)
	}
	if tunnelIn != "" {
		var rep tunnel.Report
		if err := plot.ReadJSON(tunnelIn, &rep); err != nil {
			return err
		}
		p, err := plot.TunnelThroughput(&rep)
		if err == nil {
			err = plot.Save(p, tunnelOut)
		}
		if err != nil {
			return fmt.Errorf("plot %s: %w", tunnelIn, err)
		}
		fmt.Fprintln(stdout, "wrote", tunnelOut)
	}
	return nil
}
