package egressrelay

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tendril-net/tendril/internal/testing/testnet"
)

// bufferedConn reads what a bufio.Reader holds first.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// connectVia sends kube-apiserver's CONNECT (with first, bytes right behind the request) on the
// relay's CONNECT socket and returns the connection once answered 200, or the answer.
func (r *running) connectVia(target, method, first string) (net.Conn, *http.Response, error) {
	c, err := net.DialTimeout("unix", r.connectSocket, 5*time.Second)
	if err != nil {
		return nil, nil, err
	}
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	uri := target
	if method != http.MethodConnect {
		uri = "/"
	}
	if _, err := fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: %s\r\n\r\n%s", method, uri, target, first); err != nil {
		c.Close()
		return nil, nil, err
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		c.Close()
		return nil, resp, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	_ = c.SetDeadline(time.Time{})
	return &bufferedConn{Conn: c, r: br}, resp, nil
}

// TestConnectThroughRelay: kube-apiserver's HTTP CONNECT on the relay's second socket reaches a
// target in the shoot through tendril-server, several tunnels at once, bytes sent right behind
// the request included; a target outside the shoot gets 502 with tendril-server's reason, another
// method 405; every tunnel, and the konnectivity ones beside them, travels over the one TCP
// connection to tendril-server; a tunnel the client closed ends at the relay too.
func TestConnectThroughRelay(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	fw := testnet.NewProxy(t, b.grpc)
	r := startRelay(t, Config{Server: fw.Addr, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca})

	echoAtOnce(t, 4, func() (net.Conn, error) {
		c, _, err := r.connectVia(echoTarget, http.MethodConnect, "")
		return c, err
	})

	c, _, err := r.connectVia(echoTarget, http.MethodConnect, "first")
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("first"))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "first" {
		t.Fatalf("bytes behind the request came back as %q (%v)", got, err)
	}
	c.Close()

	_, resp, err := r.connectVia("10.0.0.1:443", http.MethodConnect, "")
	if resp == nil || resp.StatusCode != http.StatusBadGateway || !strings.Contains(err.Error(), "outside the shoot") {
		t.Errorf("CONNECT outside the shoot's networks: %v", err)
	}
	_, resp, err = r.connectVia(echoTarget, http.MethodGet, "")
	if resp == nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET on the CONNECT socket: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 5 { // konnectivity's tunnels on the same connection to tendril-server
		c, err := r.dial(ctx, echoTarget)
		if err != nil {
			t.Fatal(err)
		}
		echo(t, c, 1<<10)
		c.Close()
	}
	for outcome, want := range map[string]float64{outcomeRelayed: 10, outcomeDialFailed: 1, outcomeNotConnect: 1} {
		if got := r.count(outcome); got != want {
			t.Errorf("%s: %v connections, want %v", outcome, got, want)
		}
	}
	if got := fw.Accepted(); got != 1 {
		t.Errorf("%d TCP connections to tendril-server for 10 tunnels, want 1", got)
	}
	deadline := time.Now().Add(10 * time.Second)
	for testutil.ToFloat64(r.relay.metrics.active) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%v tunnels still relayed after their clients closed", testutil.ToFloat64(r.relay.metrics.active))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestConnectSocketAlone: a relay with the CONNECT socket only (the extension's httpConnectRelay
// egress) relays CONNECTs, creates no gRPC socket, and stops cleanly (startRelaySockets' cleanup).
func TestConnectSocketAlone(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	r := startRelaySockets(t, Config{Server: b.grpc, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca}, false, true)
	if r.socket != "" {
		t.Fatalf("gRPC socket %q configured", r.socket)
	}
	if entries, err := os.ReadDir(filepath.Dir(r.connectSocket)); err != nil || len(entries) != 1 {
		t.Fatalf("socket directory holds %v (%v), want the CONNECT socket only", entries, err)
	}
	for range 3 {
		c, _, err := r.connectVia(echoTarget, http.MethodConnect, "")
		if err != nil {
			t.Fatal(err)
		}
		echo(t, c, 64<<10)
		c.Close()
	}
	if got := r.count(outcomeRelayed); got != 3 {
		t.Errorf("%v relayed, want 3", got)
	}
}
