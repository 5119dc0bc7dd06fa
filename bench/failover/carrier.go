package failover

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"sync"
	"time"

	"github.com/tendril-net/tendril/bench/internal/connectdial"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/netns"
)

// The carrier kind: long-lived connections through the tunnel (kubectl logs -f, exec,
// port-forward, kube-apiserver's watches to webhooks) while the agents' streams to the ingress
// are cut. WireGuard keeps no state in its carrier, so once an agent has dialled again the inner
// TCP connections carry on after a retransmit: a cut should break none of them and stall each
// for no longer than the agent's return plus the inner retransmit.
const (
	// heldStreams is how many connections are held across the cuts.
	heldStreams = 8
	// pingEvery is each held connection's round trip: an 8-byte sequence number and its echo. A
	// stall is measured to this resolution.
	pingEvery = 20 * time.Millisecond
	// brokenAfter: a held connection whose echo is this late counts as broken (and is not
	// measured further), as a client's own timeout would end it.
	brokenAfter = 10 * time.Second
	// settleAfterCut: a stall that a cut sets off starts within this long after the cut
	// returned (the agents' streams end at once, or as a drained replica exits).
	settleAfterCut = time.Second
)

// podEchoAddr is the pod's echo port, the held connections' target.
func (r *runner) podEchoAddr() string { return net.JoinHostPort(r.topo.podAddr.String(), "8081") }

// heldStream is one held connection: the times of its echoes and, once broken, why.
type heldStream struct {
	mu     sync.Mutex
	echoes []time.Time
	err    error
}

// longestStall is the longest gap between two successive echoes of the stream from its last
// echo at or before from to its first after to: a cut at from whose effects are over by to.
// False if it had not echoed by from, or has not echoed after to (yet).
func (h *heldStream) longestStall(from, to time.Time) (time.Duration, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var prev time.Time
	var longest time.Duration
	for _, e := range h.echoes {
		switch {
		case !e.After(from):
			prev = e
			continue
		case prev.IsZero():
			return 0, false // it had not echoed before from: not held then
		}
		longest = max(longest, e.Sub(prev))
		prev = e
		if e.After(to) {
			return longest, true
		}
	}
	return 0, false
}

// forget drops the echoes before the last one: a cut measured, the next cut's stall starts no
// earlier than it. Without it a 10-minute soak keeps 30,000 times per connection.
func (h *heldStream) forget() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := len(h.echoes); n > 1 {
		h.echoes = []time.Time{h.echoes[n-1]}
	}
}

func (h *heldStream) echoed() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.echoes)
}

func (h *heldStream) broken() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// holdStreams opens n connections to the pod's echo with dial and pings on each until ctx
// ends; stop waits for them.
func holdStreams(ctx context.Context, dial func(context.Context) (net.Conn, error), n int) ([]*heldStream, func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	stop := func() { cancel(); wg.Wait() }
	var streams []*heldStream
	for range n {
		c, err := dial(ctx)
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("failover: a held connection: %w", err)
		}
		h := &heldStream{}
		streams = append(streams, h)
		stopClose := context.AfterFunc(ctx, func() { c.Close() })
		wg.Go(func() {
			defer stopClose()
			defer c.Close()
			err := h.ping(ctx, c)
			if ctx.Err() == nil {
				h.mu.Lock()
				h.err = err
				h.mu.Unlock()
			}
		})
	}
	return streams, stop, nil
}

// ping sends a sequence number every pingEvery and reads its echo, until an error.
func (h *heldStream) ping(ctx context.Context, c net.Conn) error {
	tick := time.NewTicker(pingEvery)
	defer tick.Stop()
	var out, in [8]byte
	for seq := uint64(1); ; seq++ {
		binary.BigEndian.PutUint64(out[:], seq)
		_ = c.SetDeadline(time.Now().Add(brokenAfter))
		if _, err := c.Write(out[:]); err != nil {
			return err
		}
		if _, err := io.ReadFull(c, in[:]); err != nil {
			return err
		}
		if in != out {
			return fmt.Errorf("echo %x, want %x", in, out)
		}
		h.mu.Lock()
		h.echoes = append(h.echoes, time.Now())
		h.mu.Unlock()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// connectStream dials target with an HTTP CONNECT on the Unix socket sock (tendril-server's)
// and returns the tunnel once answered 200.
func connectStream(ctx context.Context, sock, target string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	return connectdial.Dialer("unix", sock, nil, target)(ctx)
}

// waitTunnel waits until a dial through the tunnel reaches the pod, while procs run.
func waitTunnel(ctx context.Context, dial func(context.Context) (net.Conn, error), procs ...*peers.Process) error {
	err := waitProcs(ctx, 60*time.Second, func() error {
		c, err := dial(ctx)
		if err == nil {
			c.Close()
		}
		return err
	}, procs...)
	if err != nil {
		return fmt.Errorf("the tunnel: %w", err)
	}
	return nil
}

// cutResult is what measureCuts saw.
type cutResult struct {
	// stalls are, per cut after which a held connection carried on, the longest stall of one.
	stalls []time.Duration
	// held and broken count the connections held at the cuts and those a cut broke; firstErr is
	// the first broken one's error.
	held, broken int
	firstErr     error
}

// measureCuts holds n connections (dial) while cut is called reps times (each once every held
// connection has echoed since the last). A cut that broke connections is followed by n new
// ones, once the path carries them again: every cut meets n held connections.
func measureCuts(ctx context.Context, dial func(context.Context) (net.Conn, error), n, reps int, every time.Duration, cut func() error, logf func(string, ...any)) (cutResult, error) {
	var res cutResult
	var streams []*heldStream
	stop := func() {}
	defer func() { stop() }()
	open := func() error {
		stop()
		return until(ctx, recoverWithin, func() (err error) {
			streams, stop, err = holdStreams(ctx, dial, n)
			if err != nil {
				stop = func() {}
				return err
			}
			for i, h := range streams { // every connection is held (has echoed) before a cut
				if err := until(ctx, dialTimeout, func() error {
					if h.echoed() == 0 {
						return fmt.Errorf("held connection %d has not echoed yet", i)
					}
					return h.broken()
				}); err != nil {
					stop()
					stop = func() {}
					return err
				}
			}
			return nil
		})
	}
	if err := open(); err != nil {
		return res, err
	}
	for i := range reps {
		at := time.Now()
		if err := cut(); err != nil {
			return res, err
		}
		// What a cut sets off may end after cut returns (a drained replica closes the streams
		// as it exits): the stall counts until a settle after it.
		settled := time.Now().Add(settleAfterCut)
		res.held += len(streams)
		var worst time.Duration
		var broken int
		err := until(ctx, recoverWithin, func() error {
			worst, broken = 0, 0
			for j, h := range streams {
				if err := h.broken(); err != nil {
					broken++
					if res.firstErr == nil {
						res.firstErr = err
					}
					continue
				}
				d, ok := h.longestStall(at, settled)
				if !ok {
					return fmt.Errorf("held connection %d has not echoed since %s", j, settled.Format(time.StampMilli))
				}
				worst = max(worst, d)
			}
			return nil
		})
		if err != nil {
			return res, fmt.Errorf("cut %d: %w", i+1, err)
		}
		for _, h := range streams {
			h.forget()
		}
		res.broken += broken
		if broken < len(streams) {
			res.stalls = append(res.stalls, worst)
		}
		logf("cut %d/%d: %d of %d held connections broken, longest stall of the others %v", i+1, reps, broken, len(streams), worst.Round(time.Millisecond))
		// The settle also lets the tunnel's streams be back and healthy before the next cut
		// (their backoff starts over after a healthy stream).
		if wait := time.Until(at.Add(every)); wait > 0 && i+1 < reps {
			select {
			case <-ctx.Done():
				return res, ctx.Err()
			case <-time.After(wait):
			}
		}
		if broken > 0 && i+1 < reps {
			if err := open(); err != nil {
				return res, fmt.Errorf("after cut %d: %w", i+1, err)
			}
		}
	}
	return res, nil
}

// openvpnCarrier is the carrier kind on the peer: one OpenVPN server and the client in the
// shoot, whose TCP connection to the server goes through a proxy in the shoot that cuts it;
// the held connections go from the server's namespace into its tun, as kube-apiserver's do.
func (r *runner) openvpnCarrier(ctx context.Context) ([]Row, error) {
	o := peers.OpenVPN{}
	if err := o.Check(ctx); err != nil {
		return nil, fmt.Errorf("failover: openvpn: %w", err)
	}
	row := Row{Kind: KindCarrier, Stack: o.Version(ctx), Killed: fmt.Sprintf("the client's TCP connection to the server cut (%d connections held through the tunnel)", heldStreams),
		Recovers: "the client finds the connection reset, restarts (connect-retry 1 5), connects again and renegotiates TLS"}
	if err := r.topo.addOpenVPNSeeds(ctx, 1); err != nil {
		return nil, fmt.Errorf("failover: openvpn: %w", err)
	}
	server := netip.AddrPortFrom(r.topo.ovpnAddr[0], openvpnPort).String()
	cutter, err := newForwarderIn(r.topo.shootNS, "127.0.0.1:0", []string{server})
	if err != nil {
		return nil, err
	}
	defer cutter.Close()
	dir := filepath.Join(r.tmp, "openvpn-carrier")
	srvArgs, clientConf, err := r.openvpnSetup(ctx, o, dir, 1, func(int) string { return cutter.l.Addr().String() })
	if err != nil {
		return nil, err
	}
	procs := &ovpnProcs{r: r, dir: dir, args: srvArgs, servers: make([]*peers.Process, 1)}
	defer procs.stop()
	if err := procs.startServer(ctx, 0); err != nil {
		return nil, err
	}
	if err := procs.startClient(o, clientConf); err != nil {
		return nil, err
	}
	dial := func(ctx context.Context) (net.Conn, error) {
		var c net.Conn
		err := netns.In(r.topo.ovpnNS[0], func() (err error) {
			dctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			c, err = (&net.Dialer{}).DialContext(dctx, "tcp", r.podEchoAddr())
			return err
		})
		return c, err
	}
	if err := waitTunnel(ctx, dial, procs.servers[0], procs.client); err != nil {
		return []Row{row}, fmt.Errorf("failover: openvpn: %w", err)
	}
	return r.peerCuts(ctx, row, dial, func() error { cutter.conns.Reset(); return nil })
}

// peerCuts measures a peer's carrier cuts into row (KindCarrier) and its soak (KindSoak), each
// if asked for. The peers have no ingress of tendril's kind to roll: their carrier is one TCP
// connection, and a rollout of whatever is in front of it (Istio's ingress gateway for
// Gardener's VPN) cuts it as these cuts do, so the soak's two rollout steps are two more cuts.
func (r *runner) peerCuts(ctx context.Context, row Row, dial func(context.Context) (net.Conn, error), cut func() error) ([]Row, error) {
	var rows []Row
	if r.want(KindCarrier) {
		err := r.cuts(ctx, &row, dial, cut)
		rows = append(rows, row)
		if err != nil {
			return rows, err
		}
	}
	if r.want(KindSoak) {
		reps := r.cfg.Repetitions
		soak := Row{Kind: KindSoak, Stack: row.Stack, Killed: fmt.Sprintf("%d carrier cuts, as the carrier kind (%d connections held throughout)", reps+2, heldStreams),
			Recovers: row.Recovers}
		err := r.cutsN(ctx, &soak, reps+2, dial, cut)
		rows = append(rows, soak)
		if err != nil {
			return rows, err
		}
	}
	return rows, nil
}

// cuts measures Repetitions cuts of held connections (dial) into row.
func (r *runner) cuts(ctx context.Context, row *Row, dial func(context.Context) (net.Conn, error), cut func() error) error {
	return r.cutsN(ctx, row, r.cfg.Repetitions, dial, cut)
}

// cutsN is cuts with reps cuts.
func (r *runner) cutsN(ctx context.Context, row *Row, reps int, dial func(context.Context) (net.Conn, error), cut func() error) error {
	res, err := measureCuts(ctx, dial, heldStreams, reps, r.cfg.CutEvery, cut, func(format string, args ...any) {
		r.logf(row.Stack+": "+format, args...)
	})
	row.Times, row.Held, row.Broken = res.stalls, res.held, res.broken
	row.Note = fmt.Sprintf("%d connections held at each cut, a round trip on each every %v; %d of %d broken (a stall of %v counts as broken); the figure is the longest stall of any held connection that carried on, per cut", heldStreams, pingEvery, res.broken, res.held, brokenAfter)
	if res.firstErr != nil {
		row.Note += fmt.Sprintf(" (first: %v)", res.firstErr)
	}
	return err
}
