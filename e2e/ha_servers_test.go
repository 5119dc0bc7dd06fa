package e2e

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/wire"
	"github.com/tendril-net/tendril/xds/translate"
)

// TestHAServersThroughIngress: an HA shoot's two tendril-server replicas (one key, as the
// extension's StatefulSet runs them) behind tendril-ingress's unified port, routed by their pod
// names from the route file's vpnReplicas; two agents, each given both replicas as destinations.
// Both servers see both agents and reach the pod; then replica 0 is SIGKILLed while a dial loop
// and a long transfer run through replica 1: no dial through replica 1 fails and the transfer
// carries on unbroken and correct, and replica 1 still has both agents. All shipped binaries.
func TestHAServersThroughIngress(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatal("ip is not on PATH (Debian package iproute2; see .ci/run)")
	}
	dir := t.TempDir()
	const pod = "10.226.0.2:8080"
	shoot, podNS := shootNetworks(t, "hs", "10.225.0", "10.226.0")
	startPatternPod(t, podNS, pod)

	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	serverKey, _ := wg.GenerateKey()
	serverPub := write("server.pub", serverKey.PublicKey().String())
	serverKeyFile := write("server.key", serverKey.String())
	ca, caFile, apiCert := shootPKI(t, dir)
	const ns = "shoot--e2e--hs"
	var agentKeys [2]wg.Key
	var agentPubs []string
	for i := range agentKeys {
		agentKeys[i], _ = wg.GenerateKey()
		agentPubs = append(agentPubs, agentKeys[i].PublicKey().String())
	}

	// Two replicas: the same arguments but their addresses.
	type replica struct {
		tunnel, connect, metrics string
		proc                     *exec.Cmd
		rig                      *haRig // kube-apiserver's egress to the pod through this replica
	}
	var reps [2]*replica
	replicasYAML := ""
	for i := range reps {
		r := &replica{tunnel: loopbackAddr(t), connect: loopbackAddr(t), metrics: loopbackAddr(t)}
		r.rig = &haRig{t: t, pod: pod, connectAddr: r.connect, tlsConf: &tls.Config{Certificates: []tls.Certificate{apiCert}, RootCAs: ca.Pool, ServerName: "tendril-server"}}
		reps[i] = r
		replicasYAML += fmt.Sprintf("    tendril-server-%d: %s\n", i, r.tunnel)
	}
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.hs.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: [%s, %s]\n  vpnReplicas:\n%s",
		ns, reps[0].tunnel, reps[1].tunnel, replicasYAML))
	proxyAddr := bindAddr(t, "10.225.0.1:0") // the shoot's side of its veth reaches it
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{proxyAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e-hs",
		"--proxy-address", proxyAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	for i, r := range reps {
		args := []string{"--private-key-file", serverKeyFile, "--agent-public-key", strings.Join(agentPubs, ","),
			"--shoot-cidrs", "10.226.0.0/24", "--tunnel-address", r.tunnel, "--connect-address", r.connect, "--grpc-address", "",
			"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
			"--metrics-address", r.metrics}
		r.proc = startKillable(t, fmt.Sprintf("tendril-server-%d", i), filepath.Join(binDir, "tendril-server"), []string{r.tunnel, r.connect, r.metrics}, args...)
	}
	dests := translate.TendrilServerReplicaWireName(ns, "tendril-server-0") + "," + translate.TendrilServerReplicaWireName(ns, "tendril-server-1")
	for i, k := range agentKeys {
		startBinary(t, fmt.Sprintf("tendril-agent-%d", i), "ip", nil, "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
			"--private-key-file", write(fmt.Sprintf("agent%d.key", i), k.String()), "--address", fmt.Sprintf("fd8f:6d53:b97a:1::%d", 2+i),
			"--server-public-key", "@"+serverPub, "--shoot-cidrs", "10.226.0.0/24",
			"--seed", proxyAddr, "--header", wire.GardenerDestinationHeader, "--destination", dests, "--metrics-address", "")
	}

	bothAgents := func(r *replica) error {
		m, err := get("http://" + r.metrics + "/metrics")
		if err != nil {
			return err
		}
		states := seedserver.AgentStates(m)
		for i, key := range agentPubs {
			if !states[key].Live {
				return fmt.Errorf("agent %d not live at %s", i, r.connect)
			}
		}
		return nil
	}
	podThrough := func(r *replica) error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		c, br, err := r.rig.connect(ctx)
		if err != nil {
			return err
		}
		defer c.Close()
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
		line, err := br.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
			return fmt.Errorf("the pod answered %q, %v", line, err)
		}
		return nil
	}
	for i, r := range reps {
		eventually(t, fmt.Sprintf("replica %d has both agents", i), func() error { return bothAgents(r) })
		eventually(t, fmt.Sprintf("the pod through replica %d", i), func() error { return podThrough(r) })
	}

	stop := make(chan struct{})
	tr := reps[1].rig.startTransfer(stop)
	results := reps[1].rig.dialLoop(stop)
	time.Sleep(500 * time.Millisecond)
	killedAt, _ := kill(t, reps[0].proc)
	time.Sleep(2 * time.Second)
	if err := bothAgents(reps[1]); err != nil {
		t.Errorf("after replica 0's kill: %v", err)
	}
	if err := podThrough(reps[1]); err != nil {
		t.Errorf("a new dial through replica 1 after replica 0's kill: %v", err)
	}
	before := tr.verified.Load()
	time.Sleep(300 * time.Millisecond)
	if after := tr.verified.Load(); after <= before {
		t.Errorf("the transfer through replica 1 stalled after replica 0's kill (%d bytes, then %d)", before, after)
	}
	close(stop)
	if err := <-tr.done; err != nil && !isClosedByStop(err) {
		t.Errorf("the transfer through replica 1: %v", err)
	}
	if off := tr.corrupt.Load(); off > 0 {
		t.Errorf("the transfer delivered a wrong byte at offset %d", off-1)
	}
	var failed, after int
	for _, res := range results() {
		if res.start.After(killedAt) {
			after++
		}
		if !res.ok {
			failed++
			t.Logf("dial at %s (kill at %s) failed: %v", res.start.Format("15:04:05.000"), killedAt.Format("15:04:05.000"), res.err)
		}
	}
	if failed > 0 || after == 0 {
		t.Errorf("through replica 1: %d dials failed, %d started after replica 0's kill; want none failed", failed, after)
	}
	t.Logf("through replica 1 while replica 0 was killed: %d dials after the kill, none failed; the transfer verified %d bytes", after, tr.verified.Load())
}

// isClosedByStop: the transfer's connection was ended by the test's stop (a read deadline).
func isClosedByStop(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
