package e2e

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"

	"github.com/tendril-net/tendril/internal/testpki"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/xds/translate"
)

// podServeEnv makes the test binary an HTTP "pod" instead of running tests: run inside a network
// namespace with ip netns exec, it answers every request with its address.
const podServeEnv = "TENDRIL_E2E_POD_ADDRESS"

func init() {
	addr := os.Getenv(podServeEnv)
	if addr == "" {
		return
	}
	err := http.ListenAndServe(addr, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "pod %s", addr)
	}))
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

// TestReversedVPN runs the reversed VPN with the real binaries: tendril-seed, tendril-ingress,
// tendril-server on the host (the seed); tendril-agent vpn in a "shoot" network namespace that
// reaches the seed only through the ingress's tunnel port; a "pod" HTTP server in a third
// namespace reachable only from the shoot. curl, as kube-apiserver would, asks tendril-server for
// an HTTP CONNECT over mutual TLS to the pod and gets the pod's answer through server → tunnel →
// agent. A target outside the shoot's networks is refused.
func TestReversedVPN(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	for _, bin := range []string{"ip", "curl"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not on PATH (Debian packages iproute2, curl; see .ci/run)", bin)
		}
	}
	dir := t.TempDir()
	id := fmt.Sprintf("%d", os.Getpid()%100000)
	shoot, pod := "tvs-"+id, "tvp-"+id
	for _, ns := range []string{shoot, pod} {
		ip(t, "netns", "add", ns)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	}
	// seed ⇄ shoot: 10.215.0.1/30 ⇄ .2; shoot ⇄ pod: 10.216.0.1/24 ⇄ .2 (the "pod network").
	ip(t, "link", "add", "tvs"+id, "type", "veth", "peer", "name", "tvsn"+id)
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", "tvs"+id).Run() })
	ip(t, "link", "set", "tvsn"+id, "netns", shoot)
	ip(t, "addr", "add", "10.215.0.1/30", "dev", "tvs"+id)
	ip(t, "link", "set", "tvs"+id, "up")
	ip(t, "-n", shoot, "addr", "add", "10.215.0.2/30", "dev", "tvsn"+id)
	ip(t, "-n", shoot, "link", "set", "tvsn"+id, "up")
	ip(t, "-n", shoot, "link", "set", "lo", "up")
	ip(t, "-n", shoot, "link", "add", "tvp"+id, "type", "veth", "peer", "name", "tvpn"+id)
	ip(t, "-n", shoot, "link", "set", "tvpn"+id, "netns", pod)
	ip(t, "-n", shoot, "addr", "add", "10.216.0.1/24", "dev", "tvp"+id)
	ip(t, "-n", shoot, "link", "set", "tvp"+id, "up")
	ip(t, "-n", pod, "addr", "add", "10.216.0.2/24", "dev", "tvpn"+id)
	ip(t, "-n", pod, "link", "set", "tvpn"+id, "up")
	ip(t, "-n", pod, "link", "set", "lo", "up")

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	podCmd := exec.Command("ip", "netns", "exec", pod, self)
	podCmd.Env = append(os.Environ(), podServeEnv+"=10.216.0.2:8080")
	if err := podCmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = podCmd.Process.Kill(); _ = podCmd.Wait() })

	// Keys and certificates, as the extension would put them into Secrets.
	serverKey, _ := wg.GenerateKey()
	agentKey, _ := wg.GenerateKey()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	serverKeyFile := write("server.key", serverKey.String())
	agentKeyFile := write("agent.key", agentKey.String())
	serverPub := write("server.pub", serverKey.PublicKey().String())
	agentPub := write("agent.pub", agentKey.PublicKey().String())
	ca, err := testpki.NewCA("shoot CA")
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "ca.pem")
	if err := ca.WriteCA(caFile); err != nil {
		t.Fatal(err)
	}
	srvCert, _ := ca.Leaf("tendril-server", "127.0.0.1")
	apiCert, _ := ca.Leaf("kube-apiserver")
	if err := testpki.WritePair(srvCert, filepath.Join(dir, "srv.pem"), filepath.Join(dir, "srv-key.pem")); err != nil {
		t.Fatal(err)
	}
	if err := testpki.WritePair(apiCert, filepath.Join(dir, "api.pem"), filepath.Join(dir, "api-key.pem")); err != nil {
		t.Fatal(err)
	}

	const ns = "shoot--e2e--vpn"
	tunnelAddr, connectAddr, grpcAddr, serverMetrics := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.vpn.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	_, port, _ := net.SplitHostPort(freeAddr(t))
	xdsAddr, ingressMetrics := freeAddr(t), freeAddr(t)
	start(t, "tendril-seed", "--routes", routes, "--xds-address", xdsAddr, "--metrics-address", "")
	start(t, "tendril-ingress", "--xds", xdsAddr, "--node-id", "e2e", "--tunnel-address", "10.215.0.1:"+port, "--metrics-address", ingressMetrics)
	start(t, "tendril-server", "--private-key-file", serverKeyFile, "--agent-public-key", "@"+agentPub,
		"--shoot-cidrs", "10.216.0.0/24", "--tunnel-address", tunnelAddr, "--connect-address", connectAddr, "--grpc-address", grpcAddr,
		"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
		"--metrics-address", serverMetrics)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	startBinary(t, "tendril-agent", "ip", "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
		"--private-key-file", agentKeyFile, "--server-public-key", "@"+serverPub, "--shoot-cidrs", "10.216.0.0/24",
		"--seed", "10.215.0.1:"+port, "--destination", translate.VPNServerWireName(ns), "--metrics-address", "")
	eventually(t, "server ready (tunnel up)", func() error { _, err := get("http://" + serverMetrics + "/readyz"); return err })

	curl := func(target string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "curl", "-sS", "--fail", "--noproxy", "", "-p",
			"--proxy", "https://"+connectAddr, "--proxy-cacert", caFile,
			"--proxy-cert", filepath.Join(dir, "api.pem"), "--proxy-key", filepath.Join(dir, "api-key.pem"),
			"http://"+target+"/").CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	eventually(t, "the pod through the tunnel", func() error {
		got, err := curl("10.216.0.2:8080")
		if err == nil && got != "pod 10.216.0.2:8080" {
			err = fmt.Errorf("answered %q", got)
		}
		if err != nil {
			return fmt.Errorf("%v: %s", err, got)
		}
		return nil
	})
	if got, err := curl("10.215.0.1:" + port); err == nil {
		t.Errorf("a target outside the shoot's networks answered %q", got)
	}

	// The same through konnectivity's gRPC protocol, with konnectivity-client as kube-apiserver
	// uses it (one single-use tunnel per connection).
	clientCert, err := tls.LoadX509KeyPair(filepath.Join(dir, "api.pem"), filepath.Join(dir, "api-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{clientCert}, RootCAs: ca.Pool, ServerName: "tendril-server"})
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			tun, err := konnectivity.CreateSingleUseGrpcTunnel(ctx, grpcAddr, grpc.WithTransportCredentials(creds))
			if err != nil {
				return nil, err
			}
			return tun.DialContext(ctx, network, addr)
		},
	}}
	resp, err := hc.Get("http://10.216.0.2:8080/")
	if err != nil {
		t.Fatalf("the pod through konnectivity: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "pod 10.216.0.2:8080" {
		t.Errorf("the pod through konnectivity answered %q", body)
	}
}
