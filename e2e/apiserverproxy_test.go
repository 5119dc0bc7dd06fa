package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// node is a network namespace standing in for a shoot node, joined to the host (the seed) by a
// veth pair.
type node struct {
	ns, hostIP string
}

func ip(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func newNode(t *testing.T, i int) node {
	t.Helper()
	id := fmt.Sprintf("%d%c", os.Getpid()%100000, 'a'+i)
	n := node{ns: "tnd-" + id, hostIP: fmt.Sprintf("10.213.%d.1", i+1)}
	hostIf, nodeIf := "tvh"+id, "tvn"+id
	ip(t, "netns", "add", n.ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", n.ns).Run() })
	ip(t, "link", "add", hostIf, "type", "veth", "peer", "name", nodeIf)
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", hostIf).Run() })
	ip(t, "link", "set", nodeIf, "netns", n.ns)
	ip(t, "addr", "add", n.hostIP+"/30", "dev", hostIf)
	ip(t, "link", "set", hostIf, "up")
	ip(t, "-n", n.ns, "addr", "add", fmt.Sprintf("10.213.%d.2/30", i+1), "dev", nodeIf)
	ip(t, "-n", n.ns, "link", "set", nodeIf, "up")
	ip(t, "-n", n.ns, "link", "set", "lo", "up")
	ip(t, "-n", n.ns, "route", "add", "default", "via", n.hostIP)
	return n
}

// TestAPIServerProxyAcrossNamespaces runs the node agent in two "shoot node" namespaces, one
// per announcement mode, on a dummy link it creates; a "pod" in each namespace dials
// kube-apiserver's advertised address on 443 and completes TLS with its own shoot's upstream
// through the seed ingress. An advertised address without a route is closed.
func TestAPIServerProxyAcrossNamespaces(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces, veth pairs and dummy links (run make test as root, as CI does)")
	}
	for _, bin := range []string{"ip", "openssl"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not on PATH (Debian packages iproute2, openssl; see .ci/run)", bin)
		}
	}
	ca, err := testpki.NewCA("e2e CA")
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	alpha, beta := upstream(t, ca, "api.alpha.e2e.test"), upstream(t, ca, "api.beta.e2e.test")
	routes := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(routes, []byte(fmt.Sprintf(`shoots:
- name: shoot--e2e--alpha
  hosts: [api.alpha.e2e.test]
  apiserver: %s
  advertisedAddress: 240.0.0.1
- name: shoot--e2e--beta
  hosts: [api.beta.e2e.test]
  apiserver: %s
  advertisedAddress: 240.0.0.2
`, alpha, beta)), 0o644); err != nil {
		t.Fatal(err)
	}
	nodes := []node{newNode(t, 0), newNode(t, 1)}

	proxyAddr := bindAddr(t, "0.0.0.0:0") // the nodes reach it on their host addresses
	_, port, _ := net.SplitHostPort(proxyAddr)
	xdsAddr, ingressMetrics := loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", "", "--proxy-protocol"}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{proxyAddr, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--proxy-address", proxyAddr, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })

	inNode := func(n node, bin string, args ...string) []string {
		return append([]string{"netns", "exec", n.ns, bin}, args...)
	}
	// The agent creates a dummy link; a kernel without the dummy driver cannot, and the agent
	// then holds the address on an existing link (lo), which exercises the same netlink path.
	link, link9 := "tendril-api", "tendril-api9"
	if out, err := exec.Command("ip", "-n", nodes[0].ns, "link", "add", "tprobe", "type", "dummy").CombinedOutput(); err != nil {
		t.Logf("no dummy links on this kernel (%s): the agents use lo", strings.TrimSpace(string(out)))
		link, link9 = "lo", "lo"
	} else {
		ip(t, "-n", nodes[0].ns, "link", "del", "tprobe")
	}
	agent := filepath.Join(binDir, "tendril-agent")
	startBinary(t, "agent-alpha", "ip", nil, inNode(nodes[0], agent, "apiserver-proxy", "--advertised-address", "240.0.0.1",
		"--ingress", nodes[0].hostIP+":"+port, "--interface", link, "--metrics-address", "")...)
	startBinary(t, "agent-beta", "ip", nil, inNode(nodes[1], agent, "apiserver-proxy", "--advertised-address", "240.0.0.2",
		"--ingress", nodes[1].hostIP+":"+port, "--mode", "connect", "--namespace", "shoot--e2e--beta", "--interface", link, "--metrics-address", "")...)
	// An address no shoot advertises, on a second link of the first node.
	startBinary(t, "agent-unrouted", "ip", nil, inNode(nodes[0], agent, "apiserver-proxy", "--advertised-address", "240.0.0.9",
		"--ingress", nodes[0].hostIP+":"+port, "--interface", link9, "--metrics-address", "")...)

	pod := func(n node, addr, host string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "ip", inNode(n, "openssl", "s_client", "-connect", addr, "-servername", host,
			"-CAfile", caFile, "-verify_hostname", host, "-verify_return_error", "-quiet")...).CombinedOutput()
		s := strings.TrimSpace(string(out))
		if err != nil {
			return s, fmt.Errorf("%v: %s", err, s)
		}
		return s, nil
	}
	eventually(t, "alpha's pod through proxy protocol", func() error {
		got, err := pod(nodes[0], "240.0.0.1:443", "api.alpha.e2e.test")
		if err == nil && !strings.HasSuffix(got, "api.alpha.e2e.test") {
			err = fmt.Errorf("reached %q", got)
		}
		return err
	})
	eventually(t, "beta's pod through CONNECT", func() error {
		got, err := pod(nodes[1], "240.0.0.2:443", "api.beta.e2e.test")
		if err == nil && !strings.HasSuffix(got, "api.beta.e2e.test") {
			err = fmt.Errorf("reached %q", got)
		}
		return err
	})
	out, err := exec.Command("ip", "-n", nodes[0].ns, "-o", "addr", "show", "dev", link).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "240.0.0.1/32") {
		t.Errorf("link %s does not hold the advertised address: %v\n%s", link, err, out)
	}
	eventually(t, "the unrouted agent listening", func() error {
		return exec.Command("ip", inNode(nodes[0], "bash", "-c", "exec 3<>/dev/tcp/240.0.0.9/443")...).Run()
	})
	if got, err := pod(nodes[0], "240.0.0.9:443", "api.alpha.e2e.test"); err == nil {
		t.Errorf("an advertised address without a route reached %q", got)
	}
}
