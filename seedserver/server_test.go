package seedserver_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"

	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/internal/testing/metrictest"
	"github.com/tendril-net/tendril/seedserver"
	"github.com/tendril-net/tendril/seedserver/seedservertest"
	"github.com/tendril-net/tendril/tunnel/wg"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var agentAddr = seedservertest.AgentAddr

// newRig starts a server with its egress front-end on mutual TLS and an agent end of the tunnel
// connected to it over a real TCP stream (an agent key other than zero is not the server's
// peer). The agent serves an echo that greets with "echo\n" on port 8080 of its inner address,
// which is the only "shoot network" the server allows.
func newRig(t *testing.T, agentKey wg.Key, dialTimeout time.Duration) *seedservertest.Backend {
	t.Helper()
	r := seedservertest.Start(t, seedservertest.Options{
		AgentKey:    agentKey,
		DialTimeout: dialTimeout,
		// The request deadline covers the TLS handshake too: as generous as the dial's, so that
		// a burst of handshakes on a loaded machine (under -race) does not time out.
		RequestTimeout: max(dialTimeout, 10*time.Second),
	})
	r.ServeEcho(t, 8080, "echo\n")
	return r
}

// connectTo opens a CONNECT to target over mutual TLS and returns the status and the connection.
func connectTo(t *testing.T, r *seedservertest.Backend, target string) (int, net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := tls.Dial("tcp", r.Connect, r.ClientTLS)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, c, br
}

func TestConnectThroughTunnel(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := seedservertest.Start(t, seedservertest.Options{Registry: reg})
	r.ServeEcho(t, 8080, "echo\n")
	target := netip.AddrPortFrom(agentAddr, 8080).String()
	// The first dial also brings the tunnel up (the agent's keepalive starts the handshake).
	r.WaitReady(t)
	select {
	case <-r.Server.TunnelUp():
	case <-time.After(10 * time.Second):
		t.Fatal("TunnelUp not closed 10 s after the tunnel came up")
	}
	status, c, br := connectTo(t, r, target)
	if status != 200 {
		t.Fatalf("CONNECT %s: %d", target, status)
	}
	defer c.Close()
	if l, _ := br.ReadString('\n'); l != "echo\n" {
		t.Fatalf("greeting %q", l)
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	go func() { _, _ = c.Write(payload) }()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(br, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through the tunnel differs (%v)", err)
	}
	// The tunnel's packet counters saw the payload go out and come back, in packets larger
	// than a 1,500-byte MTU's (the tunnel's is 60,000).
	for _, dir := range []string{"in", "out"} {
		packets := metrictest.Sum(t, reg, "tendril_server_tunnel_packets_total", map[string]string{"direction": dir})
		bytes := metrictest.Sum(t, reg, "tendril_server_tunnel_bytes_total", map[string]string{"direction": dir})
		if bytes < float64(len(payload)) || packets == 0 || bytes/packets <= 1500 {
			t.Errorf("tunnel %s: %.0f packets, %.0f bytes; want at least the 4 MiB payload in packets over 1,500 bytes", dir, packets, bytes)
		}
	}
	if d := metrictest.Sum(t, reg, "tendril_server_tunnel_send_dropped_total", map[string]string{"reason": "refused"}); d != 0 {
		t.Errorf("%.0f packets refused", d)
	}
}

func TestConnectRefusals(t *testing.T) {
	r := newRig(t, wg.Key{}, 10*time.Second)
	r.WaitReady(t)
	for target, want := range map[string]int{
		"10.0.0.1:443":                            403, // outside the shoot's networks
		"[fd8f:6d53:b97a:1::3]:80":                403,
		"kube-apiserver:443":                      400, // names need DNS inside the shoot
		netip.AddrPortFrom(agentAddr, 9).String(): 502, // nothing listens: refused through the tunnel
	} {
		status, c, _ := connectTo(t, r, target)
		c.Close()
		if status != want {
			t.Errorf("CONNECT %s: %d, want %d", target, status, want)
		}
	}
	// Not CONNECT.
	c, err := tls.Dial("tcp", r.Connect, r.ClientTLS)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil || resp.StatusCode != 405 {
		t.Errorf("GET: %v %v", resp, err)
	}
	// No client certificate: the TLS handshake fails.
	nc, err := tls.Dial("tcp", r.Connect, &tls.Config{RootCAs: r.ClientTLS.RootCAs, ServerName: "tendril-server"})
	if err == nil {
		_ = nc.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprint(nc, "CONNECT 10.0.0.1:1 HTTP/1.1\r\n\r\n")
		if _, err = http.ReadResponse(bufio.NewReader(nc), nil); err == nil {
			t.Error("a client without a certificate got an answer")
		}
		nc.Close()
	}
}

// TestWrongAgentKey: an agent whose key is not the configured peer never brings the tunnel up,
// and a dial through it times out.
func TestWrongAgentKey(t *testing.T) {
	wrong, err := wg.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	r := newRig(t, wrong, 2*time.Second)
	status, c, _ := connectTo(t, r, netip.AddrPortFrom(agentAddr, 8080).String())
	c.Close()
	if status != 504 {
		t.Errorf("CONNECT with a wrong agent key: %d, want 504", status)
	}
	if ok, why := r.Server.Ready(); ok || !strings.Contains(why, "no agent") {
		t.Errorf("ready = %v (%s) with a wrong agent key", ok, why)
	}
	// The dial waited 2 s, several rounds of the agents' watch: none saw a live agent.
	select {
	case <-r.Server.TunnelUp():
		t.Error("TunnelUp closed with a wrong agent key")
	default:
	}
}

// TestHeadOfLine: a connection whose reader stalls does not slow another one down.
func TestHeadOfLine(t *testing.T) {
	r := newRig(t, wg.Key{}, 10*time.Second)
	r.WaitReady(t)
	target := netip.AddrPortFrom(agentAddr, 8080).String()
	status, stalled, _ := connectTo(t, r, target)
	if status != 200 {
		t.Fatal(status)
	}
	defer stalled.Close()
	// Fill the stalled connection's path: write, never read the echo back.
	go func() { _, _ = stalled.Write(bytes.Repeat([]byte("x"), 32<<20)) }()

	status, c, br := connectTo(t, r, target)
	if status != 200 {
		t.Fatal(status)
	}
	defer c.Close()
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	const size = 32 << 20
	go func() { _, _ = c.Write(bytes.Repeat([]byte("y"), size)) }()
	if n, err := io.CopyN(io.Discard, br, size); err != nil || n != size {
		t.Fatalf("the second connection moved %d of %d bytes (%v) beside a stalled one", n, size, err)
	}
}

// TestKonnectivityClient drives the gRPC front-end with konnectivity-client, the library
// kube-apiserver uses for its EgressSelector in grpc mode.
func TestKonnectivityClient(t *testing.T) {
	r := newRig(t, wg.Key{}, 10*time.Second)
	r.WaitReady(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := func() konnectivity.Tunnel {
		t.Helper()
		tun, err := konnectivity.CreateSingleUseGrpcTunnel(ctx, r.GRPC, grpc.WithTransportCredentials(credentials.NewTLS(r.ClientTLS)))
		if err != nil {
			t.Fatal(err)
		}
		return tun
	}
	// konnectivity-client registers a connection only after its DialContext got the DIAL_RSP,
	// while its receive loop already handles the next packet: DATA that follows DIAL_RSP at once
	// (a server that speaks first) can arrive "unrecognized" and the client closes the
	// connection. kube-apiserver's egress is client-first (TLS), so this test uses a plain echo
	// that waits for the client.
	target := r.ServeEcho(t, 8081, "")
	c, err := dial().DialContext(ctx, "tcp", target)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	payload := bytes.Repeat([]byte("konnectivity"), 1<<18) // 3 MiB
	go func() { _, _ = c.Write(payload) }()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through konnectivity differs (%v)", err)
	}
	if _, err := dial().DialContext(ctx, "tcp", "10.0.0.1:443"); err == nil || !strings.Contains(err.Error(), "outside the shoot") {
		t.Errorf("dial outside the shoot's networks: %v", err)
	}
}

// TestSilentClientsAreClosed: a client that connects to a front-end and sends nothing (no TLS
// handshake) is disconnected after the request timeout, not held.
func TestSilentClientsAreClosed(t *testing.T) {
	r := seedservertest.Start(t, seedservertest.Options{RequestTimeout: 300 * time.Millisecond})
	for name, addr := range map[string]string{"CONNECT": r.Connect, "gRPC": r.GRPC} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// Far longer than the request timeout, far shorter than grpc-go's default of 120 s.
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if n, err := c.Read(make([]byte, 1)); err == nil || pipe.IsTimeout(err) {
			t.Errorf("%s front-end: a silent client's read returned %d bytes, %v; want the connection closed", name, n, err)
		}
	}
}

// TestThousandConcurrentDials: a burst of 1,000 CONNECTs, four times the dial cap, all succeed
// (dials beyond the cap wait for a slot).
func TestThousandConcurrentDials(t *testing.T) {
	r := newRig(t, wg.Key{}, 30*time.Second) // generous: under -race 1,000 dials take seconds
	r.WaitReady(t)
	target := netip.AddrPortFrom(agentAddr, 8080).String()
	const n = 1000
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := tls.Dial("tcp", r.Connect, r.ClientTLS)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				errs <- err
				return
			}
			if resp.StatusCode != 200 {
				errs <- fmt.Errorf("dial %d: %s", i, resp.Status)
				return
			}
			if l, err := br.ReadString('\n'); err != nil || l != "echo\n" {
				errs <- fmt.Errorf("dial %d: greeting %q, %v", i, l, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if failed < 5 {
			t.Error(err)
		}
		failed++
	}
	if failed > 0 {
		t.Fatalf("%d of %d concurrent dials failed", failed, n)
	}
}

// TestPortZeroRefused: a target with port 0 is no destination. Both front-ends refuse it before
// dialling through the tunnel (CONNECT with 400, gRPC with a dial error naming the port), and
// count it as target_port_invalid.
func TestPortZeroRefused(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := seedservertest.Start(t, seedservertest.Options{Registry: reg})
	r.ServeEcho(t, 8080, "echo\n")
	r.WaitReady(t)
	target := netip.AddrPortFrom(agentAddr, 0).String()
	status, c, br := connectTo(t, r, target)
	c.Close()
	if status != http.StatusBadRequest {
		body, _ := io.ReadAll(br)
		t.Errorf("CONNECT %s: %d %q, want 400", target, status, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tun, err := konnectivity.CreateSingleUseGrpcTunnel(ctx, r.GRPC, grpc.WithTransportCredentials(credentials.NewTLS(r.ClientTLS)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tun.DialContext(ctx, "tcp", target); err == nil || !strings.Contains(err.Error(), "port 0") {
		t.Errorf("gRPC dial %s: %v, want an error naming port 0", target, err)
	}
	if n := metrictest.Sum(t, reg, "tendril_server_dials_total", map[string]string{"outcome": "target_port_invalid"}); n != 2 {
		t.Errorf("target_port_invalid dials: %.0f, want 2", n)
	}
	if n := metrictest.Sum(t, reg, "tendril_server_dials_total", map[string]string{"outcome": "dial_failed"}); n != 0 {
		t.Errorf("%.0f dials failed through the tunnel", n)
	}
}

// TestReadyFollowsTheTunnel: the server is ready while an agent's authenticated packets arrive
// and stops being ready when the agent goes away, within TunnelLiveWindow (here at once: its
// stream closes), although its handshake is seconds old, not WireGuard's 180 s.
func TestReadyFollowsTheTunnel(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := seedservertest.Start(t, seedservertest.Options{Registry: reg})
	r.WaitReady(t)
	if live := metrictest.Sum(t, reg, "tendril_server_tunnel_live", nil); live != 1 {
		t.Errorf("tendril_server_tunnel_live %v with the tunnel up, want 1", live)
	}
	r.Agent.Close()
	gone := time.Now()
	for {
		ok, why := r.Server.Ready()
		if !ok {
			t.Logf("not ready %v after the agent closed: %s", time.Since(gone).Round(time.Millisecond), why)
			break
		}
		if time.Since(gone) > seedserver.TunnelLiveWindow {
			t.Fatalf("still ready %v after the agent closed", time.Since(gone))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if live := metrictest.Sum(t, reg, "tendril_server_tunnel_live", nil); live != 0 {
		t.Errorf("tendril_server_tunnel_live %v without an agent, want 0", live)
	}
}
