// Package xdsbench is "tendril-bench xds": the xDS control plane at scale. For
// each number of shoots it loads that many shoots into a real
// xds/server.Server serving delta ADS on loopback, connects real
// tendril-ingress replicas (each with its own node id), and then makes a
// stream of single-shoot changes: an endpoint change of one shoot, a shoot
// added, a shoot removed. It reports the time from Apply to the ACK of every
// replica (p50/p99, from the server's own acknowledgement tracking), the
// bytes the server sends per change and replica (counted on its connections),
// the full-snapshot build time (Apply of the full set from empty), the time
// and bytes of the replicas' initial load, and the resident memory of the
// control plane and of the ingress.
//
// The control plane runs in a process of its own (this executable started
// again, see ChildEnv), so its RSS is the server's alone: neither the
// benchmark's bookkeeping nor the replicas' memory is in it. It generates the
// shoot set itself, as the real control plane holds its routing model. The
// ingress replicas are the tendril-ingress binary when one is given, else
// the same ingress package in this executable.
package xdsbench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
)

// The kinds of single-shoot change, made in this order, round after round.
const (
	KindEndpoint = "endpoint" // one shoot's kube-apiserver endpoint moves (EDS only)
	KindAdd      = "add"      // a new shoot appears (its clusters and assignment)
	KindRemove   = "remove"   // the shoot added last goes away
)

// Kinds are the change kinds in the order they are made.
var Kinds = []string{KindEndpoint, KindAdd, KindRemove}

// addedBase numbers the shoots that add changes create, apart from the
// loaded ones.
const addedBase = 1 << 20

// Config configures Run.
type Config struct {
	// Shoots are the set sizes to measure, each in a fresh control plane.
	Shoots []int
	// Replicas is the number of ingress replicas connected.
	Replicas int
	// Changes is the number of measured changes per set size (rounded up to
	// a multiple of len(Kinds)); Warmup changes before them are not measured.
	Changes, Warmup int
	// IngressBinary is the tendril-ingress executable; empty runs the ingress
	// package in this executable instead.
	IngressBinary string
	// Exe is this executable, started again for the control plane (and the
	// ingress without IngressBinary); empty means os.Executable(). Its main
	// must call ChildMain when IsChild.
	Exe string
	// Timeout bounds every wait for acknowledgements; zero means 2 minutes.
	Timeout time.Duration
	// Progress receives a line per step; nil discards them.
	Progress    io.Writer
	CommandLine string
	// CPUProfile, if set, receives a CPU profile of the control plane
	// process at each set size: the file name with ".<shoots>" appended.
	CPUProfile string
}

// Shoot is the i-th shoot of a generated set (modeltest.Shoot).
func Shoot(i int) model.Shoot { return modeltest.Shoot(i) }

// Run measures every set size of cfg in turn. On an error or cancellation
// it returns what it measured so far, marked partial, with the error.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if cfg.Replicas < 1 || len(cfg.Shoots) == 0 || cfg.Changes < 1 {
		return nil, errors.New("xds: need at least one set size, one replica and one change")
	}
	for _, n := range cfg.Shoots {
		if n < 1 || n >= addedBase {
			return nil, fmt.Errorf("xds: %d shoots: want 1 to %d", n, addedBase-1)
		}
	}
	if cfg.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("xds: %w", err)
		}
		cfg.Exe = exe
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Minute
	}
	cfg.Changes = (cfg.Changes + len(Kinds) - 1) / len(Kinds) * len(Kinds)
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	rep := &Report{Header: harness.StartHeader(cfg.CommandLine, Settings{Shoots: cfg.Shoots, Replicas: cfg.Replicas,
		Changes: cfg.Changes, Warmup: cfg.Warmup, TimeoutSeconds: cfg.Timeout.Seconds()})}
	rep.Settings.Ingress = "ingress package in " + cfg.Exe
	if cfg.IngressBinary != "" {
		rep.Settings.Ingress = cfg.IngressBinary
	}
	var err error
	for _, n := range cfg.Shoots {
		res := &SizeResult{Shoots: n}
		rep.Sizes = append(rep.Sizes, res)
		if err = runSize(ctx, cfg, res); err != nil {
			err = fmt.Errorf("xds: %d shoots: %w", n, err)
			break
		}
	}
	rep.finish(err != nil || ctx.Err() != nil)
	return rep, err
}

// proc is a started child process with the tail of its stderr.
type proc struct {
	cmd    *exec.Cmd
	stderr *tailBuffer
	done   chan error
}

func start(cmd *exec.Cmd) (*proc, error) {
	p := &proc{cmd: cmd, stderr: &tailBuffer{max: 4096}, done: make(chan error, 1)}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() { p.done <- cmd.Wait() }()
	return p, nil
}

// stop ends p (SIGINT, then SIGKILL after 5 s) and waits for it.
func (p *proc) stop() {
	p.stopAfter(0)
}

// stopAfter gives p grace to exit by itself before stop.
func (p *proc) stopAfter(grace time.Duration) {
	select {
	case err := <-p.done:
		p.done <- err
		return
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// exited reports p's exit with its stderr, if it has exited.
func (p *proc) exited() error {
	select {
	case err := <-p.done:
		p.done <- err
		return fmt.Errorf("%s exited (%v): %s", p.cmd.Path, err, strings.TrimSpace(p.stderr.String()))
	default:
		return nil
	}
}

// controlPlaneClient talks to the control plane child.
type controlPlaneClient struct {
	p   *proc
	in  io.WriteCloser
	out *bufio.Scanner
}

func (c *controlPlaneClient) call(req request) (reply, error) {
	b, _ := json.Marshal(req)
	if _, err := c.in.Write(append(b, '\n')); err != nil {
		return reply{}, errors.Join(fmt.Errorf("control plane: %w", err), c.p.exited())
	}
	return c.read()
}

func (c *controlPlaneClient) read() (reply, error) {
	if !c.out.Scan() {
		time.Sleep(100 * time.Millisecond) // let it exit, to report its stderr
		return reply{}, errors.Join(errors.New("control plane: no answer"), c.out.Err(), c.p.exited())
	}
	var r reply
	if err := json.Unmarshal(c.out.Bytes(), &r); err != nil {
		return reply{}, fmt.Errorf("control plane: %w", err)
	}
	if r.Error != "" {
		return r, errors.New(r.Error)
	}
	return r, nil
}

// runSize measures one set size, filling res as it goes.
func runSize(ctx context.Context, cfg Config, res *SizeResult) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	logf := func(format string, a ...any) {
		fmt.Fprintf(cfg.Progress, "xds: %d shoots: "+format+"\n", append([]any{res.Shoots}, a...)...)
	}

	cmd := exec.Command(cfg.Exe)
	cmd.Env = append(os.Environ(), ChildEnv+"="+roleControlPlane)
	if cfg.CPUProfile != "" {
		cmd.Env = append(cmd.Env, ProfileEnv+"="+cfg.CPUProfile+"."+strconv.Itoa(res.Shoots))
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	outPipe, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	p, err := start(cmd)
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	out := bufio.NewScanner(outPipe)
	out.Buffer(make([]byte, 64<<10), 1<<20)
	cp := &controlPlaneClient{p: p, in: in, out: out}
	// Closing stdin ends the control plane, which then writes its profile.
	defer p.stopAfter(5 * time.Second)
	defer in.Close()
	// Cancellation (Ctrl-C) ends the children, which ends any wait.
	go func() {
		<-ctx.Done()
		in.Close()
	}()
	hello, err := cp.read()
	if err != nil {
		return err
	}

	r, err := cp.call(request{Op: "load", Shoots: res.Shoots})
	if err != nil {
		return err
	}
	res.BuildMS, res.Resources = r.ApplyMS, r.Resources
	logf("full snapshot built in %.0f ms (%d resources)", r.ApplyMS, r.Resources)

	var ingresses []*proc
	defer func() {
		for _, ip := range ingresses {
			ip.stop()
		}
	}()
	for i := range cfg.Replicas {
		node := "tendril-bench-ingress-" + strconv.Itoa(i)
		var c *exec.Cmd
		if cfg.IngressBinary != "" {
			c = exec.Command(cfg.IngressBinary, "--xds", hello.Addr, "--xds-insecure", "--node-id", node,
				"--sni-address", "127.0.0.1:0", "--metrics-address", "")
		} else {
			c = exec.Command(cfg.Exe, hello.Addr, node)
			c.Env = append(os.Environ(), ChildEnv+"="+roleIngress)
		}
		ip, err := start(c)
		if err != nil {
			return fmt.Errorf("ingress: %w", err)
		}
		ingresses = append(ingresses, ip)
	}
	timeoutMS := cfg.Timeout.Milliseconds()
	if r, err = cp.call(request{Op: "sync", Replicas: cfg.Replicas, TimeoutMS: timeoutMS}); err != nil {
		for _, ip := range ingresses {
			err = errors.Join(err, ip.exited())
		}
		return err
	}
	res.SyncMS, res.SyncBytesPerReplica = r.AckMS, r.Bytes/int64(cfg.Replicas)
	logf("%d replicas loaded every shoot in %.0f ms (%s each)", cfg.Replicas, r.AckMS, FormatBytes(res.SyncBytesPerReplica))
	if err := readMemories(cp, ingresses, &res.ControlPlane.Loaded, &res.Ingress.Loaded); err != nil {
		return err
	}

	samples := map[string][]sample{}
	last := time.Now()
	total := cfg.Warmup + cfg.Changes
	// Warm-up rounds are whole rounds of Kinds too, so the measured ones
	// start with an endpoint change.
	warm := (cfg.Warmup + len(Kinds) - 1) / len(Kinds) * len(Kinds)
	total = warm + cfg.Changes
	for seq := range total {
		kind := Kinds[seq%len(Kinds)]
		r, err := cp.call(request{Op: "change", Kind: kind, Seq: seq, Replicas: cfg.Replicas, TimeoutMS: timeoutMS})
		if err != nil {
			res.summarise(samples, cfg.Replicas)
			return fmt.Errorf("%s change %d: %w", kind, seq, err)
		}
		if seq >= warm {
			samples[kind] = append(samples[kind], sample{ack: r.AckMS, apply: r.ApplyMS, bytes: r.Bytes})
		}
		if time.Since(last) > 3*time.Second {
			logf("%d of %d changes", seq+1, total)
			last = time.Now()
		}
	}
	res.summarise(samples, cfg.Replicas)
	if err := readMemories(cp, ingresses, &res.ControlPlane.After, &res.Ingress.After); err != nil {
		return err
	}
	all := res.Changes[len(res.Changes)-1]
	logf("change → ACK p50 %.1f ms, p99 %.1f ms; %s per change and replica", all.P50MS, all.P99MS, FormatBytes(int64(all.BytesPerReplica)))
	return nil
}

// readMemories reads the control plane's memory and the largest of the
// ingress replicas'.
func readMemories(cp *controlPlaneClient, ingresses []*proc, cpm, inm *memory) error {
	r, err := cp.call(request{Op: "mem"})
	if err != nil {
		return err
	}
	*cpm = r.Memory
	for _, ip := range ingresses {
		m, ok := readMemory(ip.cmd.Process.Pid)
		if !ok {
			return errors.Join(errors.New("ingress memory unreadable"), ip.exited())
		}
		inm.RSS, inm.Peak = max(inm.RSS, m.RSS), max(inm.Peak, m.Peak)
	}
	return nil
}

type sample struct {
	ack, apply float64
	bytes      int64
}

// summarise fills res.Changes from the samples: one row per kind and one
// for all of them.
func (res *SizeResult) summarise(samples map[string][]sample, replicas int) {
	res.Changes = nil
	var all []sample
	for _, k := range Kinds {
		if len(samples[k]) > 0 {
			res.Changes = append(res.Changes, changeResult(k, samples[k], replicas))
			all = append(all, samples[k]...)
		}
	}
	if len(all) > 0 {
		res.Changes = append(res.Changes, changeResult("all", all, replicas))
	}
}

func changeResult(kind string, ss []sample, replicas int) ChangeResult {
	acks := make([]float64, len(ss))
	applies := make([]float64, len(ss))
	var bytes, maxBytes int64
	for i, s := range ss {
		acks[i], applies[i] = s.ack, s.apply
		bytes += s.bytes
		maxBytes = max(maxBytes, s.bytes)
	}
	return ChangeResult{
		Kind: kind, Count: len(ss),
		P50MS: Percentile(acks, 50), P99MS: Percentile(acks, 99), MaxMS: slices.Max(acks),
		ApplyP50MS: Percentile(applies, 50), ApplyP99MS: Percentile(applies, 99),
		BytesPerReplica:    float64(bytes) / float64(len(ss)) / float64(replicas),
		MaxBytesPerReplica: float64(maxBytes) / float64(replicas),
	}
}

// Percentile is the nearest-rank p-th percentile of xs (0 for none).
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	rank := int(p/100*float64(len(s))+0.999999) - 1
	return s[min(max(rank, 0), len(s)-1)]
}

// memory is a process's resident set now and at its peak (VmHWM), and for
// the control plane the Go heap in use.
type memory struct {
	RSS       int64 `json:"rss_bytes"`
	Peak      int64 `json:"peak_rss_bytes"`
	HeapInuse int64 `json:"heap_inuse_bytes,omitempty"`
}

// readMemory reads the resident set of pid (peers.ReadMemory).
func readMemory(pid int) (memory, bool) {
	m, ok := peers.ReadMemory(pid)
	return memory{RSS: m.RSS, Peak: m.Peak}, ok
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   bytes.Buffer
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b.Write(p)
	if over := t.b.Len() - t.max; over > 0 {
		t.b.Next(over)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.b.String()
}
