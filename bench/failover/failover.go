// Package failover is tendril-bench's failover mode: how long kube-apiserver's egress into a
// shoot fails when a part of the reversed VPN dies (and how long the ingress goes without a new
// route when the control plane's xDS server dies), repeated and reported as p50 and worst
// case per kind of failure, with OpenVPN (two servers, a client with two remotes: the shape of
// Gardener's HA VPN) as the peer. An HA shoot's two tendril-server replicas are measured with
// kube-apiserver's egress through tendril-egress-relay, which races them: a replica killed, and
// a replica's node lost (its namespace drops every packet, so that nothing is reset or closed).
//
// Every kind is measured the same way: a dial loop starts a dial to the shoot's "pod" every
// 20 ms (each with its own deadline, so a hanging dial hides no later success); the process is
// SIGKILLed; the time is from the kill to the end of the first dial started after it that got
// the pod's answer. The processes are the real binaries (make build) in network namespaces, as
// in the tunnel mode and e2e.TestHAFailoverTimes.
package failover

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// Kinds of failure, in report order.
const (
	KindAgent  = "agent"  // the active tendril-agent of two
	KindServer = "server" // tendril-server, restarted at once
	// KindCarrier: the agents' streams to the ingress cut (reset by a proxy between them) while
	// connections through the tunnel are held; measured is the longest stall of a held
	// connection, and how many broke.
	KindCarrier = "carrier"
	// KindCarrierServer: the carrier cut between the ingress and tendril-server instead.
	KindCarrierServer = "carrier-server"
	// KindStandby: the standby tendril-agent of two killed while connections are held through
	// the active one; measured as the carrier kind.
	KindStandby = "standby-agent"
	// KindRollout: the ingress rolled (a new replica, the old one drained) while connections are
	// held; measured as the carrier kind.
	KindRollout = "ingress-rollout"
	// KindSoak: one set of held connections through Repetitions carrier cuts with a rollout of
	// both ingress replicas (two steps) in the middle, spaced by Config.CutEvery (a 10-minute
	// run: --cut-every 50s with 10 repetitions).
	KindSoak = "soak"
	// KindControlPlane: the tendril-seed whose xDS the ingress is connected to, of two.
	KindControlPlane = "control-plane"
	KindOpenVPN      = "openvpn" // the OpenVPN server the client is on, of two
	// KindReplica: one tendril-server replica of an HA shoot's two, kube-apiserver's egress
	// through tendril-egress-relay.
	KindReplica = "server-replica"
	// KindNode: the node of one tendril-server replica of two stops answering.
	KindNode = "server-node"
)

// Kinds are all kinds, in report order.
var Kinds = []string{KindAgent, KindServer, KindCarrier, KindCarrierServer, KindStandby, KindRollout, KindSoak, KindReplica, KindNode, KindControlPlane, KindOpenVPN}

// Config configures a run. The zero value runs every kind 10 times with the binaries in bin/.
type Config struct {
	// Kinds to measure; empty for all.
	Kinds []string
	// Repetitions of each kind; if zero, 10.
	Repetitions int
	// BinDir holds tendril-seed, tendril-ingress, tendril-server and tendril-agent; if empty,
	// "bin".
	BinDir string
	// Progress receives a line per step; nil discards them.
	Progress io.Writer
	// CutEvery is, for the kinds that hold connections, the time from one cut to the next (at
	// least the settle after a cut, 1 s); zero: the next once the last settled.
	CutEvery time.Duration
	// CommandLine is recorded in the report.
	CommandLine string
}

// Run measures every kind asked for and returns the report, also when a kind failed or ctx
// ended (then marked partial, with what was measured).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.Repetitions = cmp.Or(cfg.Repetitions, 10)
	cfg.BinDir = cmp.Or(cfg.BinDir, "bin")
	if len(cfg.Kinds) == 0 {
		cfg.Kinds = Kinds
	}
	for _, k := range cfg.Kinds {
		if !slices.Contains(Kinds, k) {
			return nil, fmt.Errorf("failover: unknown kind %q (known: %v)", k, Kinds)
		}
	}
	rep := &Report{Machine: machine.Describe(), Started: time.Now(), LoadBefore: machine.LoadAverage(),
		CommandLine: cfg.CommandLine, Repetitions: cfg.Repetitions}
	defer func() {
		rep.ElapsedSeconds = time.Since(rep.Started).Seconds()
		rep.LoadAfter = machine.LoadAverage()
	}()
	tmp, err := os.MkdirTemp("", "tendril-bench-failover-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	topo, err := newTopology(ctx)
	if err != nil {
		return nil, fmt.Errorf("failover: %w", err)
	}
	defer topo.close()
	r := &runner{cfg: cfg, topo: topo, tmp: tmp}
	pod, err := r.startPod()
	if err != nil {
		return nil, err
	}
	defer pod.Close()

	// Each part measures the kinds it names that were asked for; a part that failed leaves the
	// next to run unless ctx ended.
	parts := []struct {
		kinds []string
		run   func(context.Context) ([]Row, error)
	}{
		{[]string{KindAgent, KindServer, KindCarrier, KindCarrierServer, KindStandby, KindRollout, KindSoak}, r.tendril},
		{[]string{KindReplica, KindNode}, r.replicas},
		{[]string{KindControlPlane}, one(r.controlPlane)},
		{[]string{KindOpenVPN}, one(r.openvpn)},
		{[]string{KindCarrier, KindSoak}, r.openvpnCarrier},
		{[]string{KindCarrier, KindSoak}, r.konnectivityCarrier},
	}
	var errs []error
	for i, p := range parts {
		if !slices.ContainsFunc(p.kinds, r.want) || i > 0 && ctx.Err() != nil {
			continue
		}
		rows, err := p.run(ctx)
		rep.Rows = append(rep.Rows, rows...)
		errs = append(errs, err)
	}
	err = errors.Join(errs...)
	rep.Partial = err != nil || ctx.Err() != nil
	return rep, err
}

// one is a part that measures one row, as a part that measures rows.
func one(f func(context.Context) (*Row, error)) func(context.Context) ([]Row, error) {
	return func(ctx context.Context) ([]Row, error) {
		row, err := f(ctx)
		if row == nil {
			return nil, err
		}
		return []Row{*row}, err
	}
}

// runner is one run's state.
type runner struct {
	cfg  Config
	topo *topology
	tmp  string
}

func (r *runner) logf(format string, args ...any) {
	if r.cfg.Progress != nil {
		fmt.Fprintf(r.cfg.Progress, "failover: "+format+"\n", args...)
	}
}

// podGreeting is what the pod writes on every connection before it closes it: a dial that
// reads it reached the pod, not just some front-end.
const podGreeting = "pod"

// startPod listens on the pod's address in the shoot: it greets every connection on one port
// and echoes on another (podEchoAddr).
func (r *runner) startPod() (io.Closer, error) {
	var l, echo net.Listener
	if err := netns.In(r.topo.shootNS, func() (err error) {
		if l, err = net.Listen("tcp", r.podAddr()); err != nil {
			return err
		}
		if echo, err = net.Listen("tcp", r.podEchoAddr()); err != nil {
			l.Close()
		}
		return err
	}); err != nil {
		return nil, fmt.Errorf("failover: pod: %w", err)
	}
	p := &pod{l: l, echo: echo, done: make(chan struct{})}
	go p.serve()
	return p, nil
}

func (r *runner) podAddr() string { return net.JoinHostPort(r.topo.podAddr.String(), "8080") }

type pod struct {
	l, echo net.Listener
	echoes  inflight.Set // the echo's connections, closed at Close
	done    chan struct{}
}

func (p *pod) serve() {
	defer close(p.done)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		for {
			c, err := p.echo.Accept()
			if err != nil {
				return
			}
			if !p.echoes.Add(c) {
				c.Close()
				return
			}
			wg.Go(func() {
				defer p.echoes.Done(c)
				_, _ = io.Copy(c, c)
			})
		}
	})
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		wg.Go(func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = io.WriteString(c, podGreeting)
		})
	}
}

func (p *pod) Close() error {
	err := errors.Join(p.l.Close(), p.echo.Close())
	p.echoes.Close()
	<-p.done
	return err
}

// dialFunc dials the pod once through the stack under test and returns nil once the pod's
// greeting arrived.
type dialFunc func(ctx context.Context) error

// readGreeting reads the pod's greeting from r to its end.
func readGreeting(r io.Reader) error {
	b, err := io.ReadAll(io.LimitReader(r, 64))
	if err != nil {
		return err
	}
	if string(b) != podGreeting {
		return fmt.Errorf("answer %q, want %q", b, podGreeting)
	}
	return nil
}

// Loop timing: a dial every dialEvery, each with dialTimeout, at most maxInFlight at once.
const (
	dialEvery   = 20 * time.Millisecond
	dialTimeout = 3 * time.Second
	// maxInFlight: dialTimeout / dialEvery = 150 dials could hang at once; 64 keep the
	// loop's own load small, and a full set skips ticks (those dials would have hung too).
	maxInFlight = 64
	// recoverWithin bounds one recovery: longer is a failure of the run, not a figure.
	recoverWithin = 60 * time.Second
)

// dialLoop dials every dialEvery until stop is called, which returns the results so far.
type dialLoop struct {
	mu      sync.Mutex
	results []dialResult
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

type dialResult struct {
	start, end time.Time
	err        error
}

func startDialLoop(ctx context.Context, dial dialFunc) *dialLoop {
	ctx, cancel := context.WithCancel(ctx)
	l := &dialLoop{cancel: cancel}
	slots := make(chan struct{}, maxInFlight)
	l.wg.Go(func() {
		tick := time.NewTicker(dialEvery)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			select {
			case slots <- struct{}{}:
			default:
				continue
			}
			l.wg.Go(func() {
				defer func() { <-slots }()
				res := dialResult{start: time.Now()}
				dctx, cancel := context.WithTimeout(ctx, dialTimeout)
				res.err = dial(dctx)
				cancel()
				res.end = time.Now()
				if ctx.Err() != nil && res.err != nil {
					return // cut off by stop: not a result
				}
				l.mu.Lock()
				l.results = append(l.results, res)
				l.mu.Unlock()
			})
		}
	})
	return l
}

// firstSuccessAfter returns the earliest end of a successful dial that started after t.
// A dial still in flight ends later than now, so once one is found it is the earliest.
func (l *dialLoop) firstSuccessAfter(t time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var best time.Time
	for _, r := range l.results {
		if r.err == nil && r.start.After(t) && (best.IsZero() || r.end.Before(best)) {
			best = r.end
		}
	}
	return best, !best.IsZero()
}

// startedBetween returns the results of the dials started in [from, to).
func (l *dialLoop) startedBetween(from, to time.Time) []dialResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []dialResult
	for _, r := range l.results {
		if !r.start.Before(from) && r.start.Before(to) {
			out = append(out, r)
		}
	}
	return out
}

// lastError is the error of the last failed dial, for a message.
func (l *dialLoop) lastError() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range slices.Backward(l.results) {
		if r.err != nil {
			return r.err
		}
	}
	return nil
}

func (l *dialLoop) stop() {
	l.cancel()
	l.wg.Wait()
}

// measureKill runs a dial loop, lets it succeed once, then calls kill, which kills and returns
// when it sent the signal (and may restart what it killed), and returns the time from the kill
// to the end of the first successful dial started after it.
func measureKill(ctx context.Context, dial dialFunc, kill func() (time.Time, error)) (time.Duration, error) {
	loop := startDialLoop(ctx, dial)
	defer loop.stop()
	d, _, err := measureOn(ctx, loop, kill)
	return d, err
}

// measureOn is measureKill on a running loop; it also returns the kill's time.
func measureOn(ctx context.Context, loop *dialLoop, kill func() (time.Time, error)) (time.Duration, time.Time, error) {
	// The loop works before the kill: else a failure would be the setup's, not the kill's.
	if err := until(ctx, 10*time.Second, func() error {
		if _, ok := loop.firstSuccessAfter(time.Time{}); !ok {
			return fmt.Errorf("no successful dial before the kill yet (last: %v)", loop.lastError())
		}
		return nil
	}); err != nil {
		return 0, time.Time{}, err
	}
	at, err := kill()
	if err != nil {
		return 0, at, err
	}
	var end time.Time
	err = until(ctx, recoverWithin, func() error {
		var ok bool
		if end, ok = loop.firstSuccessAfter(at); !ok {
			return fmt.Errorf("no successful dial since the kill (last: %v)", loop.lastError())
		}
		return nil
	})
	if err != nil {
		return 0, at, err
	}
	return end.Sub(at), at, nil
}

// until calls f every 5 ms until it succeeds, fails with errExited, timeout passes or ctx
// ends.
func until(ctx context.Context, timeout time.Duration, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		err := f()
		if err == nil || errors.Is(err, errExited) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}
