package failover

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// openvpnPort is where both OpenVPN servers listen, each in its own namespace.
const openvpnPort = 1194

// openvpn measures the peer: two OpenVPN servers (each in a seed namespace of its own, as two
// vpn-seed-server pods have their own addresses) and one client in the shoot that names both
// as remotes, in TCP mode as Gardener's vpn2 runs it. The server the client is on is killed;
// the client finds the connection reset and moves to the next remote. A dial succeeds when it
// reaches the pod through either server, as if kube-apiserver's path controller (Gardener's
// HA VPN runs one client per server on the seed side and picks a working one) switched at
// once: what is measured is the client's failover alone. The client dials the servers
// directly, not through an ingress (vpn2's http-proxy through Istio adds a CONNECT per dial).
func (r *runner) openvpn(ctx context.Context) (*Row, error) {
	o := peers.OpenVPN{}
	if err := o.Check(ctx); err != nil {
		return nil, fmt.Errorf("failover: openvpn: %w", err)
	}
	row := &Row{Kind: KindOpenVPN, Stack: o.Version(ctx), Killed: "the OpenVPN server (of two) the client is on (SIGKILL), started again after the measurement",
		Recovers: "the client (two remotes, connect-retry 1 5) finds the connection reset and connects to the other server"}
	dir := filepath.Join(r.tmp, "openvpn")
	srvArgs, clientConf, err := r.openvpnSetup(ctx, o, dir, 2, func(i int) string { return netip.AddrPortFrom(r.topo.ovpnAddr[i], openvpnPort).String() })
	if err != nil {
		return nil, err
	}
	// The second remote: the client tries them in order and moves on when one fails.
	first := fmt.Sprintf("remote %s %d\n", r.topo.ovpnAddr[0], openvpnPort)
	if !strings.Contains(clientConf, first) {
		return nil, fmt.Errorf("failover: openvpn: no %q in the client configuration", strings.TrimSpace(first))
	}
	clientConf = strings.Replace(clientConf, first, first+fmt.Sprintf("remote %s %d\n", r.topo.ovpnAddr[1], openvpnPort), 1)
	procs := &ovpnProcs{r: r, dir: dir, args: srvArgs, servers: make([]*peers.Process, 2)}
	defer procs.stop()
	for i := range 2 {
		if err := procs.startServer(ctx, i); err != nil {
			return nil, err
		}
	}
	if err := procs.startClient(o, clientConf); err != nil {
		return nil, err
	}

	// The pod through server i: a dial from server i's namespace, routed into its tun.
	via := func(i int) dialFunc {
		return func(ctx context.Context) error {
			var c net.Conn
			if err := netns.In(r.topo.ovpnNS[i], func() (err error) {
				c, err = (&net.Dialer{}).DialContext(ctx, "tcp", r.podAddr())
				return err
			}); err != nil {
				return err
			}
			defer c.Close()
			if dl, ok := ctx.Deadline(); ok {
				_ = c.SetDeadline(dl)
			}
			return readGreeting(c)
		}
	}
	// Either path: the first to reach the pod wins, the other is cancelled.
	either := func(ctx context.Context) error {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		errc := make(chan error, 2)
		for i := range 2 {
			go func() { errc <- via(i)(ctx) }()
		}
		err0 := <-errc
		if err0 == nil {
			cancel()
			<-errc
			return nil
		}
		err1 := <-errc
		if err1 == nil {
			return nil
		}
		return fmt.Errorf("via server 0 or 1: %w; %w", err0, err1)
	}

	active := -1
	for i := range r.cfg.Repetitions {
		// Which server the client is on: the one whose path reaches the pod.
		if err := waitProcs(ctx, 60*time.Second, func() error {
			for j := range 2 {
				dctx, cancel := context.WithTimeout(ctx, time.Second)
				err := via(j)(dctx)
				cancel()
				if err == nil {
					active = j
					return nil
				}
			}
			return fmt.Errorf("the client is on no server yet")
		}, procs.client, procs.servers[0], procs.servers[1]); err != nil {
			return row, fmt.Errorf("failover: openvpn: %w", err)
		}
		killed := active
		d, err := measureKill(ctx, either, func() (time.Time, error) {
			at := time.Now()
			return at, procs.servers[killed].Stop()
		})
		if err != nil {
			return row, fmt.Errorf("openvpn server kill %d: %w", i+1, err)
		}
		row.Times = append(row.Times, d)
		r.logf("openvpn server kill %d/%d: %v", i+1, r.cfg.Repetitions, d.Round(time.Millisecond))
		if err := procs.startServer(ctx, killed); err != nil {
			return row, err
		}
	}
	return row, nil
}

// ovpnProcs are the OpenVPN servers and the client of one kind, started from openvpnSetup's
// command lines and client configuration.
type ovpnProcs struct {
	r       *runner
	dir     string
	args    [][]string
	servers []*peers.Process // by server; nil until started
	client  *peers.Process
	starts  int // server starts, for a log file each
}

// startServer starts server i and waits until it is initialised.
func (p *ovpnProcs) startServer(ctx context.Context, i int) error {
	p.starts++
	log := filepath.Join(p.dir, fmt.Sprintf("openvpn-server-%d.%d.log", i, p.starts))
	s, err := peers.StartProcess(fmt.Sprintf("openvpn server %d", i), log, p.args[i][0], p.args[i][1:]...)
	if err != nil {
		return err
	}
	s.KillAtOnce = true
	p.servers[i] = s
	if err := waitProcs(ctx, 20*time.Second, peers.LogContains(log, "Initialization Sequence Completed"), s); err != nil {
		return fmt.Errorf("failover: openvpn server %d: %w", i, err)
	}
	return nil
}

// startClient writes conf and starts the client with it in the shoot's namespace.
func (p *ovpnProcs) startClient(o peers.OpenVPN, conf string) error {
	file := filepath.Join(p.dir, "openvpn-client.conf")
	if err := os.WriteFile(file, []byte(conf), 0o600); err != nil {
		return err
	}
	bin, err := o.Path()
	if err != nil {
		return err
	}
	exec := netns.Exec(p.r.topo.shootNS)
	c, err := peers.StartProcess("openvpn client", filepath.Join(p.dir, "openvpn-client.log"), exec[0], append(exec[1:], bin, "--config", file)...)
	if err != nil {
		return err
	}
	c.KillAtOnce = true
	p.client = c
	return nil
}

// stop stops what was started.
func (p *ovpnProcs) stop() {
	for _, s := range append(p.servers, p.client) {
		if s != nil {
			_ = s.Stop()
		}
	}
}

// openvpnSetup makes n OpenVPN server namespaces (once per run) and writes, under dir, each
// server's certificates and configuration: server i listens on its namespace's link to the
// shoot. It returns the servers' command lines and the client's configuration, whose remote is
// remote(0) (a second remote is the caller's to add).
func (r *runner) openvpnSetup(ctx context.Context, o peers.OpenVPN, dir string, n int, remote func(i int) string) ([][]string, string, error) {
	if err := r.topo.addOpenVPNSeeds(ctx, n); err != nil {
		return nil, "", fmt.Errorf("failover: openvpn: %w", err)
	}
	ca, err := testpki.NewCA("tendril-bench failover CA")
	if err != nil {
		return nil, "", err
	}
	id := r.topo.run.ID()
	vpnNet := netip.PrefixFrom(r.topo.run.Addr(234, 0), 24)
	var srvArgs [][]string
	var clientConf string
	for i := range n {
		d := filepath.Join(dir, strconv.Itoa(i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, "", err
		}
		if err := ca.WriteCA(filepath.Join(d, "ca.pem")); err != nil {
			return nil, "", err
		}
		for _, name := range []string{"server", "client"} {
			c, err := ca.Leaf("openvpn-" + name)
			if err != nil {
				return nil, "", err
			}
			if err := testpki.WritePair(c, filepath.Join(d, name+".pem"), filepath.Join(d, name+"-key.pem")); err != nil {
				return nil, "", err
			}
		}
		listen := netip.AddrPortFrom(r.topo.ovpnAddr[i], openvpnPort).String()
		cfg := peers.OpenVPNConfig{Dir: d, Listen: listen, Remote: remote(i), Network: vpnNet, ShootCIDRs: []netip.Prefix{r.topo.podNet},
			ServerDev: "tbfs" + id, ClientDev: "tbfc" + id, ClientName: "openvpn-client"}
		s, _, err := o.WriteOpenVPN(cfg)
		if err != nil {
			return nil, "", err
		}
		srvArgs = append(srvArgs, append(netns.Exec(r.topo.ovpnNS[i]), s...))
		if i == 0 {
			if clientConf, err = peers.RenderOpenVPNClient(cfg); err != nil {
				return nil, "", err
			}
		}
	}
	return srvArgs, clientConf, nil
}
