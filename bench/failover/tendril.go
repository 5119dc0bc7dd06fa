package failover

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/internal/connectdial"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// nsTendril is the shoot's namespace name in the ingress's routes.
const nsTendril = "shoot--bench--failover"

// tendrilRig is the seed (tendril-seed with a route file, tendril-ingress, one tendril-server)
// and a shoot with two tendril-agent processes that reach the server only through the ingress,
// as the extension deploys them for an HA control plane.
type tendrilRig struct {
	r           *runner
	dir         string
	ingress     []*peers.Process
	server      *peers.Process
	serverArgs  []string
	serverPorts []string          // what the server listens on, bound again before a restart
	serverSocks []*inherit.Socket // their sockets, bound for the next server start
	agents      [2]*peers.Process
	agentArgs   [2][]string
	agentPub    [2]string
	metrics     string // tendril-server's /metrics
	sock        string // tendril-server's CONNECT socket: kube-apiserver's egress
	// carrier is between the agents and the ingress, as the load balancer and the network are:
	// the carrier kind cuts the agents' streams there.
	carrier *forwarder
	xds     string // tendril-seed's xDS address, for another ingress replica
	// serverCarrier is between the ingress and tendril-server's tunnel port.
	serverCarrier *forwarder
}

func (r *runner) bin(name string) string {
	p, _ := filepath.Abs(filepath.Join(r.cfg.BinDir, name))
	return p
}

// tendril measures the agent and server kinds asked for.
func (r *runner) tendril(ctx context.Context) ([]Row, error) {
	rig, err := r.startTendril(ctx)
	if rig != nil {
		defer rig.stop()
	}
	if err != nil {
		return nil, err
	}
	dial := rig.dial()
	var rows []Row
	if r.want(KindAgent) {
		row := Row{Kind: KindAgent, Stack: "tendril", Killed: "the active tendril-agent of two (SIGKILL)",
			Recovers: "tendril-server moves the shoot's networks to the other agent 0.6 s after the dead one's stream ended"}
		for i := range r.cfg.Repetitions {
			active, err := rig.bothLive(ctx)
			if err != nil {
				return append(rows, row), err
			}
			d, err := measureKill(ctx, dial, func() (time.Time, error) {
				at := time.Now()
				return at, rig.kill(rig.agents[active])
			})
			if err != nil {
				return append(rows, row), fmt.Errorf("agent kill %d: %w", i+1, err)
			}
			row.Times = append(row.Times, d)
			r.logf("agent kill %d/%d: %v", i+1, r.cfg.Repetitions, d.Round(time.Millisecond))
			if err := rig.startAgent(active); err != nil {
				return append(rows, row), err
			}
		}
		rows = append(rows, row)
	}
	if r.want(KindServer) {
		row := Row{Kind: KindServer, Stack: "tendril", Killed: "tendril-server (SIGKILL), started again at once as kubelet would",
			Recovers: "both agents reconnect through the ingress (backoff 0.1–0.2 s) and handshake"}
		for i := range r.cfg.Repetitions {
			if _, err := rig.bothLive(ctx); err != nil {
				return append(rows, row), err
			}
			d, err := measureKill(ctx, dial, func() (time.Time, error) {
				at := time.Now()
				if err := rig.kill(rig.server); err != nil {
					return at, err
				}
				return at, rig.restartServer(ctx)
			})
			if err != nil {
				return append(rows, row), fmt.Errorf("server kill %d: %w", i+1, err)
			}
			row.Times = append(row.Times, d)
			r.logf("server kill %d/%d: %v", i+1, r.cfg.Repetitions, d.Round(time.Millisecond))
		}
		rows = append(rows, row)
	}
	// The kinds that hold connections through the tunnel, one row each.
	for _, k := range []struct {
		kind string
		run  func(context.Context) (Row, error)
	}{{KindStandby, rig.standbyKills}, {KindRollout, rig.rollouts}, {KindCarrier, rig.carrierCuts}, {KindCarrierServer, rig.serverCarrierCuts}, {KindSoak, rig.soak}} {
		if !r.want(k.kind) {
			continue
		}
		row, err := k.run(ctx)
		rows = append(rows, row)
		if err != nil {
			return rows, err
		}
	}
	return rows, nil
}

// carrierCuts holds connections through the tunnel while the agents' streams to the ingress
// are cut, Repetitions times.
func (rig *tendrilRig) carrierCuts(ctx context.Context) (Row, error) {
	return rig.cutsAt(ctx, rig.carrier, Row{Kind: KindCarrier, Stack: "tendril",
		Killed:   fmt.Sprintf("both agents' streams to the ingress cut (%d connections held through the tunnel)", heldStreams),
		Recovers: "the agents dial again (backoff 0.1–0.2 s); WireGuard goes on over the new stream with its session, the held connections retransmit"})
}

// serverCarrierCuts holds connections through the tunnel while the ingress's connections to
// tendril-server's tunnel port are cut, Repetitions times: the ingress closes the agents' side
// of each, and the agents dial again.
func (rig *tendrilRig) serverCarrierCuts(ctx context.Context) (Row, error) {
	return rig.cutsAt(ctx, rig.serverCarrier, Row{Kind: KindCarrierServer, Stack: "tendril",
		Killed:   fmt.Sprintf("the ingress's connections to tendril-server cut (%d connections held through the tunnel)", heldStreams),
		Recovers: "the ingress closes the agents' streams; they dial again through it"})
}

// cutsAt measures row's kind: connections held through the tunnel while f's connections are
// cut, Repetitions times.
func (rig *tendrilRig) cutsAt(ctx context.Context, f *forwarder, row Row) (Row, error) {
	if _, err := rig.bothLive(ctx); err != nil {
		return row, err
	}
	err := rig.r.cuts(ctx, &row, rig.dialHeld, func() error { f.conns.Reset(); return nil })
	return row, err
}

// dialHeld opens a connection to the pod's echo through the tunnel: an HTTP CONNECT on
// tendril-server's socket, as kube-apiserver's.
func (rig *tendrilRig) dialHeld(ctx context.Context) (net.Conn, error) {
	return connectStream(ctx, rig.sock, rig.r.podEchoAddr())
}

// rollouts holds connections through the tunnel while the ingress is rolled, Repetitions times
// (rollIngress): a new replica starts, the old one is sent SIGTERM and the Service moves to the
// new one during its --drain-delay; the old one then drains for 1 s and closes the agents'
// streams, which dial again and reach the new one.
func (rig *tendrilRig) rollouts(ctx context.Context) (Row, error) {
	r := rig.r
	row := Row{Kind: KindRollout, Stack: "tendril", Killed: fmt.Sprintf("a rollout of the ingress: a new replica up, the old one drained (SIGTERM, --drain-delay 1s, --drain-timeout 1s) (%d connections held through the tunnel)", heldStreams),
		Recovers: "the drained replica closes the agents' streams; they dial again through the Service to the new one"}
	if _, err := rig.bothLive(ctx); err != nil {
		return row, err
	}
	n := 0
	err := r.cuts(ctx, &row, rig.dialHeld, func() error { n++; return rig.rollIngress(ctx, n) })
	return row, err
}

// rollIngress is one step of a rollout: replica n starts and becomes the Service's endpoint,
// the one serving is sent SIGTERM and drains; it returns once that one exited.
func (rig *tendrilRig) rollIngress(ctx context.Context, n int) error {
	cur := len(rig.ingress) - 1 // the serving replica; rig.ingress[0] is tendril-seed
	next, addr, err := rig.r.startIngress(ctx, rig.dir, fmt.Sprintf("tendril-ingress-%d", n), rig.xds, "--tunnel-address", rig.ingress...)
	if next != nil {
		rig.ingress = append(rig.ingress, next)
	}
	if err != nil {
		return err
	}
	old := rig.ingress[cur]
	rig.ingress = slices.Delete(rig.ingress, cur, cur+1)
	// As in a Deployment's rollout: the old pod gets SIGTERM while it is still an endpoint; its
	// /readyz fails and it goes on accepting for --drain-delay, and the Service drops it
	// endpointLag later (kube-proxy's update), inside that delay. Then it drains.
	stopped := make(chan error, 1)
	go func() { stopped <- old.Stop() }() // returns once it drained and exited
	select {
	case <-time.After(endpointLag):
	case <-ctx.Done():
	}
	rig.carrier.setBackends([]string{addr})
	return <-stopped
}

// ingressDrainDelay is the replicas' --drain-delay: the time from SIGTERM to closing the
// listeners, in which the Service stops sending them connections (endpointLag).
const ingressDrainDelay = time.Second

// endpointLag is how long after a replica's SIGTERM the bench's Service stops sending it new
// connections: under the replicas' --drain-delay (ingressDrainDelay), as an endpoint update
// takes less than the chart's 5 s.
const endpointLag = 300 * time.Millisecond

// soak holds one set of connections through Repetitions carrier cuts and, halfway, a rollout of
// the ingress's two replicas one after the other, CutEvery apart.
func (rig *tendrilRig) soak(ctx context.Context) (Row, error) {
	r := rig.r
	reps := r.cfg.Repetitions
	row := Row{Kind: KindSoak, Stack: "tendril", Killed: fmt.Sprintf("%d carrier cuts with a rollout of both ingress replicas halfway (%d connections held throughout)", reps, heldStreams),
		Recovers: "as for the carrier and ingress-rollout kinds"}
	if _, err := rig.bothLive(ctx); err != nil {
		return row, err
	}
	event, rolled := 0, 0
	err := r.cutsN(ctx, &row, reps+2, rig.dialHeld, func() error {
		event++
		if event > reps/2 && rolled < 2 { // the two rollout steps, after half the cuts
			rolled++
			return rig.rollIngress(ctx, 100+rolled)
		}
		rig.carrier.conns.Reset()
		return nil
	})
	return row, err
}

// standbyKills holds connections through the active agent while the standby one is killed
// and started again, Repetitions times: the connections go through the active agent only, so
// none should break or stall beyond a round trip.
func (rig *tendrilRig) standbyKills(ctx context.Context) (Row, error) {
	r := rig.r
	row := Row{Kind: KindStandby, Stack: "tendril", Killed: fmt.Sprintf("the standby tendril-agent of two (SIGKILL), started again (%d connections held through the active one)", heldStreams),
		Recovers: "nothing to recover: the shoot's networks stay with the active agent"}
	active, err := rig.bothLive(ctx)
	if err != nil {
		return row, err
	}
	standby := 1 - active
	err = r.cuts(ctx, &row, rig.dialHeld, func() error {
		if err := rig.kill(rig.agents[standby]); err != nil {
			return err
		}
		if err := rig.startAgent(standby); err != nil {
			return err
		}
		if a, err := rig.bothLive(ctx); err != nil || a != active {
			return fmt.Errorf("failover: after the standby's restart the active agent is %d (was %d): %v", a, active, err)
		}
		return nil
	})
	return row, err
}

func (r *runner) want(kind string) bool { return slices.Contains(r.cfg.Kinds, kind) }

func (r *runner) startTendril(ctx context.Context) (*tendrilRig, error) {
	for _, b := range []string{"tendril-seed", "tendril-ingress", "tendril-server", "tendril-agent"} {
		if _, err := os.Stat(r.bin(b)); err != nil {
			return nil, fmt.Errorf("failover: %s not found (make build)", r.bin(b))
		}
	}
	rig := &tendrilRig{r: r, dir: filepath.Join(r.tmp, "tendril")}
	if err := os.MkdirAll(rig.dir, 0o755); err != nil {
		return nil, err
	}
	f := func(n string) string { return filepath.Join(rig.dir, n) }
	// Every process inherits its sockets (peers.StartWithSockets): no port to lose to another.
	socks, err := peers.Bind(2)
	if err != nil {
		return nil, err
	}
	tunnelAddr := socks[0].Addr
	rig.metrics, rig.sock = socks[1].Addr, f("connect.sock")
	rig.serverPorts = []string{tunnelAddr, rig.metrics}
	rig.serverSocks = []*inherit.Socket{socks[0], socks[1]}
	// The ingress reaches the server's tunnel port through a forwarder too, the seed's network
	// between them: the carrier-server kind cuts there.
	if rig.serverCarrier, err = newForwarder("127.0.0.1:0", []string{tunnelAddr}); err != nil {
		inherit.Close(socks...)
		return rig, err
	}
	routes := fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.failover.bench.tendril.local]\n  apiserver: \"127.0.0.1:1\"\n  vpnServer: %q\n", nsTendril, rig.serverCarrier.l.Addr().String())
	var ingressListen string
	rig.ingress, ingressListen, rig.xds, err = r.startFront(ctx, rig.dir, routes, "--tunnel-address")
	if err != nil {
		inherit.Close(socks...)
		return rig, err
	}
	if rig.carrier, err = newForwarder(net.JoinHostPort(r.topo.seedAddr.String(), "0"), []string{ingressListen}); err != nil {
		inherit.Close(socks...)
		return rig, err
	}

	keys, err := writeKeys(rig.dir)
	if err != nil {
		return rig, err
	}
	rig.agentPub = keys.agentPub
	rig.serverArgs = []string{"--private-key-file", keys.serverKey, "--shoot-cidrs", r.topo.podNet.String(),
		"--tunnel-address", tunnelAddr, "--connect-address", "", "--grpc-address", "", "--connect-socket", rig.sock,
		"--metrics-address", rig.metrics, "--agent-public-key", strings.Join(keys.agentPub[:], ",")}
	for i := range 2 {
		rig.agentArgs[i] = r.agentArgs(keys, i, "--seed", rig.carrier.l.Addr().String(), "--destination", translate.TendrilServerWireName(nsTendril))
	}
	if err := rig.startServer(ctx); err != nil {
		return rig, err
	}
	for i := range 2 {
		if err := rig.startAgent(i); err != nil {
			return rig, err
		}
	}
	return rig, nil
}

// tunnelKeys are the WireGuard key files of one shoot's tunnel: the server's (one for every
// replica) and the two agents'.
type tunnelKeys struct {
	serverKey, serverPub string    // files
	agentKey             [2]string // files
	agentPub             [2]string // the keys themselves
}

// writeKeys generates the keys and writes their files into dir.
func writeKeys(dir string) (tunnelKeys, error) {
	var k tunnelKeys
	write := func(name, content string, mode os.FileMode) (string, error) {
		p := filepath.Join(dir, name)
		return p, os.WriteFile(p, []byte(content), mode)
	}
	server, err := wg.GenerateKey()
	if err != nil {
		return k, err
	}
	if k.serverKey, err = write("server.key", server.String(), 0o600); err != nil {
		return k, err
	}
	if k.serverPub, err = write("server.pub", server.PublicKey().String(), 0o644); err != nil {
		return k, err
	}
	for i := range 2 {
		a, err := wg.GenerateKey()
		if err != nil {
			return k, err
		}
		if k.agentKey[i], err = write(fmt.Sprintf("agent%d.key", i), a.String(), 0o600); err != nil {
			return k, err
		}
		k.agentPub[i] = a.PublicKey().String()
	}
	return k, nil
}

// agentArgs is the command line of agent i (of two) in the shoot, with the extension's inner
// addresses (::2 for agent 0, ::3 for agent 1: the server's defaults) and the given flags for
// the way to the seed.
func (r *runner) agentArgs(keys tunnelKeys, i int, seedFlags ...string) []string {
	args := append(netns.Exec(r.topo.shootNS), r.bin("tendril-agent"), "vpn",
		"--private-key-file", keys.agentKey[i], "--address", fmt.Sprintf("fd8f:6d53:b97a:1::%d", 2+i),
		"--server-public-key", "@"+keys.serverPub, "--shoot-cidrs", r.topo.podNet.String(), "--metrics-address", "")
	return append(args, seedFlags...)
}

func (rig *tendrilRig) startServer(ctx context.Context) error {
	srv, err := peers.StartWithSockets("tendril-server", filepath.Join(rig.dir, "tendril-server.log"), rig.takeServerSocks(), rig.r.bin("tendril-server"), rig.serverArgs...)
	if err != nil {
		return err
	}
	srv.KillAtOnce = true
	rig.server = srv
	if err := waitProcs(ctx, 10*time.Second, httpOK("http://"+rig.metrics+"/healthz"), srv); err != nil {
		return fmt.Errorf("failover: tendril-server: %w", err)
	}
	return nil
}

// takeServerSocks hands the server sockets bound for it over to the caller.
func (rig *tendrilRig) takeServerSocks() []*inherit.Socket {
	s := rig.serverSocks
	rig.serverSocks = nil
	return s
}

// restartServer starts tendril-server again on its addresses once they can be bound again: a
// killed server's sockets may hold them for a moment (a real restart is a new pod with its own
// address). This process binds them and the new server inherits the sockets, as at the start.
func (rig *tendrilRig) restartServer(ctx context.Context) error {
	if err := until(ctx, 10*time.Second, func() error {
		inherit.Close(rig.takeServerSocks()...) // of an attempt that bound only some
		for _, a := range rig.serverPorts {
			s, err := inherit.Bind(a)
			if err != nil {
				return err
			}
			rig.serverSocks = append(rig.serverSocks, s)
		}
		return nil
	}); err != nil {
		inherit.Close(rig.takeServerSocks()...)
		return fmt.Errorf("failover: tendril-server's ports: %w", err)
	}
	srv, err := peers.StartWithSockets("tendril-server", filepath.Join(rig.dir, "tendril-server.log"), rig.takeServerSocks(), rig.r.bin("tendril-server"), rig.serverArgs...)
	if err != nil {
		return err
	}
	srv.KillAtOnce = true
	rig.server = srv
	return nil
}

func (rig *tendrilRig) startAgent(i int) error {
	a, err := peers.StartProcess(fmt.Sprintf("tendril-agent-%d", i), filepath.Join(rig.dir, fmt.Sprintf("tendril-agent-%d.log", i)),
		rig.agentArgs[i][0], rig.agentArgs[i][1:]...)
	if err != nil {
		return err
	}
	a.KillAtOnce = true
	rig.agents[i] = a
	return nil
}

// kill SIGKILLs p's process group and waits until it is gone.
func (rig *tendrilRig) kill(p *peers.Process) error { return p.Stop() }

func (rig *tendrilRig) stop() {
	for _, a := range rig.agents {
		if a != nil {
			_ = a.Stop()
		}
	}
	if rig.server != nil {
		_ = rig.server.Stop()
	}
	for i := len(rig.ingress) - 1; i >= 0; i-- {
		_ = rig.ingress[i].Stop()
	}
	if rig.carrier != nil {
		_ = rig.carrier.Close()
	}
	if rig.serverCarrier != nil {
		_ = rig.serverCarrier.Close()
	}
}

// bothLive waits until tendril-server reports both agents live and returns the active one.
func (rig *tendrilRig) bothLive(ctx context.Context) (int, error) {
	active := -1
	err := waitProcs(ctx, 30*time.Second, func() error {
		m, err := get("http://" + rig.metrics + "/metrics")
		if err != nil {
			return err
		}
		active, err = seedserver.ActiveAgent(m, rig.agentPub[:])
		return err
	}, append([]*peers.Process{rig.server, rig.agents[0], rig.agents[1]}, rig.ingress...)...)
	if err != nil {
		return -1, fmt.Errorf("failover: both agents live: %w", err)
	}
	return active, nil
}

// dial is kube-apiserver's egress to the pod: HTTP CONNECT on tendril-server's Unix socket
// (the mutual-TLS port costs a handshake per dial and measures nothing of the failover), which
// dials through the tunnel before it answers 200; then the pod's greeting.
func (rig *tendrilRig) dial() dialFunc { return connectDial(rig.sock, rig.r.podAddr()) }

// connectDial dials pod with an HTTP CONNECT on the Unix socket sock and reads its greeting.
func connectDial(sock, pod string) dialFunc {
	dial := connectdial.Dialer("unix", sock, nil, pod)
	return func(ctx context.Context) error {
		c, err := dial(ctx)
		if err != nil {
			return err
		}
		defer c.Close()
		if dl, ok := ctx.Deadline(); ok {
			_ = c.SetDeadline(dl)
		}
		return readGreeting(c)
	}
}

// startFront starts the seed's front of the tunnels: tendril-seed in file mode serving routes
// (a route file's YAML) over xDS, and tendril-ingress taking them (startIngress). It returns
// both processes, also on an error (for the caller to stop), the address the agents dial, and
// the xDS server's.
func (r *runner) startFront(ctx context.Context, dir, routes, listenFlag string) ([]*peers.Process, string, string, error) {
	f := func(n string) string { return filepath.Join(dir, n) }
	socks, err := peers.Bind(1)
	if err != nil {
		return nil, "", "", err
	}
	xdsAddr := socks[0].Addr
	if err := os.WriteFile(f("routes.yaml"), []byte(routes), 0o644); err != nil {
		inherit.Close(socks...)
		return nil, "", "", err
	}
	seed, err := peers.StartWithSockets("tendril-seed", f("tendril-seed.log"), socks, r.bin("tendril-seed"),
		"--routes", f("routes.yaml"), "--xds-address", xdsAddr, "--xds-insecure", "--metrics-address", "")
	if err != nil {
		return nil, "", "", err
	}
	procs := []*peers.Process{seed}
	ing, listen, err := r.startIngress(ctx, dir, "tendril-ingress", xdsAddr, listenFlag, seed)
	if ing != nil {
		procs = append(procs, ing)
	}
	return procs, listen, xdsAddr, err
}

// startIngress starts a tendril-ingress replica named name taking its routes from xdsAddr, its
// listener for the agents given by listenFlag (--tunnel-address or --proxy-address) on the
// seed's side of the shoot's link, and waits until it is ready while it and others run. A
// SIGTERM keeps it accepting for ingressDrainDelay, then drains it for 1 s (a rollout's step;
// the chart's delay and timeout are longer). It returns the
// process, also on an error, and the address the agents dial.
func (r *runner) startIngress(ctx context.Context, dir, name, xdsAddr, listenFlag string, others ...*peers.Process) (*peers.Process, string, error) {
	metrics, err := peers.Bind(1)
	if err != nil {
		return nil, "", err
	}
	listenSock, err := inherit.Bind(net.JoinHostPort(r.topo.seedAddr.String(), "0"))
	if err != nil {
		inherit.Close(metrics...)
		return nil, "", err
	}
	listen, ingressMetrics := listenSock.Addr, metrics[0].Addr
	ing, err := peers.StartWithSockets(name, filepath.Join(dir, name+".log"), []*inherit.Socket{listenSock, metrics[0]}, r.bin("tendril-ingress"),
		"--xds", xdsAddr, "--xds-insecure", "--node-id", "bench-failover-"+name, listenFlag, listen, "--metrics-address", ingressMetrics,
		"--drain-delay", ingressDrainDelay.String(), "--drain-timeout", "1s")
	if err != nil {
		return nil, "", err
	}
	if err := waitProcs(ctx, 20*time.Second, httpOK("http://"+ingressMetrics+"/readyz"), append(others, ing)...); err != nil {
		return ing, "", fmt.Errorf("failover: %s not ready: %w", name, err)
	}
	return ing, listen, nil
}

var httpClient = &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

func get(url string) (string, error) {
	resp, err := httpClient.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}

func httpOK(url string) func() error {
	return func() error { _, err := get(url); return err }
}

// waitProcs calls f every 5 ms until it succeeds, one of procs exits, timeout passes or ctx
// ends.
func waitProcs(ctx context.Context, timeout time.Duration, f func() error, procs ...*peers.Process) error {
	return until(ctx, timeout, func() error {
		for _, p := range procs {
			if err := p.Exited(); err != nil {
				return fmt.Errorf("%w: %w", errExited, err)
			}
		}
		return f()
	})
}

var errExited = errors.New("a process exited")
