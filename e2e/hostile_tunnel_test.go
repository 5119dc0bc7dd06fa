package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/tunnel/bind"
	"github.com/tendril-net/tendril/tunnel/frame"
	"github.com/tendril-net/tendril/xds/translate"
)

// TestJunkStreamsDoNotCutTheVPN attacks a shoot's reversed VPN as anyone who knows only the
// shoot's namespace can: streams to the shoot's tendril-server through tendril-ingress (its
// Reversed-VPN listener, and CONNECT with X-Gardener-Destination on the proxy listener), more
// than the server has slots, each sending a frame of junk every 2 s and
// reconnecting when closed. With the real binaries (seed, ingress, server on the host; the agent
// in a "shoot" network namespace, a "pod" behind it), while the attack runs: the server is not
// ready with no agent, a restarted agent with the right key gets its stream, and a seed → shoot
// dial through tendril-server succeeds within 2 s of the agent's start.
func TestJunkStreamsDoNotCutTheVPN(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and veth pairs (run make test as root, as CI does)")
	}
	dir := t.TempDir()
	// seed ⇄ shoot: 10.219.0.1/30 ⇄ .2; shoot ⇄ pod: 10.220.0.1/24 ⇄ .2.
	shoot, pod := shootNetworks(t, "th", "10.219.0", "10.220.0")
	startPod(t, pod, "10.220.0.2:8080")

	write := func(name, content string) string { return writeFile(t, dir, name, content) }
	serverKeyFile, serverPub, _ := writeKeys(t, dir, "server")
	agentKeyFile, agentPub, _ := writeKeys(t, dir, "agent")
	ca, caFile, apiCert := shootPKI(t, dir)

	const ns = "shoot--e2e--hostile"
	tunnelAddr, connectAddr, serverMetrics := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	routes := write("routes.yaml", fmt.Sprintf("shoots:\n- name: %s\n  hosts: [api.hostile.e2e.test]\n  apiserver: 127.0.0.1:1\n  vpnServer: %s\n", ns, tunnelAddr))
	ingressTunnel := bindAddr(t, "10.219.0.1:0") // the shoot's side of its veth reaches it
	xdsAddr, ingressMetrics, ingressProxy := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
	xdsSeed, xdsIngress := xdsTLS(t)
	start(t, "tendril-seed", []string{xdsAddr}, append([]string{"--routes", routes, "--xds-address", xdsAddr, "--metrics-address", ""}, xdsSeed...)...)
	start(t, "tendril-ingress", []string{ingressTunnel, ingressProxy, ingressMetrics}, append([]string{"--xds", xdsAddr, "--node-id", "e2e", "--tunnel-address", ingressTunnel, "--proxy-address", ingressProxy, "--metrics-address", ingressMetrics}, xdsIngress...)...)
	start(t, "tendril-server", []string{tunnelAddr, connectAddr, serverMetrics}, "--private-key-file", serverKeyFile, "--agent-public-key", "@"+agentPub,
		"--shoot-cidrs", "10.220.0.0/24", "--tunnel-address", tunnelAddr, "--connect-address", connectAddr, "--grpc-address", "",
		"--tls-cert-file", filepath.Join(dir, "srv.pem"), "--tls-key-file", filepath.Join(dir, "srv-key.pem"), "--client-ca-file", caFile,
		"--metrics-address", serverMetrics)
	eventually(t, "ingress ready", func() error { _, err := get("http://" + ingressMetrics + "/readyz"); return err })
	eventually(t, "server serving", func() error { _, err := get("http://" + serverMetrics + "/healthz"); return err })
	if body, err := get("http://" + serverMetrics + "/readyz"); err == nil {
		t.Errorf("/readyz before any agent attached: 200 %q, want 503", body)
	}

	startAgent := func(name string) *exec.Cmd {
		return startKillable(t, name, "ip", nil, "netns", "exec", shoot, filepath.Join(binDir, "tendril-agent"), "vpn",
			"--private-key-file", agentKeyFile, "--server-public-key", "@"+serverPub, "--shoot-cidrs", "10.220.0.0/24",
			"--seed", ingressTunnel, "--destination", translate.TendrilServerWireName(ns), "--metrics-address", "")
	}
	clientTLS := &tls.Config{Certificates: []tls.Certificate{apiCert}, RootCAs: ca.Pool, ServerName: "tendril-server"}
	// toPod is kube-apiserver's egress: CONNECT to the pod through tendril-server, then a request.
	toPod := func(deadline time.Time) error {
		c, err := tls.DialWithDialer(&net.Dialer{Deadline: deadline}, "tcp", connectAddr, clientTLS)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(deadline)
		fmt.Fprint(c, "CONNECT 10.220.0.2:8080 HTTP/1.1\r\nHost: 10.220.0.2:8080\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("CONNECT: %s", resp.Status)
		}
		fmt.Fprint(c, "GET / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
		resp, err = http.ReadResponse(br, nil)
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		if string(body) != "pod 10.220.0.2:8080" {
			return fmt.Errorf("the pod answered %q", body)
		}
		return nil
	}

	agent := startAgent("tendril-agent-1")
	eventually(t, "server ready (tunnel up)", func() error { _, err := get("http://" + serverMetrics + "/readyz"); return err })
	eventually(t, "the pod through the tunnel", func() error { return toPod(time.Now().Add(5 * time.Second)) })

	// The attack: more junk streams than the server has slots.
	const attackers = bind.DefaultMaxStreams + 4
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var opened atomic.Int64
	t.Cleanup(func() { stop(); wg.Wait() })
	for i := range attackers {
		addr, header := ingressTunnel, translate.ReversedVPNHeader
		if i%2 == 1 {
			addr, header = ingressProxy, translate.GardenerDestinationHeader
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			junkStreams(ctx, addr, header, translate.TendrilServerWireName(ns), &opened)
		}()
	}
	eventually(t, "every stream slot taken", func() error {
		m, err := get("http://" + serverMetrics + "/metrics")
		if err != nil {
			return err
		}
		if want := fmt.Sprintf("tendril_server_tunnel_streams_active %d", bind.DefaultMaxStreams); !strings.Contains(m, want) {
			return fmt.Errorf("want %q:\n%s", want, grepLines(m, "tendril_server_tunnel_streams"))
		}
		return nil
	})

	// The agent dies; its stream ends with it, and the server stops being ready within the
	// live window (at once: the stream closed).
	_ = agent.Process.Kill()
	killedAt := time.Now()
	for {
		if _, err := get("http://" + serverMetrics + "/readyz"); err != nil {
			break
		}
		if time.Since(killedAt) > seedserver.TunnelLiveWindow+time.Second {
			t.Fatalf("/readyz still 200 %v after the agent was killed (live window %v)", time.Since(killedAt), seedserver.TunnelLiveWindow)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("/readyz not ready %v after the agent was killed", time.Since(killedAt).Round(time.Millisecond))

	// The agent comes back while the junk streams hold every slot, and the pod answers through
	// it within 2 s.
	startAgent("tendril-agent-2")
	begin := time.Now()
	deadline := begin.Add(2 * time.Second)
	var lastErr error
	for {
		// Short attempts: a dial sent before the tunnel is back loses its SYN, and TCP would
		// retransmit it only after its 1 s initial retransmission timeout.
		attempt := time.Now().Add(500 * time.Millisecond)
		if attempt.After(deadline) {
			attempt = deadline
		}
		if lastErr = toPod(attempt); lastErr == nil {
			break
		}
		if time.Now().After(deadline) {
			m, _ := get("http://" + serverMetrics + "/metrics")
			t.Fatalf("no dial through the tunnel within 2 s of the agent's restart under attack: %v\n%s", lastErr, grepLines(m, "tendril_server_tunnel_streams"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the pod answered %v after the agent's restart, under attack (%d junk streams opened so far)", time.Since(begin).Round(time.Millisecond), opened.Load())
	eventually(t, "server ready again under attack", func() error { _, err := get("http://" + serverMetrics + "/readyz"); return err })
	// Still through it a while later: the junk does not displace the agent's stream.
	time.Sleep(3 * time.Second)
	if err := toPod(time.Now().Add(5 * time.Second)); err != nil {
		t.Errorf("the pod 3 s later, under attack: %v", err)
	}
	m, err := get("http://" + serverMetrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("server metrics:\n%s", grepLines(m, "tendril_server_tunnel_streams"))
	if !strings.Contains(m, `tendril_server_tunnel_streams_detached_total{reason="evicted"}`) || strings.Contains(m, `tendril_server_tunnel_streams_detached_total{reason="evicted"} 0`) {
		t.Errorf("no eviction counted:\n%s", grepLines(m, "tendril_server_tunnel_streams"))
	}
}

// junkStreams keeps one junk stream open to the shoot's tendril-server through the ingress
// until ctx ends: CONNECT with header naming destination, then a frame of 32 random bytes every
// 2 s; when the stream is closed, a new one after 100 ms.
func junkStreams(ctx context.Context, ingress, header, destination string, opened *atomic.Int64) {
	junk := make([]byte, 32)
	for ctx.Err() == nil {
		d := net.Dialer{Timeout: 2 * time.Second}
		c, err := d.DialContext(ctx, "tcp", ingress)
		if err == nil {
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			if err = connect.Open(c, "vpn-seed-server:1194", header, destination); err != nil {
				c.Close()
			}
		}
		if err == nil {
			opened.Add(1)
			_ = c.SetDeadline(time.Time{})
			closed := make(chan struct{})
			go func() { _, _ = io.Copy(io.Discard, c); close(closed) }()
			tick := time.NewTicker(2 * time.Second)
		send:
			for {
				_, _ = rand.Read(junk)
				f, _ := frame.AppendFrame(nil, junk, frame.MaxSize)
				if _, err := c.Write(f); err != nil {
					break
				}
				select {
				case <-ctx.Done():
					break send
				case <-closed:
					break send
				case <-tick.C:
				}
			}
			tick.Stop()
			c.Close()
			<-closed
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}
