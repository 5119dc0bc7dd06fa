package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	gplot "gonum.org/v1/plot"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/plot"
	"github.com/tendril-net/tendril/bench/tunnel"
	"github.com/tendril-net/tendril/bench/xdsbench"
)

// runPlot is "tendril-bench plot": PNG plots from the JSON reports that
// "sni", "proxy", "connect", "xds" and "tunnel" write with --json-file.
func runPlot(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("tendril-bench plot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var xdsIn, xdsOut, tunnelIn, tunnelOut, rateIn, rateDir string
	fs.StringVar(&rateIn, "rate", "", "comma-separated JSON reports of tendril-bench sni, proxy or connect (--json-file) to plot the time to first byte versus concurrency of")
	fs.StringVar(&rateDir, "rate-dir", "docs/bench", "directory for the rate plots, each named <mode>-ttfb.png")
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
	if fs.NArg() > 0 || xdsIn == "" && tunnelIn == "" && rateIn == "" {
		return fmt.Errorf("%w: give --rate, --xds and/or --tunnel reports, and no arguments", errUsage)
	}
	// save writes the plot drawn from in to out.
	save := func(in, out string, p *gplot.Plot, err error) error {
		if err == nil {
			err = plot.Save(p, out)
		}
		if err != nil {
			return fmt.Errorf("plot %s: %w", in, err)
		}
		fmt.Fprintln(stdout, "wrote", out)
		return nil
	}
	for in := range strings.SplitSeq(rateIn, ",") {
		if in == "" {
			continue
		}
		var rep harness.Report
		if err := plot.ReadJSON(in, &rep); err != nil {
			return err
		}
		p, err := plot.RateLatency(&rep)
		if err := save(in, filepath.Join(rateDir, rep.Mode+"-ttfb.png"), p, err); err != nil {
			return err
		}
	}
	if xdsIn != "" {
		var rep xdsbench.Report
		if err := plot.ReadJSON(xdsIn, &rep); err != nil {
			return err
		}
		p, err := plot.XDSLatency(&rep)
		if err := save(xdsIn, xdsOut, p, err); err != nil {
			return err
		}
	}
	if tunnelIn != "" {
		var rep tunnel.Report
		if err := plot.ReadJSON(tunnelIn, &rep); err != nil {
			return err
		}
		p, err := plot.TunnelThroughput(&rep)
		if err := save(tunnelIn, tunnelOut, p, err); err != nil {
			return err
		}
	}
	return nil
}
