package failover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/tendril-net/tendril/bench/peers"
	"github.com/tendril-net/tendril/internal/host/inherit"
	"github.com/tendril-net/tendril/internal/host/netns"
	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// konnectivityCarrier is the carrier kind on konnectivity: proxy-server in http-connect mode on
// a Unix socket (beside kube-apiserver, as Gardener runs it) and proxy-agent in the shoot, whose
// gRPC connection to the server's agent port goes through a proxy that cuts it. Every
// connection rides the agent's one stream, so when it breaks the server closes them: konnectivity
// documents it, and the row counts them broken.
func (r *runner) konnectivityCarrier(ctx context.Context) ([]Row, error) {
	k := peers.Konnectivity{}
	if err := k.Check(ctx); err != nil {
		return nil, fmt.Errorf("failover: konnectivity: %w", err)
	}
	row := Row{Kind: KindCarrier, Stack: k.Version(), Killed: fmt.Sprintf("proxy-agent's connection to proxy-server cut (%d connections held through it)", heldStreams),
		Recovers: "proxy-agent dials again; the connections it carried are gone"}
	dir := filepath.Join(r.tmp, "konnectivity")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := k.EnsureBuilt(ctx, filepath.Join(dir, "build.log"), r.logf); err != nil {
		return nil, fmt.Errorf("failover: %w", err)
	}
	f := func(n string) string { return filepath.Join(dir, n) }
	ca, err := testpki.NewCA("tendril-bench failover konnectivity CA")
	if err != nil {
		return nil, err
	}
	var errs []error
	errs = append(errs, ca.WriteCA(f("ca.pem")))
	for name, host := range map[string]string{"cluster": r.topo.seedAddr.String(), "agent": "proxy-agent"} {
		c, err := ca.Leaf(host)
		if err == nil {
			err = testpki.WritePair(c, f(name+".pem"), f(name+"-key.pem"))
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	socks, err := peers.Bind(3)
	if err != nil {
		return nil, err
	}
	// proxy-server binds its ports itself: free the reserved ones just before it starts.
	agentPort, admin, health := socks[0].Addr, socks[1].Addr, socks[2].Addr
	sock := f("konnectivity.sock")
	argv, err := k.ServerArgs(peers.KonnectivityServerConfig{Mode: "http-connect", UDS: sock, AgentListen: agentPort,
		ClusterCert: f("cluster.pem"), ClusterKey: f("cluster-key.pem"), Admin: admin, Health: health})
	if err != nil {
		inherit.Close(socks...)
		return nil, err
	}
	inherit.Close(socks...)
	srv, err := peers.StartProcess("proxy-server", f("proxy-server.log"), argv[0], argv[1:]...)
	if err != nil {
		return nil, err
	}
	defer srv.Stop()
	if err := waitProcs(ctx, 20*time.Second, httpOK("http://"+health+"/healthz"), srv); err != nil {
		return nil, fmt.Errorf("failover: proxy-server: %w", err)
	}
	_, agentPortNum, _ := net.SplitHostPort(agentPort)
	cutter, err := newForwarder(net.JoinHostPort(r.topo.seedAddr.String(), "0"), []string{net.JoinHostPort("127.0.0.1", agentPortNum)})
	if err != nil {
		return nil, err
	}
	defer cutter.Close()
	aargs, err := k.AgentArgs(peers.KonnectivityAgentConfig{Server: cutter.l.Addr().String(), CA: f("ca.pem"), Cert: f("agent.pem"), Key: f("agent-key.pem"),
		AgentID: "bench-agent", Admin: "127.0.0.1:8094", Health: "127.0.0.1:8093"})
	if err != nil {
		return nil, err
	}
	exec := netns.Exec(r.topo.shootNS)
	agent, err := peers.StartProcess("proxy-agent", f("proxy-agent.log"), exec[0], append(exec[1:], aargs...)...)
	if err != nil {
		return nil, err
	}
	agent.KillAtOnce = true // proxy-agent ignores SIGTERM
	defer agent.Stop()
	dial := func(ctx context.Context) (net.Conn, error) { return connectStream(ctx, sock, r.podEchoAddr()) }
	if err := waitTunnel(ctx, dial, srv, agent); err != nil {
		return []Row{row}, fmt.Errorf("failover: konnectivity: %w", err)
	}
	return r.peerCuts(ctx, row, dial, func() error { cutter.conns.Reset(); return nil })
}
