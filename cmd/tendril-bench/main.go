// Command tendril-bench is tendril's load generator. It measures a data path
// of tendril side by side with peer implementations in the same run and
// reports the ratios.
//
//	tendril-bench sni [flags]       SNI passthrough: new TLS connections/s, TTFB, bulk MB/s
//	tendril-bench proxy [flags]     PROXY v2 header routed by destination, then TLS: the same figures
//	tendril-bench connect [flags]   CONNECT with X-Gardener-Destination, then TLS: the same figures
//	tendril-bench idle [flags]      N idle connections: RSS, fds, goroutines per connection, survivors, release
//	tendril-bench tunnel [flags]    reversed VPN: throughput, dials, head-of-line, up time, memory
//	tendril-bench failover [flags]  HA: agent, server, xDS server and OpenVPN server kill → recovery
//	tendril-bench xds [flags]       xDS at scale: change → ACK latency, bytes per change, build time, memory
//	tendril-bench plot [flags]      PNG plots from the JSON reports of sni, proxy, connect, xds and tunnel
//
// This file only turns flags into a configuration and prints results; the
// benchmarks live in package bench/….
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/incluster"
	"github.com/tendril-net/tendril/bench/sni"
	"github.com/tendril-net/tendril/bench/xdsbench"
	"github.com/tendril-net/tendril/internal/proc/buildinfo"
)

const usage = `usage: tendril-bench <mode> [flags]

modes:
  sni      SNI passthrough: direct vs HAProxy vs nginx vs tendril-ingress
  proxy    PROXY v2 header with the shoot's advertised address, then TLS:
           direct vs HAProxy (accept-proxy, use_backend by dst) vs nginx
           (proxy_protocol, map on the header's destination) vs tendril-ingress
  connect  CONNECT with X-Gardener-Destination, then TLS through the tunnel:
           direct vs squid (cache_peer per shoot) vs tendril-ingress; HAProxy
           is tried and cannot do it (it forwards the CONNECT instead)
  idle     N idle TLS connections through the sni and proxy listeners of
           tendril-ingress, HAProxy and nginx: RSS, fds and goroutines per
           connection, survivors after a hold, release after close
  tunnel   reversed VPN, seed to a pod in the shoot: direct vs tendril
           (HTTP CONNECT and konnectivity gRPC front-ends) vs OpenVPN 2.6 TCP
           vs konnectivity v0.36 (gRPC and HTTP CONNECT); needs root
  failover kill the active tendril-agent of two, tendril-server, the tendril-seed
           whose xDS the ingress uses, and the OpenVPN server of two a client with
           two remotes is on; kill → next successful dial (or new route) p50 and
           worst over --repetitions; needs root
  xds      N shoots in the xDS server with tendril-ingress replicas connected,
           then single-shoot changes: Apply → ACK of every replica p50/p99,
           bytes per change, full build time, control plane and ingress RSS
  terminate  the SNI listener's terminating mode vs HAProxy in HTTP mode doing the
           same (TLS with the shoot's certificate, client certificates, X-Remote-*,
           HTTP/2 to three replicas with the front-proxy certificate): requests/s
           and CPU per request at --clients, memory per idle HTTP/2 connection and
           per opted-in shoot
  plot     PNG plots from --json-file reports: TTFB vs concurrency (--rate), xDS ACK latency vs shoots
           (--xds), tunnel throughput per target (--tunnel)
  --version  print the version and exit

sni, proxy and connect measure new TLS connections per second with time to
first byte, and bulk throughput, and take the same flags. tunnel measures
bulk throughput both ways, dial latency and rate, head-of-line blocking,
tunnel up time and memory, with flags of its own. Run "tendril-bench <mode>
-h" for the flags of a mode. --markdown-append adds a mode's section to an
existing report, so that several runs make one document:

  tendril-bench sni --markdown docs/bench/all.md
  tendril-bench proxy --markdown-append docs/bench/all.md
  tendril-bench connect --markdown-append docs/bench/all.md
`

// runner is a mode's parsed command line, ready to run; its report records the command line.
type runner interface {
	Run(ctx context.Context, stdout io.Writer) error
	setCommandLine(string)
}

// parsers parse the command lines of the modes that run, by command name (plot and help do
// not: they measure nothing).
var parsers = map[string]func(args []string, stderr io.Writer) (runner, error){
	"tunnel":    parser(parseTunnel),
	"failover":  parser(parseFailover),
	"idle":      parser(parseIdle),
	"xds":       parser(parseXDS),
	"terminate": parser(parseTerminate),
	// sni, proxy and connect share the harness and its flags.
	sni.Mode.Name:          harnessParser(sni.Mode),
	incluster.Proxy.Name:   harnessParser(incluster.Proxy),
	incluster.Connect.Name: harnessParser(incluster.Connect),
}

func harnessParser(mode harness.Mode) func([]string, io.Writer) (runner, error) {
	return func(args []string, stderr io.Writer) (runner, error) { return parseCommand(mode, args, stderr) }
}

// parser turns a mode's own parse function into a parsers entry.
func parser[C runner](parse func([]string, io.Writer) (C, error)) func([]string, io.Writer) (runner, error) {
	return func(args []string, stderr io.Writer) (runner, error) { return parse(args, stderr) }
}

// errUsage marks an error in the command line (exit status 2).
var errUsage = errors.New("usage")

func main() {
	// The xds mode starts this executable again for its control plane (and
	// ingress replicas without bin/tendril-ingress).
	if xdsbench.IsChild() {
		os.Exit(xdsbench.ChildMain())
	}
	// Ctrl-C or SIGTERM cancels the run; the benchmark stops its peers and
	// prints what it measured so far.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args, os.Stdout, os.Stderr)
	interrupted := ctx.Err() != nil
	stop()
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		fmt.Fprintln(os.Stderr, "tendril-bench:", err)
		os.Exit(2)
	case interrupted:
		fmt.Fprintln(os.Stderr, "tendril-bench: interrupted; results above are partial")
		os.Exit(130)
	default:
		fmt.Fprintln(os.Stderr, "tendril-bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) < 2 {
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("%w: no mode given", errUsage)
	}
	if parse, ok := parsers[args[1]]; ok {
		c, err := parse(args[2:], stderr)
		if err != nil {
			return err
		}
		c.setCommandLine(commandLine(args))
		return c.Run(ctx, stdout)
	}
	switch args[1] {
	case "plot":
		return runPlot(args[2:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	case "--version", "-version":
		fmt.Fprintln(stdout, buildinfo.String("tendril-bench"))
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("%w: unknown mode %q", errUsage, args[1])
}

// output is where a mode's report goes, the same for every mode.
type output struct {
	JSON     bool   // print the report as JSON instead of tables
	Markdown string // also write a Markdown report to this file
	// MarkdownAppend, if set, receives the Markdown report at its end
	// (the file is created if missing).
	MarkdownAppend string
	// JSONFile, if set, also receives the report as JSON (what "plot" reads).
	JSONFile string
}

// addFlags defines the output flags in fs.
func (o *output) addFlags(fs *flag.FlagSet) {
	fs.BoolVar(&o.JSON, "json", false, "print machine-readable JSON instead of tables")
	fs.StringVar(&o.Markdown, "markdown", "", "also write a Markdown report to `file`, replacing it")
	fs.StringVar(&o.MarkdownAppend, "markdown-append", "", "also append the Markdown report as a section to `file` (created if missing)")
	fs.StringVar(&o.JSONFile, "json-file", "", "also write the report as JSON to `file`, replacing it (for tendril-bench plot)")
}

// parseFlags parses a mode's args with fs, which has the output flags
// (addFlags): a bad flag, an argument or the same file for --markdown and
// --markdown-append is a usage error; -h returns flag.ErrHelp.
func (o *output) parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	if o.Markdown != "" && o.Markdown == o.MarkdownAppend {
		return fmt.Errorf("%w: --markdown and --markdown-append name the same file", errUsage)
	}
	return nil
}

// report is a mode's result in its three formats.
type report interface {
	WriteJSON(io.Writer) error
	WriteTable(io.Writer) error
	WriteMarkdown(io.Writer) error
}

// write prints rep to stdout, as JSON or tables, and writes the Markdown
// files asked for.
func (o *output) write(stdout io.Writer, rep report) error {
	var err error
	if o.JSON {
		err = rep.WriteJSON(stdout)
	} else {
		fmt.Fprintln(stdout)
		err = rep.WriteTable(stdout)
	}
	if o.Markdown != "" {
		err = errors.Join(err, writeFile(o.Markdown, false, rep.WriteMarkdown))
	}
	if o.MarkdownAppend != "" {
		err = errors.Join(err, writeFile(o.MarkdownAppend, true, rep.WriteMarkdown))
	}
	if o.JSONFile != "" {
		err = errors.Join(err, writeFile(o.JSONFile, false, rep.WriteJSON))
	}
	return err
}

// printReport prints the report of a mode's run as o asks, also when the run
// was interrupted or failed (the report is then marked partial), and returns
// err with what went wrong in printing; a run without a report returns err.
func printReport[R interface {
	comparable
	report
}](o *output, stdout io.Writer, rep R, err error) error {
	var none R
	if rep == none {
		return err
	}
	return errors.Join(err, o.write(stdout, rep))
}

// command is the configuration of "tendril-bench <mode>".
type command struct {
	Mode   harness.Mode
	Config harness.Config
	output
	// CPUProfile, if set, receives a CPU profile of the whole run (client
	// and upstreams; the peers are other processes).
	CPUProfile string
}

func parseCommand(mode harness.Mode, args []string, stderr io.Writer) (*command, error) {
	c := &command{Mode: mode}
	fs := flag.NewFlagSet("tendril-bench "+mode.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	targets := stringList(mode.Targets)
	modes := stringList{harness.ModeRate, harness.ModeBulk}
	conc := intList{1, 16, 128}
	bulkBytes := byteSize(64 << 20)
	fs.IntVar(&c.Config.Shoots, "shoots", 4, "number of shoots: routes and upstream TLS servers (api.s<i>.bench.tendril.local)")
	fs.Var(&targets, "targets", "comma-separated targets: "+strings.Join(mode.Targets, ", "))
	fs.Var(&modes, "modes", "comma-separated measurements: rate (connections/s and TTFB), bulk (MB/s)")
	fs.Var(&conc, "concurrency", "comma-separated client concurrency levels of the connection-rate test")
	fs.DurationVar(&c.Config.Duration, "duration", 5*time.Second, "duration of each measurement")
	fs.DurationVar(&c.Config.Warmup, "warmup", 0, "warm-up before each measurement (default duration/5, at most 1s)")
	fs.IntVar(&c.Config.Payload, "payload", 64, "bytes of the upstream's answer in the connection-rate test")
	fs.Var(&bulkBytes, "bytes", "bytes per bulk answer (suffixes KiB, MiB, GiB, kB, MB, GB)")
	fs.IntVar(&c.Config.BulkConns, "bulk-conns", 4, "concurrent connections in the bulk test")
	fs.IntVar(&c.Config.Rounds, "rounds", 1, "repeat all measurements this often and report medians")
	fs.StringVar(&c.Config.BinDir, "bin-dir", binDir(), "directory with tendril-seed and tendril-ingress")
	c.addFlags(fs)
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the benchmark process (client and upstreams) to `file`")
	if err := c.parseFlags(fs, args); err != nil {
		return nil, err
	}
	c.Config.Targets, c.Config.Modes, c.Config.Concurrency = targets, modes, conc
	c.Config.BulkBytes = int64(bulkBytes)
	c.Config.Progress = stderr
	return c, nil
}

// Run runs the benchmark and prints its report to stdout, also when it was
// interrupted (then marked partial).
func (c *command) Run(ctx context.Context, stdout io.Writer) error {
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	rep, err := harness.Run(ctx, c.Mode, c.Config)
	return printReport(&c.output, stdout, rep, err)
}

// writeFile writes a report to path: replacing it, or at its end, after an
// empty line and a rule when the file already has content.
func writeFile(path string, appending bool, write func(io.Writer) error) error {
	flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if appending {
		flags = os.O_WRONLY | os.O_CREATE | os.O_APPEND
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if err != nil {
		return fmt.Errorf("report: %w", err)
	}
	if appending {
		if st, err := f.Stat(); err == nil && st.Size() > 0 {
			if _, err := io.WriteString(f, "\n---\n\n"); err != nil {
				f.Close()
				return fmt.Errorf("report %s: %w", path, err)
			}
		}
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("report %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("report %s: %w", path, err)
	}
	return nil
}

// commandLine quotes args for a POSIX shell, for the report.
func commandLine(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,:/+@") == "" {
			q[i] = a
		} else {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}

// stringList is a comma-separated flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }
func (l *stringList) Set(s string) error {
	*l = nil
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// intList is a comma-separated flag of integers.
type intList []int

func (l *intList) String() string {
	var s []string
	for _, n := range *l {
		s = append(s, strconv.Itoa(n))
	}
	return strings.Join(s, ",")
}

func (l *intList) Set(s string) error {
	*l = nil
	for _, p := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			return fmt.Errorf("not an integer: %q", p)
		}
		*l = append(*l, n)
	}
	return nil
}

// byteSize is a size flag with an optional binary (KiB) or decimal (kB) unit.
type byteSize int64

func (b *byteSize) String() string { return strconv.FormatInt(int64(*b), 10) }

func (b *byteSize) Set(s string) error {
	units := []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"kB", 1e3}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1}}
	num, mult := strings.TrimSpace(s), int64(1)
	for _, u := range units {
		if v, ok := strings.CutSuffix(num, u.suffix); ok {
			num, mult = strings.TrimSpace(v), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 || n > (1<<62)/mult {
		return fmt.Errorf("not a positive size: %q", s)
	}
	*b = byteSize(n * mult)
	return nil
}

// binDir is the default of every --bin-dir: the directory tendril-bench is in, where make build
// puts the other binaries too, so that it runs the same from any working directory ("bin" when
// the executable's path cannot be had).
func binDir() string {
	exe, err := os.Executable()
	if err != nil {
		return "bin"
	}
	return filepath.Dir(exe)
}

func (c *command) setCommandLine(s string) { c.Config.CommandLine = s }
