package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/machine"
	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/host/reserve"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// stack is one data path: its seed-side processes, its shoot-side agent,
// and how the client dials the pod through it.
type stack struct {
	name    string
	targets []string // the run's targets this stack serves
	path    string   // for the report
	// check says why the stack cannot run here.
	check func(ctx context.Context) error
	// version describes what runs.
	version func(ctx context.Context) string
	// startServer starts the seed side and returns once it serves; it
	// sets dial (and probe) for the targets.
	startServer func(ctx context.Context, dir string) error
	// startAgent starts the shoot side.
	startAgent func(dir string) (*peers.Process, error)
	// probe is a cheap dial through the tunnel, for the up time, tried
	// every probeEvery; nil when there is no tunnel (direct).
	probe        dialFunc
	probeEvery   time.Duration
	probeTimeout time.Duration
	probeVia     string // what the probe dials, for the report
	dial         map[string]dialFunc
	servers      []*peers.Process // the seed side; servers[0] is the one whose memory is reported
	agent        *peers.Process
	// viaIngress: the agent dials out through the seed ingress, whose processes are then
	// part of the data path's CPU.
	viaIngress bool
	// innerTCP and agentInnerTCP read tendril-server's and tendril-agent's inner TCP counters
	// (innerTCPCounters, agentInnerTCPCounters); nil for the peers.
	innerTCP, agentInnerTCP func(ctx context.Context) (InnerTCP, bool, error)
	config                  string
	// closers stop what the stack runs inside this process (the TLS relays).
	closers []io.Closer
}

// cpu returns a function summing the CPU time of the stack's own processes (seed side, shoot
// side, the ingress if it dials through it), or nil if it has none (direct). Processes that
// have exited count as nothing: a measurement's difference stays exact while they run.
func (s *stack) cpu(in *ingress) func() time.Duration {
	procs := slices.Clone(s.servers)
	if s.agent != nil {
		procs = append(procs, s.agent)
	}
	if s.viaIngress && in != nil {
		procs = append(procs, in.procs...)
	}
	if len(procs) == 0 {
		return nil
	}
	pids := make([]int, len(procs))
	for i, p := range procs {
		pids[i] = p.PID()
	}
	return func() time.Duration { return machine.ProcessesCPU(pids) }
}

func (s *stack) stop() {
	if s.agent != nil {
		_ = s.agent.Stop()
		s.agent = nil
	}
	for _, p := range slices.Backward(s.servers) {
		_ = p.Stop()
	}
	s.servers = nil
	for _, c := range s.closers {
		_ = c.Close()
	}
	s.closers = nil
}

// startAttempts is how often a stack's servers start when a port was taken.
const startAttempts = 3

// ports are allocated before the ingress starts: its route file names the
// tunnel servers' ports.
type ports struct {
	tendrilTunnel, openvpn int
}

// Shoot names in the ingress's routes (namespaces in a seed).
const (
	nsTendril = "shoot--bench--tendril"
	nsOpenVPN = "shoot--bench--openvpn"
)

// stacks returns the stacks of the run's targets, in report order.
func (r *runner) stacks() []*stack {
	want := func(names ...string) []string {
		var ts []string
		for _, n := range names {
			if slices.Contains(r.cfg.Targets, n) {
				ts = append(ts, n)
			}
		}
		return ts
	}
	var out []*stack
	add := func(s *stack, names ...string) {
		if s.targets = want(names...); len(s.targets) > 0 {
			out = append(out, s)
		}
	}
	add(r.directStack(), TargetDirect)
	add(r.tlsRelayStack(), TargetTLSRelay)
	add(r.tendrilStack(false), TargetTendrilConnect, TargetTendrilGRPC, TargetTendrilRelay, TargetTendrilRelayConnect)
	add(r.tendrilStack(true), TargetTendrilTUN, TargetTendrilTUNRelay)
	add(r.openvpnStack(), TargetOpenVPN)
	add(r.konnectivityStack("grpc", TargetKonnectivityGRPC, false), TargetKonnectivityGRPC)
	add(r.konnectivityStack("http-connect", TargetKonnectivityConnect, false), TargetKonnectivityConnect)
	add(r.konnectivityStack("grpc", TargetKonnectivityUDS, true), TargetKonnectivityUDS)
	add(r.konnectivityStack("http-connect", TargetKonnectivityConnectUDS, true), TargetKonnectivityConnectUDS)
	return out
}

func (r *runner) podTarget() string {
	return netip.AddrPortFrom(r.topo.podAddr, uint16(r.pod.port())).String()
}

func (r *runner) directStack() *stack {
	s := &stack{name: TargetDirect, path: "client → pod over its own veth, no tunnel"}
	s.check = func(context.Context) error { return nil }
	s.version = func(context.Context) string { return "kernel TCP over one veth" }
	s.startServer = func(context.Context, string) error {
		s.dial = map[string]dialFunc{TargetDirect: tcpDialer(netip.AddrPortFrom(r.topo.directIP, uint16(r.pod.port())).String())}
		return nil
	}
	return s
}

func (r *runner) bin(name string) string {
	p, _ := filepath.Abs(filepath.Join(r.cfg.BinDir, name))
	return p
}

// reservePorts reserves a port on each of hosts for a peer that binds it itself (internal/host/reserve),
// and returns the addresses; the reservations go to closers, closed when the stack stops.
func reservePorts(closers *[]io.Closer, hosts ...netip.Addr) ([]string, error) {
	var addrs []string
	for _, h := range hosts {
		p, err := reserve.TCP(h.String())
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, p)
		addrs = append(addrs, p.Addr)
	}
	return addrs, nil
}

// port is the port of host:port a (one this process bound).
func port(a string) int { return int(netip.MustParseAddrPort(a).Port()) }

func addr(a netip.Addr, port int) string { return netip.AddrPortFrom(a, uint16(port)).String() }

// ingress is the seed ingress: tendril-seed serving a route file with the
// tunnel servers of tendril and OpenVPN, tendril-ingress's Reversed-VPN
// CONNECT listener on the seed's side of the shoot link.
type ingress struct {
	procs  []*peers.Process
	listen string // seed address:port, where the shoot's agents dial
	ports  ports
	// tunnel is tendril-server's tunnel socket, which the route file names: bound with the
	// ingress and held until a server inherits it (tunnelSocket).
	tunnel *inherit.Socket
	// routeFile is tendril-seed's, which routes names the servers in.
	routeFile string
	// openvpnPort holds OpenVPN's server port (it cannot inherit a socket) while the ingress runs.
	openvpnPort *reserve.Port
}

// routes is the route file for the current ports.
func (in *ingress) routes() string {
	return fmt.Sprintf("shoots:\n"+
		"- name: %s\n  hosts: [api.tendril.tunnel.bench.tendril.local]\n  apiserver: \"127.0.0.1:1\"\n  vpnServer: \"127.0.0.1:%d\"\n"+
		"- name: %s\n  hosts: [api.openvpn.tunnel.bench.tendril.local]\n  apiserver: \"127.0.0.1:1\"\n  vpnServer: \"127.0.0.1:%d\"\n",
		nsTendril, in.ports.tendrilTunnel, nsOpenVPN, in.ports.openvpn)
}

// connectStatus is the status the ingress answers to a Reversed-VPN CONNECT for shoot ns.
func (in *ingress) connectStatus(ns string) (string, error) {
	c, err := net.DialTimeout("tcp", in.listen, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: x\r\nReversed-VPN: %s\r\n\r\n", "127.0.0.1:1194", translate.TendrilServerWireName(ns))
	buf := make([]byte, 12)
	if _, err := io.ReadFull(c, buf); err != nil {
		return "", err
	}
	return string(buf[9:12]), nil
}

// moveOpenVPN gives OpenVPN's server a new port, after its old one was taken by another process:
// the route file names it, and it returns once the ingress routes there. The new port is held
// listening meanwhile (a CONNECT to it gets 200, to the old one 502) and released for OpenVPN to
// bind, which cannot inherit it.
func (in *ingress) moveOpenVPN(ctx context.Context) error {
	next, err := reserve.TCP("127.0.0.1")
	if err != nil {
		return err
	}
	in.openvpnPort.Close()
	in.openvpnPort = next
	// Listening on the reserved port, beside the reservation, until the route is there.
	hold, err := net.Listen("tcp", next.Addr)
	if err != nil {
		return err
	}
	defer hold.Close()
	in.ports.openvpn = port(next.Addr)
	if err := writeFileAtomic(in.routeFile, in.routes()); err != nil {
		return err
	}
	return waitFor(ctx, 20*time.Second, func() error {
		st, err := in.connectStatus(nsOpenVPN)
		if err == nil && st != "200" {
			err = fmt.Errorf("ingress answered %s", st)
		}
		return err
	}, in.procs...)
}

// writeFileAtomic replaces path with content in one rename, so a reader never sees half of it.
func writeFileAtomic(path, content string) error {
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path)
}

// tunnelSocket is the socket of tendril-server's tunnel address for a server about to start:
// the one bound with the ingress, or, once a server had it and has stopped, the same address
// bound again (its port is free again once that process has exited).
func (in *ingress) tunnelSocket(ctx context.Context) (*inherit.Socket, error) {
	if s := in.tunnel; s != nil {
		in.tunnel = nil
		return s, nil
	}
	addr := "127.0.0.1:" + strconv.Itoa(in.ports.tendrilTunnel)
	var s *inherit.Socket
	err := waitFor(ctx, 10*time.Second, func() (err error) {
		s, err = inherit.Bind(addr)
		return err
	})
	return s, err
}

func (in *ingress) stop() {
	for _, p := range slices.Backward(in.procs) {
		_ = p.Stop()
	}
	if in.tunnel != nil {
		in.tunnel.Close()
		in.tunnel = nil
	}
	in.openvpnPort.Close()
}

// ensureIngress starts the seed ingress if it is not running, and returns
// once it routes both tunnel destinations.
func (r *runner) ensureIngress(ctx context.Context) (*ingress, error) {
	if r.ingress != nil {
		return r.ingress, nil
	}
	for _, b := range []string{"tendril-seed", "tendril-ingress"} {
		if _, err := os.Stat(r.bin(b)); err != nil {
			return nil, fmt.Errorf("%s not found (make build)", r.bin(b))
		}
	}
	dir := filepath.Join(r.tmp, "ingress")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// tendril's processes inherit their sockets; only OpenVPN's server binds a port picked
	// free (startOpenVPNServer retries on EADDRINUSE).
	ingressSocks, err := peers.Bind(2) // xDS, ingress metrics
	if err != nil {
		return nil, err
	}
	listenSock, err := inherit.Bind(addr(r.topo.seedAddr, 0))
	if err != nil {
		inherit.Close(ingressSocks...)
		return nil, err
	}
	tunnelSock, err := inherit.Bind("127.0.0.1:0")
	if err != nil {
		inherit.Close(append(ingressSocks, listenSock)...)
		return nil, err
	}
	openvpnPort, err := reserve.TCP("127.0.0.1")
	if err != nil {
		inherit.Close(append(ingressSocks, listenSock, tunnelSock)...)
		return nil, err
	}
	in := &ingress{listen: listenSock.Addr, ports: ports{tendrilTunnel: port(tunnelSock.Addr), openvpn: port(openvpnPort.Addr)},
		tunnel: tunnelSock, openvpnPort: openvpnPort}
	xds, metrics := ingressSocks[0].Addr, ingressSocks[1].Addr
	in.routeFile = filepath.Join(dir, "routes.yaml")
	routeFile := in.routeFile
	if err := os.WriteFile(routeFile, []byte(in.routes()), 0o644); err != nil {
		inherit.Close(append(ingressSocks, listenSock)...)
		in.stop()
		return nil, err
	}
	seed, err := peers.StartWithSockets("tendril-seed", filepath.Join(dir, "tendril-seed.log"), ingressSocks[:1],
		r.bin("tendril-seed"), "--routes", routeFile, "--xds-address", xds, "--xds-insecure", "--metrics-address", "")
	if err != nil {
		inherit.Close(ingressSocks[1], listenSock)
		in.stop()
		return nil, err
	}
	in.procs = append(in.procs, seed)
	ing, err := peers.StartWithSockets("tendril-ingress", filepath.Join(dir, "tendril-ingress.log"), []*inherit.Socket{listenSock, ingressSocks[1]},
		r.bin("tendril-ingress"), "--xds", xds, "--xds-insecure", "--node-id", "bench", "--tunnel-address", in.listen, "--metrics-address", metrics)
	if err != nil {
		in.stop()
		return nil, err
	}
	in.procs = append(in.procs, ing)
	// The routes are there once a CONNECT for the tendril shoot gets past
	// "no such cluster" (503) to the dial of its server, not yet running (502).
	// (200 while this process holds the tunnel socket for the server to come.)
	probe := func() error {
		st, err := in.connectStatus(nsTendril)
		if err == nil && st != "502" && st != "504" && st != "200" {
			err = fmt.Errorf("ingress answered %s", st)
		}
		return err
	}
	if err := waitFor(ctx, 20*time.Second, probe, in.procs...); err != nil {
		in.stop()
		return nil, fmt.Errorf("seed ingress does not route the tunnels: %w", err)
	}
	r.ingress = in
	return in, nil
}

// waitFor calls f every 20 ms until it succeeds, one of procs exits,
// timeout passes or ctx ends.
func waitFor(ctx context.Context, timeout time.Duration, f func() error, procs ...*peers.Process) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		for _, p := range procs {
			if err := p.Exited(); err != nil {
				return err
			}
		}
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// accepts reports whether something accepts connections on addr (network "tcp" or "unix").
func accepts(network, addr string) func() error {
	return func() error {
		c, err := net.DialTimeout(network, addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err
	}
}

func httpOK(url string) func() error {
	client := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	return func() error {
		resp, err := client.Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
}

func writeFiles(files map[string]string) error {
	for path, content := range files {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			return err
		}
	}
	return nil
}

// tendrilStack is tendril-server and its agent; with kernel, both on TUN devices (--tun), for
// the targets tendril-tun and tendril-tun-relay, else on gVisor's netstack.
func (r *runner) tendrilStack(kernel bool) *stack {
	s := &stack{name: "tendril", probeEvery: 5 * time.Millisecond, probeTimeout: time.Second,
		path: "tendril-server (seed) ⇄ tendril-ingress (Reversed-VPN CONNECT) ⇄ tendril-agent vpn (shoot): WireGuard over one framed TCP stream, gVisor netstack at both ends"}
	connectTarget, grpcTarget, relayTarget, relayConnectTarget := TargetTendrilConnect, TargetTendrilGRPC, TargetTendrilRelay, TargetTendrilRelayConnect
	var serverTUN, agentTUN []string
	if kernel {
		s.name = "tendril-tun"
		s.path = "as tendril, with both ends on TUN devices (--tun): the kernel's TCP/IP stack at both ends, the seed's TCP redirected to the agent, which dials the pod"
		connectTarget, grpcTarget, relayTarget, relayConnectTarget = TargetTendrilTUN, "", TargetTendrilTUNRelay, ""
		// The server's device is in the seed's namespace, this process's: a name of this run.
		serverTUN = []string{"--tun", "tbt" + strconv.Itoa(os.Getpid())}
		agentTUN = []string{"--tun", "tendril0"}
	}
	s.check = func(context.Context) error {
		for _, b := range []string{"tendril-seed", "tendril-ingress", "tendril-server", "tendril-agent", "tendril-egress-relay"} {
			if _, err := os.Stat(r.bin(b)); err != nil {
				return fmt.Errorf("%s not found (make build)", r.bin(b))
			}
		}
		if kernel {
			if _, err := os.Stat("/dev/net/tun"); err != nil {
				return fmt.Errorf("no TUN devices here: %w", err)
			}
		}
		return nil
	}
	s.version = func(context.Context) string {
		return strings.Replace(peers.Tendril{BinDir: r.cfg.BinDir}.Version(), "tendril-ingress", "tendril", 1)
	}
	var agentArgs []string
	s.startServer = func(ctx context.Context, dir string) error {
		in, err := r.ensureIngress(ctx)
		s.viaIngress = true
		if err != nil {
			return err
		}
		serverKey, err1 := wg.GenerateKey()
		agentKey, err2 := wg.GenerateKey()
		if err := errors.Join(err1, err2); err != nil {
			return err
		}
		f := func(n string) string { return filepath.Join(dir, n) }
		if err := writeFiles(map[string]string{f("server.key"): serverKey.String(), f("agent.key"): agentKey.String(),
			f("server.pub"): serverKey.PublicKey().String(), f("agent.pub"): agentKey.PublicKey().String()}); err != nil {
			return err
		}
		cert, key, err := r.pki.pair(dir, "front-end", certTendrilServer, "127.0.0.1")
		if err != nil {
			return err
		}
		socks, err := peers.Bind(3)
		if err != nil {
			return err
		}
		tunnel, err := in.tunnelSocket(ctx)
		if err != nil {
			inherit.Close(socks...)
			return fmt.Errorf("tendril-server's tunnel address: %w", err)
		}
		connectAddr, grpcAddr, metrics := socks[0].Addr, socks[1].Addr, socks[2].Addr
		sock := f("connect.sock")
		argv := []string{r.bin("tendril-server"), "--private-key-file", f("server.key"), "--agent-public-key", "@" + f("agent.pub"),
			"--shoot-cidrs", r.topo.podNet.String(), "--tunnel-address", tunnel.Addr,
			"--connect-address", connectAddr, "--grpc-address", grpcAddr, "--connect-socket", sock,
			"--tls-cert-file", cert, "--tls-key-file", key, "--client-ca-file", r.pki.caFile, "--metrics-address", metrics}
		argv = append(argv, serverTUN...)
		if r.cfg.Profiling {
			argv = append(argv, "--profiling")
		}
		srv, err := peers.StartWithSockets("tendril-server", f("tendril-server.log"), append(socks, tunnel), argv[0], argv[1:]...)
		if err != nil {
			return err
		}
		s.servers = append(s.servers, srv)
		s.config = strings.Join(argv, " ")
		s.innerTCP = innerTCPCounters("http://" + metrics + "/metrics")
		if err := waitFor(ctx, 10*time.Second, func() error {
			return errors.Join(accepts("tcp", connectAddr)(), accepts("tcp", grpcAddr)(), httpOK("http://"+metrics+"/healthz")())
		}, srv); err != nil {
			return fmt.Errorf("tendril-server: %w", err)
		}
		agentArgs = append(netns.Exec(r.topo.shootNS), r.bin("tendril-agent"), "vpn",
			"--private-key-file", f("agent.key"), "--server-public-key", "@"+f("server.pub"),
			"--shoot-cidrs", r.topo.podNet.String(), "--seed", in.listen,
			"--destination", translate.TendrilServerWireName(nsTendril), "--metrics-address", "")
		agentArgs = append(agentArgs, agentTUN...)
		s.config += "\n" + strings.Join(agentArgs, " ")
		pod := r.podTarget()
		s.probe = connectDialer("unix", sock, nil, pod)
		s.probeVia = "tendril-server's CONNECT Unix socket (no TLS), a new attempt every 5 ms"
		s.dial = map[string]dialFunc{
			connectTarget: connectDialer("tcp", connectAddr, r.pki.clientTLS(certTendrilServer), pod),
		}
		if r.cfg.Konnectivity != nil && grpcTarget != "" {
			s.dial[grpcTarget] = grpcDialer(r.cfg.Konnectivity, grpcAddr, r.pki.clientTLS(certTendrilServer), pod)
		}
		relayGRPC := r.cfg.Konnectivity != nil && slices.Contains(s.targets, relayTarget)
		if relayGRPC || slices.Contains(s.targets, relayConnectTarget) {
			// kube-apiserver's pod with egress grpc: the relay beside it on a Unix socket, one
			// long-lived mutual-TLS connection to tendril-server for every tunnel.
			rc, rk, err := r.pki.pair(dir, "relay-client", certAPIServer)
			if err != nil {
				return err
			}
			relaySock, relayConnectSock := f("relay.sock"), f("relay-connect.sock")
			rsocks, err := peers.Bind(1)
			if err != nil {
				return err
			}
			// Metrics (and with Profiling the profiler) on loopback, as tendril-server's: for
			// looking into a run.
			rargv := []string{r.bin("tendril-egress-relay"), "--socket", relaySock, "--connect-socket", relayConnectSock, "--server", grpcAddr,
				"--server-name", certTendrilServer, "--tls-cert-file", rc, "--tls-key-file", rk, "--ca-file", r.pki.caFile,
				"--metrics-address", rsocks[0].Addr}
			if r.cfg.Profiling {
				rargv = append(rargv, "--profiling")
			}
			rel, err := peers.StartWithSockets("tendril-egress-relay", f("tendril-egress-relay.log"), rsocks, rargv[0], rargv[1:]...)
			if err != nil {
				return err
			}
			s.servers = append(s.servers, rel)
			s.config += "\n" + strings.Join(rargv, " ")
			if err := waitFor(ctx, 10*time.Second, accepts("unix", relaySock), rel); err != nil {
				return fmt.Errorf("tendril-egress-relay: %w", err)
			}
			if relayGRPC {
				s.dial[relayTarget] = grpcDialer(r.cfg.Konnectivity, "unix://"+relaySock, nil, pod)
			}
			if relayConnectTarget != "" {
				s.dial[relayConnectTarget] = connectDialer("unix", relayConnectSock, nil, pod)
			}
		}
		return nil
	}
	// The agent's metrics, in the shoot's namespace: a socket bound there for each start.
	var agentMetrics string
	s.agentInnerTCP = agentInnerTCPCounters(r.topo.shootNS, &agentMetrics)
	s.startAgent = func(dir string) (*peers.Process, error) {
		var sock *inherit.Socket
		if err := netns.In(r.topo.shootNS, func() (err error) {
			sock, err = inherit.Bind("127.0.0.1:0")
			return err
		}); err != nil {
			return nil, fmt.Errorf("tendril-agent's metrics socket: %w", err)
		}
		agentMetrics = sock.Addr
		args := slices.Clone(agentArgs)
		if i := slices.Index(args, "--metrics-address"); i >= 0 {
			args[i+1] = sock.Addr
		}
		return peers.StartWithSockets("tendril-agent", filepath.Join(dir, "tendril-agent.log"), []*inherit.Socket{sock}, args[0], args[1:]...)
	}
	return s
}

func (r *runner) openvpnStack() *stack {
	o := peers.OpenVPN{}
	s := &stack{name: TargetOpenVPN, probeEvery: 5 * time.Millisecond, probeTimeout: 3 * time.Second,
		path: "OpenVPN server (seed, tun) ⇄ tendril-ingress (Reversed-VPN CONNECT, OpenVPN's http-proxy) ⇄ OpenVPN client (shoot, tun, kernel forwarding to the pod network)"}
	s.check = func(ctx context.Context) error {
		if err := o.Check(ctx); err != nil {
			return err
		}
		for _, b := range []string{"tendril-seed", "tendril-ingress"} {
			if _, err := os.Stat(r.bin(b)); err != nil {
				return fmt.Errorf("%s not found (make build): the OpenVPN client dials through the seed ingress", r.bin(b))
			}
		}
		return nil
	}
	s.version = o.Version
	var clientArgs []string
	var taken bool // the last start found its port taken
	s.startServer = func(ctx context.Context, dir string) (err error) {
		in, err := r.ensureIngress(ctx)
		s.viaIngress = true
		if err != nil {
			return err
		}
		defer func() { taken = err != nil && peers.AddrInUse(err) }()
		if taken {
			if err := in.moveOpenVPN(ctx); err != nil {
				return fmt.Errorf("openvpn server: a new port: %w", err)
			}
		}
		if _, _, err := r.pki.pair(dir, "server", certOpenVPNServer); err != nil {
			return err
		}
		if _, _, err := r.pki.pair(dir, "client", certOpenVPNClient); err != nil {
			return err
		}
		if err := r.pki.ca.WriteCA(filepath.Join(dir, "ca.pem")); err != nil {
			return err
		}
		id := strconv.Itoa(os.Getpid())
		listen := "127.0.0.1:" + strconv.Itoa(in.ports.openvpn)
		cfg := peers.OpenVPNConfig{Dir: dir, Listen: listen, Remote: listen, HTTPProxy: in.listen,
			ProxyHeader: "Reversed-VPN", ProxyHeaderValue: translate.TendrilServerWireName(nsOpenVPN),
			Network: r.topo.vpnNet, ShootCIDRs: []netip.Prefix{r.topo.podNet},
			ServerDev: "tbvs" + id, ClientDev: "tbvc" + id, ClientName: certOpenVPNClient}
		srvArgs, cliArgs, err := o.WriteOpenVPN(cfg)
		if err != nil {
			return err
		}
		srvCfg, _ := peers.RenderOpenVPNServer(cfg)
		cliCfg, _ := peers.RenderOpenVPNClient(cfg)
		s.config = "# server\n" + srvCfg + "\n# client\n" + cliCfg
		logPath := filepath.Join(dir, "openvpn-server.log")
		srv, err := peers.StartProcess("openvpn server", logPath, srvArgs[0], srvArgs[1:]...)
		if err != nil {
			return err
		}
		s.servers = append(s.servers, srv)
		if err := waitFor(ctx, 20*time.Second, peers.LogContains(logPath, "Initialization Sequence Completed"), srv); err != nil {
			return fmt.Errorf("openvpn server: %w", err)
		}
		clientArgs = append(netns.Exec(r.topo.shootNS), cliArgs...)
		pod := r.podTarget()
		s.probe = tcpDialer(pod)
		s.probeVia = "a TCP dial to the pod through the seed's tun, a new attempt every 5 ms"
		s.dial = map[string]dialFunc{TargetOpenVPN: tcpDialer(pod)}
		return nil
	}
	s.startAgent = func(dir string) (*peers.Process, error) {
		return peers.StartProcess("openvpn client", filepath.Join(dir, "openvpn-client.log"), clientArgs[0], clientArgs[1:]...)
	}
	return s
}

// konnectivityStack is proxy-server and proxy-agent in mode; with uds, kube-apiserver's side is a
// Unix socket without TLS (proxy-server as kube-apiserver's sidecar), else mutual TLS over TCP.
func (r *runner) konnectivityStack(mode, target string, uds bool) *stack {
	k := peers.Konnectivity{CacheDir: r.cfg.CacheDir}
	front := "--mode " + mode
	if uds {
		front += " --uds-name (beside kube-apiserver: its side a Unix socket, no TLS)"
	}
	s := &stack{name: target, probeEvery: 20 * time.Millisecond, probeTimeout: 2 * time.Second,
		path: "konnectivity proxy-server " + front + " (seed) ⇄ proxy-agent (shoot) dialing the server's agent port directly: one gRPC stream carries every connection"}
	s.check = func(ctx context.Context) error {
		if mode == "grpc" && r.cfg.Konnectivity == nil {
			return errors.New("no konnectivity client linked (tendril-bench supplies konnectivity-client)")
		}
		if r.cfg.NoBuild && !k.Built() {
			dir, _ := k.Dir()
			return fmt.Errorf("not built in %s (run without --no-build once to build it)", dir)
		}
		return k.Check(ctx)
	}
	s.version = func(context.Context) string { return k.Version() }
	var agentArgs []string
	s.startServer = func(ctx context.Context, dir string) error {
		if err := k.EnsureBuilt(ctx, filepath.Join(dir, "build.log"), r.logf); err != nil {
			return err
		}
		loop := netip.MustParseAddr("127.0.0.1")
		p, err := reservePorts(&s.closers, loop, r.topo.seedAddr, loop, loop)
		if err != nil {
			return err
		}
		front, agentPort, admin, health := p[0], p[1], p[2], p[3]
		fc, fk, err1 := r.pki.pair(dir, "front-end", certKonnServer, "127.0.0.1")
		cc, ck, err2 := r.pki.pair(dir, "cluster", certKonnServer, r.topo.seedAddr.String())
		ac, ak, err3 := r.pki.pair(dir, "agent", certKonnAgent)
		if err := errors.Join(err1, err2, err3); err != nil {
			return err
		}
		sc := peers.KonnectivityServerConfig{Mode: mode, Frontend: front,
			ServerCert: fc, ServerKey: fk, ServerCA: r.pki.caFile, AgentListen: agentPort, ClusterCert: cc, ClusterKey: ck,
			Admin: admin, Health: health}
		serving := accepts("tcp", front)
		if uds {
			sc.UDS = filepath.Join(dir, "konnectivity.sock")
			serving = accepts("unix", sc.UDS)
		}
		argv, err := k.ServerArgs(sc)
		if err != nil {
			return err
		}
		srv, err := peers.StartProcess("proxy-server", filepath.Join(dir, "proxy-server.log"), argv[0], argv[1:]...)
		if err != nil {
			return err
		}
		s.servers = append(s.servers, srv)
		s.config = strings.Join(argv, " ")
		if err := waitFor(ctx, 20*time.Second, func() error {
			return errors.Join(serving(), httpOK("http://"+health+"/healthz")())
		}, srv); err != nil {
			return fmt.Errorf("proxy-server: %w", err)
		}
		aargs, err := k.AgentArgs(peers.KonnectivityAgentConfig{Server: agentPort, CA: r.pki.caFile, Cert: ac, Key: ak,
			AgentID: "bench-agent", Admin: "127.0.0.1:8094", Health: "127.0.0.1:8093"})
		if err != nil {
			return err
		}
		agentArgs = append(netns.Exec(r.topo.shootNS), aargs...)
		s.config += "\n" + strings.Join(agentArgs, " ")
		pod := r.podTarget()
		tlsCfg := r.pki.clientTLS(certKonnServer)
		var d dialFunc
		s.probeVia = "the " + mode + " front-end over mutual TLS (a dial fails at once while no agent is connected), every 20 ms"
		switch {
		case uds && mode == "http-connect":
			d = connectDialer("unix", sc.UDS, nil, pod)
			s.probeVia = "the " + mode + " front-end on its Unix socket (a dial fails at once while no agent is connected), every 20 ms"
		case uds:
			d = grpcDialer(r.cfg.Konnectivity, "unix://"+sc.UDS, nil, pod)
			s.probeVia = "the " + mode + " front-end on its Unix socket (a dial fails at once while no agent is connected), every 20 ms"
		case mode == "grpc":
			d = grpcDialer(r.cfg.Konnectivity, front, tlsCfg, pod)
		default:
			d = connectDialer("tcp", front, tlsCfg, pod)
		}
		s.probe, s.dial = d, map[string]dialFunc{target: d}
		return nil
	}
	s.startAgent = func(dir string) (*peers.Process, error) {
		p, err := peers.StartProcess("proxy-agent", filepath.Join(dir, "proxy-agent.log"), agentArgs[0], agentArgs[1:]...)
		if p != nil {
			p.KillAtOnce = true // proxy-agent ignores SIGTERM
		}
		return p, err
	}
	return s
}
