// Package tunnel is the "tunnel" mode of tendril-bench: the reversed VPN, the
// path by which the seed (kube-apiserver) reaches pods in a shoot that has no
// load balancer, measured side by side with the systems it replaces.
//
// Run builds a three-namespace network (see topology): the seed is this
// process's namespace, the shoot runs the agents, and the pod, a TCP server
// this process runs inside the pod namespace, is reachable from the seed
// only through a tunnel (plus a separate veth for the direct target). Each
// data path ("stack") is started in turn, measured and stopped:
//
//   - direct: the client dials the pod over its own veth (the physical limit);
//   - tendril: tendril-seed and tendril-ingress (the seed ingress, tunnel
//     listener), tendril-server on the seed, tendril-agent vpn in the shoot
//     dialing out through the ingress with the Reversed-VPN CONNECT;
//     measured through tendril-server's HTTP CONNECT front-end over mutual TLS
//     (tendril-connect) and its konnectivity gRPC front-end (tendril-grpc);
//   - openvpn: OpenVPN 2.6 in TCP mode as Gardener's vpn2 runs it, the
//     client dialing out through the same ingress (http-proxy with the
//     Reversed-VPN header); the client dials the pod through the seed's tun;
//   - konnectivity-grpc and konnectivity-connect: konnectivity's own
//     proxy-server (one per mode) and proxy-agent v0.36.0, built from the Go
//     module proxy into a cache; the agent dials the server directly.
//
// For each target it measures bulk throughput toward the pod and back (1 and
// 4 connections), dial latency and rate (a dial is a new connection through
// the path plus one round trip to the pod; 1 and 32 workers), and head-of-line
// blocking: one connection stalls (its reader never reads) while another
// transfers; the other's throughput is reported. Per stack it measures the
// tunnel's up time (agent process start → first successful dial through the
// tunnel) and the resident memory of both ends idle and at peak.
//
// It needs root (namespaces, veth, /dev/net/tun); peers that are not
// installed are skipped with the reason. Everything it starts or creates is
// gone when Run returns, also when ctx is cancelled (Ctrl-C): the report
// then holds what was measured so far, marked partial.
package tunnel

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// Target names, in report order.
const (
	TargetDirect         = "direct"
	TargetTLSRelay       = "tls-relay"
	TargetTendrilConnect = "tendril-connect"
	TargetTendrilGRPC    = "tendril-grpc"
	TargetTendrilRelay   = "tendril-relay"
	// TargetTendrilTUN and TargetTendrilTUNRelay are tendril-connect and tendril-relay with
	// both ends on TUN devices (--tun): the kernel's TCP/IP stack instead of gVisor's.
	TargetTendrilTUN      = "tendril-tun"
	TargetTendrilTUNRelay = "tendril-tun-relay"
	// TargetTendrilRelayConnect is HTTP CONNECT on tendril-egress-relay's Unix socket: each
	// CONNECT a stream of the relay's one connection to tendril-server.
	TargetTendrilRelayConnect = "tendril-relay-connect"
	TargetOpenVPN             = "openvpn"
	TargetKonnectivityGRPC    = "konnectivity-grpc"
	TargetKonnectivityConnect = "konnectivity-connect"
	TargetKonnectivityUDS     = "konnectivity-uds"
	// TargetKonnectivityConnectUDS is proxy-server --mode http-connect on a Unix socket.
	TargetKonnectivityConnectUDS = "konnectivity-connect-uds"
)

// Targets are all targets in report order.
var Targets = []string{TargetDirect, TargetTLSRelay, TargetTendrilConnect, TargetTendrilGRPC, TargetTendrilRelay,
	TargetTendrilRelayConnect, TargetTendrilTUN, TargetTendrilTUNRelay, TargetOpenVPN,
	TargetKonnectivityGRPC, TargetKonnectivityConnect, TargetKonnectivityUDS, TargetKonnectivityConnectUDS}

// Directions of a transfer.
const (
	ToShoot   = "to-shoot"   // seed → pod (kubectl cp into a pod, port-forward uploads, webhook requests)
	FromShoot = "from-shoot" // pod → seed (logs, exec output, port-forward downloads)
)

// Config configures Run. The zero value runs everything with the defaults
// given per field.
type Config struct {
	// Targets to measure; nil means all (Targets).
	Targets []string
	// Duration of each measurement window; 0 means 2 s.
	Duration time.Duration
	// Warmup before each window, not counted; 0 means 500 ms.
	Warmup time.Duration
	// Conns are the connection counts of the bulk test; nil means 1, 4.
	Conns []int
	// DialWorkers are the concurrency levels of the dial test; nil means
	// 1 (latency) and 32 (rate).
	DialWorkers []int
	// DialDuration is the window of each dial test; 0 means Duration. A lost SYN costs a dial
	// 1 s, so finding one in 10,000 needs windows of tens of seconds, where the bulk tests
	// need none.
	DialDuration time.Duration
	// DialsOnly skips the bulk and head-of-line tests.
	DialsOnly bool
	// Settle, if not 0, is how long after the last measurement of a stack its processes' RSS
	// is read once more (ProcMemory.AfterRSS): whether the memory of the load comes back. The
	// idle RSS is then read a second time too, Settle after the first (IdleSettledRSS).
	Settle time.Duration
	// Loads is how often each stack's load (every target's measurements) runs, with Settle
	// between them; 0 means 1. The report keeps the first load's figures; from the second on
	// only the RSS Settle after each (ProcMemory.AfterMoreRSS): whether memory grows with every
	// load or comes back to the same level.
	Loads int
	// Profiling serves the Go profiler on tendril-server's and tendril-egress-relay's metrics
	// address (--profiling), for looking into a run. Off by default, as in production: with the
	// profiler served the runtime samples allocations for the heap profile, ~1 MiB of
	// tendril-server's RSS after a load (internal/proc/probe.SampleHeap).
	Profiling bool
	// UpRuns is how often each stack's agent is started for the up-time
	// figure; 0 means 3.
	UpRuns int
	// Rounds is how often each measurement is repeated in a row; the report
	// shows the round with the median figure (and the errors of all). 0
	// means 1.
	Rounds int
	// BinDir holds the tendril binaries; "" means "bin".
	BinDir string
	// CacheDir receives the konnectivity build; "" means the user's cache
	// directory + "/tendril-bench".
	CacheDir string
	// NoBuild skips the konnectivity targets when they are not built yet,
	// instead of building them (a few minutes the first time).
	NoBuild bool
	// Konnectivity opens connections through a konnectivity ProxyService;
	// nil skips the gRPC targets (see KonnectivityDialer).
	Konnectivity KonnectivityDialer
	// Impairments, if set, put an impairment stage on the carrier link (seed ⇄ shoot) and
	// measure every tunnel target once per impairment, in this order (Grid is the issue's).
	Impairments []Impairment
	// Progress receives progress lines; nil means silent.
	Progress io.Writer
	// CommandLine is recorded in the report as is.
	CommandLine string
}

func (c *Config) setDefaults() {
	if c.Targets == nil {
		c.Targets = Targets
	}
	c.Duration = cmp.Or(c.Duration, 2*time.Second)
	c.Warmup = cmp.Or(c.Warmup, 500*time.Millisecond)
	if c.Conns == nil {
		c.Conns = []int{1, 4}
	}
	if c.DialWorkers == nil {
		c.DialWorkers = []int{1, 32}
	}
	c.DialDuration = cmp.Or(c.DialDuration, c.Duration)
	c.UpRuns = cmp.Or(c.UpRuns, 3)
	c.Loads = cmp.Or(c.Loads, 1)
	c.Rounds = cmp.Or(c.Rounds, 1)
	c.BinDir = cmp.Or(c.BinDir, "bin")
}

func (c *Config) validate() error {
	var errs harness.Checks
	check := errs.Check
	check(c.Duration > 0, "duration %v: want > 0", c.Duration)
	check(c.DialDuration > 0, "dial duration %v: want > 0", c.DialDuration)
	check(c.Settle >= 0 && c.Settle <= 10*time.Minute, "settle %v: want 0..10m", c.Settle)
	check(c.Loads >= 0 && c.Loads <= 10, "loads %d: want 0..10", c.Loads)
	check(c.Loads <= 1 || c.Settle > 0, "loads %d: needs a settle time", c.Loads)
	check(c.Warmup >= 0, "warm-up %v: want ≥ 0", c.Warmup)
	check(c.UpRuns >= 1 && c.UpRuns <= 100, "up runs %d: want 1..100", c.UpRuns)
	check(c.Rounds >= 1 && c.Rounds <= 20, "rounds %d: want 1..20", c.Rounds)
	check(len(c.Targets) > 0, "no targets")
	for i, t := range c.Targets {
		check(slices.Contains(Targets, t), "unknown target %q (want some of %v)", t, Targets)
		check(!slices.Contains(c.Targets[:i], t), "target %q twice", t)
	}
	for _, i := range c.Impairments {
		if err := i.validate(); err != nil {
			check(false, "%v", err)
		}
	}
	check(len(c.Conns) > 0, "no bulk connection counts")
	for _, n := range c.Conns {
		check(n >= 1 && n <= 256, "bulk connections %d: want 1..256", n)
	}
	check(len(c.DialWorkers) > 0, "no dial worker counts")
	for _, n := range c.DialWorkers {
		check(n >= 1 && n <= 1024, "dial workers %d: want 1..1024", n)
	}
	return errs.Err()
}

// Run runs the benchmark and returns its report. When ctx ends it stops
// early and returns the report of what was measured so far, marked
// partial, with ctx's error. Namespaces, processes and temporary files are
// gone when it returns.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("tunnel config: %w", err)
	}
	rep := &Report{Header: harness.StartHeader(cfg.CommandLine, settingsOf(cfg))}
	defer func() {
		rep.End()
		rep.evaluate()
	}()
	r := &runner{cfg: cfg, rep: rep}
	if err := netns.Check(); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "tendril-bench-tunnel-")
	if err != nil {
		return nil, fmt.Errorf("temporary directory: %w", err)
	}
	defer os.RemoveAll(tmp)
	r.tmp = tmp

	r.logf("network: seed, shoot and pod namespaces")
	var carrier *Impairment
	if len(cfg.Impairments) > 0 {
		carrier = &cfg.Impairments[0]
	}
	topo, err := newTopology(ctx, carrier)
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	defer func() {
		if err := topo.close(); err != nil {
			r.logf("network cleanup: %v", err)
		}
	}()
	r.topo = topo
	l, err := netns.Listen(topo.podNS, ":0")
	if err != nil {
		return nil, fmt.Errorf("pod: %w", err)
	}
	r.pod = newPod(l)
	defer r.pod.close()
	if r.pki, err = newPKI(tmp); err != nil {
		return nil, fmt.Errorf("certificates: %w", err)
	}
	defer r.stopAll()

	// The cipher's limit first, while nothing else runs.
	if lim, err := measureCryptoLimit(time.Second); err != nil {
		r.logf("crypto limit: %v", err)
	} else {
		rep.CryptoLimit = &lim
		r.logf("crypto limit: ChaCha20-Poly1305 seal+open of %d-byte packets %.0f MB/s on one core, %.0f MB/s for two",
			lim.PacketBytes, lim.OneCoreMBps, lim.MBps)
	}
	for _, st := range r.stacks() {
		if ctx.Err() != nil {
			break
		}
		r.runStack(ctx, st)
	}
	if ctx.Err() != nil {
		rep.Partial = true
		rep.Note = cmp.Or(rep.Note, "interrupted; only completed measurements are shown")
		return rep, ctx.Err()
	}
	return rep, nil
}

// runner is one Run's state.
type runner struct {
	cfg  Config
	rep  *Report
	tmp  string
	topo *topology
	pod  *pod
	pki  *pki
	// ingress is the seed ingress (tendril-seed + tendril-ingress), started
	// for the first stack that dials through it and stopped at the end.
	ingress *ingress
	// pathCPU is the CPU time the measured stack's own processes have used so far (its seed
	// and shoot side, and the ingress when it dials through it); nil for a stack without
	// processes (direct).
	pathCPU func() time.Duration
	// innerTCP and agentInnerTCP read the measured stack's inner TCP counters, seed and shoot
	// side; nil where it has none.
	innerTCP, agentInnerTCP func(ctx context.Context) (InnerTCP, bool, error)
}

func (r *runner) logf(format string, args ...any) {
	if r.cfg.Progress != nil {
		fmt.Fprintf(r.cfg.Progress, "tunnel: "+format+"\n", args...)
	}
}

func (r *runner) stopAll() {
	if r.ingress != nil {
		r.ingress.stop()
		r.ingress = nil
	}
}
