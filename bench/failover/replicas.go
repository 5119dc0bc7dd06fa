package failover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/wire"
)

// Ports of a tendril-server replica on its node (a namespace of its own: fixed ports collide
// with nothing): the tunnel, konnectivity's gRPC front-end the relay dials, /metrics.
const (
	replicaTunnelPort  = 1194
	replicaGRPCPort    = 8090
	replicaMetricsPort = 9090
)

// replicaRig is an HA shoot's seed side as the extension deploys it: two tendril-server replicas
// with one key, each on a "node" of its own (a namespace linked to the seed), routed by their
// pod names behind tendril-ingress's unified port; two agents in the shoot, each dialling both
// replicas; and kube-apiserver's egress through tendril-egress-relay, which is given both
// replicas and races them per tunnel (egressrelay/servers.go).
type replicaRig struct {
	r          *runner
	dir        string
	front      []*peers.Process // tendril-seed, tendril-ingress
	relay      *peers.Process
	servers    [2]*peers.Process
	serverArgs [2][]string
	starts     [2]int
	agents     [2]*peers.Process
	agentPub   [2]string
	sock       string // the relay's CONNECT socket: kube-apiserver's egress
	relayMetr  string // the relay's /metrics
}

// replicaAddr is replica i's node address with port.
func (rig *replicaRig) replicaAddr(i, port int) string {
	return netip.AddrPortFrom(rig.r.topo.nodeAddr[i], uint16(port)).String()
}

// replicas measures the server-replica and server-node kinds asked for.
func (r *runner) replicas(ctx context.Context) ([]Row, error) {
	rig, err := r.startReplicas(ctx)
	if rig != nil {
		defer rig.stop()
	}
	if err != nil {
		return nil, err
	}
	kinds := []struct {
		kind, killed, recovers string
		lose                   func(i int) error // loses replica i; the replica is back once restore returns
		restore                func(i int) error
	}{
		{KindReplica, "one tendril-server replica of an HA shoot's two (SIGKILL), started again after the measurement",
			"tendril-egress-relay's attempt on the killed replica fails at once (its connection reset); the other replica, which has both agents, carries the tunnel",
			func(i int) error { return rig.servers[i].Stop() }, rig.startServer},
		{KindNode, "the node of one tendril-server replica of two: its namespace drops every packet (no reset, no FIN), the replica replaced after the measurement",
			"the relay's attempt on the lost replica goes unanswered; after 250 ms (attemptDelay) the other replica is tried and carries the tunnel, and the lost one is tried last for 10 s",
			rig.loseNode, func(i int) error {
				if err := rig.restoreNode(i); err != nil {
					return err
				}
				if err := rig.servers[i].Stop(); err != nil {
					return err
				}
				return rig.startServer(i)
			}},
	}
	dial := connectDial(rig.sock, r.podAddr())
	var rows []Row
	for _, k := range kinds {
		if !r.want(k.kind) {
			continue
		}
		row := Row{Kind: k.kind, Stack: "tendril", Killed: k.killed, Recovers: k.recovers}
		var slow, failed int
		var took []time.Duration // of every dial started in lossWindow after a loss
		failoversBefore, err := rig.failovers()
		if err != nil {
			return rows, err
		}
		for n := range r.cfg.Repetitions {
			lost := n % 2 // each replica in turn
			if err := rig.ready(ctx, dial); err != nil {
				return append(rows, row), err
			}
			d, dials, err := measureLoss(ctx, dial, func() (time.Time, error) {
				at := time.Now()
				return at, k.lose(lost)
			})
			if err != nil {
				return append(rows, row), fmt.Errorf("%s %d: %w", k.kind, n+1, err)
			}
			row.Times = append(row.Times, d)
			for _, res := range dials {
				d := res.end.Sub(res.start)
				took = append(took, d)
				switch {
				case res.err != nil:
					failed++
				case d > slowDial:
					slow++
				}
			}
			r.logf("%s %d/%d (replica %d): %v", k.kind, n+1, r.cfg.Repetitions, lost, d.Round(time.Millisecond))
			if err := k.restore(lost); err != nil {
				return append(rows, row), err
			}
		}
		failoversAfter, err := rig.failovers()
		if err != nil {
			return append(rows, row), err
		}
		slices.Sort(took)
		var median, slowest time.Duration
		if len(took) > 0 {
			median, slowest = took[len(took)/2], took[len(took)-1]
		}
		row.Note = fmt.Sprintf("%d dials started within %v after the losses: %d failed, %d took longer than %v (slowest %.2f s, median %.1f ms); "+
			"the relay moved %.0f tunnels to the other replica after an attempt on the lost one",
			len(took), lossWindow, failed, slow, slowDial, slowest.Seconds(), float64(median.Microseconds())/1000, failoversAfter-failoversBefore)
		rows = append(rows, row)
	}
	return rows, nil
}

// Of the dials after a loss: those started within lossWindow of it are counted, and those that
// took longer than slowDial paid for the lost replica (a dial through the tunnel takes a few
// milliseconds here; one that waited for the relay's attemptDelay, 250 ms, exceeds it).
const (
	lossWindow = 3 * time.Second
	slowDial   = 100 * time.Millisecond
)

// measureLoss is measureKill, and it also returns the dials started within lossWindow after the
// loss, once each of them ended.
func measureLoss(ctx context.Context, dial dialFunc, lose func() (time.Time, error)) (time.Duration, []dialResult, error) {
	loop := startDialLoop(ctx, dial)
	defer loop.stop()
	d, at, err := measureOn(ctx, loop, lose)
	if err != nil {
		return 0, nil, err
	}
	// A dial started in the window ends within dialTimeout of its end.
	select {
	case <-ctx.Done():
	case <-time.After(time.Until(at.Add(lossWindow + dialTimeout))):
	}
	return d, loop.startedBetween(at, at.Add(lossWindow)), nil
}

func (r *runner) startReplicas(ctx context.Context) (*replicaRig, error) {
	for _, b := range []string{"tendril-seed", "tendril-ingress", "tendril-server", "tendril-agent", "tendril-egress-relay"} {
		if _, err := os.Stat(r.bin(b)); err != nil {
			return nil, fmt.Errorf("failover: %s not found (make build)", r.bin(b))
		}
	}
	if _, err := exec.LookPath("nft"); err != nil {
		return nil, errors.New("failover: nft not found (Debian package nftables): a lost node's namespace drops its packets with it")
	}
	if err := r.topo.addServerNodes(ctx, 2); err != nil {
		return nil, fmt.Errorf("failover: %w", err)
	}
	rig := &replicaRig{r: r, dir: filepath.Join(r.tmp, "replicas")}
	if err := os.MkdirAll(rig.dir, 0o755); err != nil {
		return nil, err
	}
	f := func(n string) string { return filepath.Join(rig.dir, n) }

	ca, err := testpki.NewCA("tendril-bench failover shoot CA")
	if err != nil {
		return nil, err
	}
	if err := ca.WriteCA(f("ca.pem")); err != nil {
		return nil, err
	}
	for name, cn := range map[string]string{"server": "tendril-server", "client": "kube-apiserver"} {
		c, err := ca.Leaf(cn)
		if err != nil {
			return nil, err
		}
		if err := testpki.WritePair(c, f(name+".pem"), f(name+"-key.pem")); err != nil {
			return nil, err
		}
	}

	routes := fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.failover.bench.tendril.local]\n  apiserver: \"127.0.0.1:1\"\n  vpnServer: [%s, %s]\n  vpnReplicas:\n    tendril-server-0: %s\n    tendril-server-1: %s\n",
		nsTendril, rig.replicaAddr(0, replicaTunnelPort), rig.replicaAddr(1, replicaTunnelPort), rig.replicaAddr(0, replicaTunnelPort), rig.replicaAddr(1, replicaTunnelPort))
	var proxyAddr string
	rig.front, proxyAddr, _, err = r.startFront(ctx, rig.dir, routes, "--proxy-address")
	if err != nil {
		return rig, err
	}

	keys, err := writeKeys(rig.dir)
	if err != nil {
		return rig, err
	}
	rig.agentPub = keys.agentPub
	for i := range 2 {
		rig.serverArgs[i] = append(netns.Exec(r.topo.nodeNS[i]), r.bin("tendril-server"),
			"--private-key-file", keys.serverKey, "--agent-public-key", strings.Join(keys.agentPub[:], ","),
			"--shoot-cidrs", r.topo.podNet.String(), "--tunnel-address", rig.replicaAddr(i, replicaTunnelPort),
			"--connect-address", "", "--grpc-address", rig.replicaAddr(i, replicaGRPCPort),
			"--tls-cert-file", f("server.pem"), "--tls-key-file", f("server-key.pem"), "--client-ca-file", f("ca.pem"),
			"--metrics-address", rig.replicaAddr(i, replicaMetricsPort))
		if err := rig.startServer(i); err != nil {
			return rig, err
		}
	}
	dests := wire.TendrilServerReplicaWireName(nsTendril, "tendril-server-0") + "," + wire.TendrilServerReplicaWireName(nsTendril, "tendril-server-1")
	for i := range 2 {
		args := r.agentArgs(keys, i, "--seed", proxyAddr, "--header", wire.GardenerDestinationHeader, "--destination", dests)
		if rig.agents[i], err = startProc(fmt.Sprintf("tendril-agent-%d", i), f(fmt.Sprintf("tendril-agent-%d.log", i)), args); err != nil {
			return rig, err
		}
	}

	socks, err := peers.Bind(1)
	if err != nil {
		return rig, err
	}
	rig.sock, rig.relayMetr = f("relay.sock"), socks[0].Addr
	rig.relay, err = peers.StartWithSockets("tendril-egress-relay", f("tendril-egress-relay.log"), socks, r.bin("tendril-egress-relay"),
		"--connect-socket", rig.sock, "--server", rig.replicaAddr(0, replicaGRPCPort)+","+rig.replicaAddr(1, replicaGRPCPort),
		"--server-name", "tendril-server", "--tls-cert-file", f("client.pem"), "--tls-key-file", f("client-key.pem"), "--ca-file", f("ca.pem"),
		"--metrics-address", rig.relayMetr)
	if err != nil {
		return rig, err
	}
	if err := waitProcs(ctx, 20*time.Second, httpOK("http://"+rig.relayMetr+"/readyz"), rig.relay); err != nil {
		return rig, fmt.Errorf("failover: tendril-egress-relay not ready: %w", err)
	}
	return rig, nil
}

// startProc starts args[0] with the rest as arguments, logging to log; it is killed at once on
// Stop.
func startProc(name, log string, args []string) (*peers.Process, error) {
	p, err := peers.StartProcess(name, log, args[0], args[1:]...)
	if err != nil {
		return nil, err
	}
	p.KillAtOnce = true
	return p, nil
}

// startServer starts replica i on its node and waits until it serves; a replica killed a moment
// ago may still hold its ports (a real replacement is a new pod with its own address), so a
// start that exits is tried again.
func (rig *replicaRig) startServer(i int) error {
	ctx := context.Background()
	return until(ctx, 10*time.Second, func() error {
		rig.starts[i]++
		p, err := startProc(fmt.Sprintf("tendril-server-%d", i),
			filepath.Join(rig.dir, fmt.Sprintf("tendril-server-%d.%d.log", i, rig.starts[i])), rig.serverArgs[i])
		if err != nil {
			return err
		}
		rig.servers[i] = p
		err = waitProcs(ctx, 5*time.Second, httpOK("http://"+rig.replicaAddr(i, replicaMetricsPort)+"/healthz"), p)
		if errors.Is(err, errExited) {
			return fmt.Errorf("tendril-server-%d: %w", i, p.Exited()) // not errExited: try again
		}
		return err
	})
}

// nodeTable is the nftables table that makes a node lost: every packet in and out is dropped.
const nodeTable = "tendril_bench_lost_node"

// loseNode makes replica i's node drop every packet, as a node that lost power or its network
// does: no connection is reset or closed, nothing answers.
func (rig *replicaRig) loseNode(i int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := netns.Cut(ctx, rig.r.topo.nodeNS[i], nodeTable); err != nil {
		return fmt.Errorf("failover: %w", err)
	}
	return nil
}

// restoreNode lets replica i's node's packets through again.
func (rig *replicaRig) restoreNode(i int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := netns.Uncut(ctx, rig.r.topo.nodeNS[i], nodeTable); err != nil {
		return fmt.Errorf("failover: %w", err)
	}
	return nil
}

func (rig *replicaRig) procs() []*peers.Process {
	ps := append([]*peers.Process{rig.relay}, rig.front...)
	ps = append(ps, rig.servers[:]...)
	return append(ps, rig.agents[:]...)
}

func (rig *replicaRig) stop() {
	for _, p := range slices.Backward(rig.procs()) {
		if p != nil {
			_ = p.Stop()
		}
	}
}

// ready waits until both replicas have both agents live and the relay has carried a tunnel on
// each replica since the last loss: else a loss could find the relay already avoiding the replica
// that is lost, and measure nothing of it. It dials through the relay meanwhile (the relay's
// rotation gives each replica tunnels; a replica that failed is tried last for 10 s).
func (rig *replicaRig) ready(ctx context.Context, dial dialFunc) error {
	before, err := rig.answered()
	if err != nil {
		return err
	}
	return waitProcs(ctx, 60*time.Second, func() error {
		for i := range 2 {
			m, err := get("http://" + rig.replicaAddr(i, replicaMetricsPort) + "/metrics")
			if err != nil {
				return err
			}
			states := seedserver.AgentStates(m)
			for j, key := range rig.agentPub {
				if !states[key].Live {
					return fmt.Errorf("agent %d not live at replica %d", j, i)
				}
			}
		}
		dctx, cancel := context.WithTimeout(ctx, dialTimeout)
		err := dial(dctx)
		cancel()
		if err != nil {
			return fmt.Errorf("a dial through the relay: %w", err)
		}
		now, err := rig.answered()
		if err != nil {
			return err
		}
		for i := range 2 {
			s := rig.replicaAddr(i, replicaGRPCPort)
			if now[s] <= before[s] {
				return fmt.Errorf("the relay has carried no tunnel on replica %d since the last loss", i)
			}
		}
		return nil
	}, rig.procs()...)
}

// failovers reads the relay's count of tunnels carried by another server than the first tried.
func (rig *replicaRig) failovers() (float64, error) {
	fams, err := rig.relayMetrics()
	if err != nil {
		return 0, err
	}
	var n float64
	for _, mt := range fams["tendril_egress_relay_server_failovers_total"].GetMetric() {
		n += mt.GetCounter().GetValue()
	}
	return n, nil
}

func (rig *replicaRig) relayMetrics() (map[string]*dto.MetricFamily, error) {
	m, err := get("http://" + rig.relayMetr + "/metrics")
	if err != nil {
		return nil, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(strings.NewReader(m))
	if err != nil {
		return nil, fmt.Errorf("the relay's metrics: %w", err)
	}
	return families, nil
}

// answered reads the relay's count of tunnels each server carried.
func (rig *replicaRig) answered() (map[string]float64, error) {
	families, err := rig.relayMetrics()
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	if fam, ok := families["tendril_egress_relay_server_attempts_total"]; ok {
		for _, mt := range fam.GetMetric() {
			var server, outcome string
			for _, l := range mt.GetLabel() {
				switch l.GetName() {
				case "server":
					server = l.GetValue()
				case "outcome":
					outcome = l.GetValue()
				}
			}
			if outcome == "answered" {
				out[server] = mt.GetCounter().GetValue()
			}
		}
	}
	return out, nil
}

// addServerNodes makes n namespaces for tendril-server replicas ("nodes"), each linked to the
// seed (this process's namespace):
//
//	seed  veth 10.238.N.{1,5}/30 ⇄ 10.238.N.{2,6}/30  nodeX
func (t *topology) addServerNodes(ctx context.Context, n int) error {
	id := t.run.ID()
	for i := range n {
		ns := t.run.NS(fmt.Sprintf("node%d", i))
		seedEnd := t.run.Addr(238, byte(4*i+1))
		own := seedEnd.Next()
		t.nodeNS = append(t.nodeNS, ns)
		if err := linkNS(ctx, ns, "", fmt.Sprintf("tfkn%d%s", i, id), fmt.Sprintf("tfk%d%s", i, id), own, seedEnd); err != nil {
			return err
		}
		t.nodeAddr = append(t.nodeAddr, own)
	}
	return nil
}
