package egressrelay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	konnectivity "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"

	"github.com/tendril-net/tendril/internal/pki/testpki"
	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/seedserver/seedservertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const serverName = "tendril-server.shoot--p--s.svc"

// echoTarget is the backend's echo (client speaks first, as kube-apiserver's TLS does) on the
// agent's inner address, the only shoot network.
var echoTarget = netip.AddrPortFrom(seedservertest.AgentAddr, 8081).String()

// backend is a real tendril-server with its konnectivity front-end on mutual TLS and an agent end
// of the tunnel over a loopback TCP stream; the agent serves echoTarget.
type backend struct {
	grpc string // the gRPC front-end, host:port
	ca   *testpki.CA
}

func newBackend(t *testing.T) *backend {
	t.Helper()
	b := seedservertest.Start(t, seedservertest.Options{ServerName: serverName})
	b.ServeEcho(t, 8081, "")
	b.WaitReady(t)
	return &backend{grpc: b.GRPC, ca: b.CA}
}

// files are the relay's certificate files.
type files struct{ cert, key, ca string }

func writeFiles(t *testing.T, dir string, ca *testpki.CA, clientCA *testpki.CA) files {
	t.Helper()
	f := files{cert: filepath.Join(dir, "tls.crt"), key: filepath.Join(dir, "tls.key"), ca: filepath.Join(dir, "bundle.crt")}
	leaf, err := clientCA.Leaf("kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	if err := testpki.WriteFiles(leaf, ca, f.cert, f.key, f.ca); err != nil {
		t.Fatal(err)
	}
	return f
}

// lockedBuffer collects log lines written from several goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) logger(t *testing.T) logr.Logger {
	return funcr.New(func(prefix, args string) {
		b.mu.Lock()
		fmt.Fprintln(&b.buf, prefix, args)
		b.mu.Unlock()
		t.Log(prefix, args)
	}, funcr.Options{})
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type running struct {
	relay         *Relay
	socket        string
	connectSocket string
	reg           *prometheus.Registry
	logs          *lockedBuffer
}

// startRelay runs a relay with both sockets.
func startRelay(t *testing.T, cfg Config) *running {
	t.Helper()
	return startRelaySockets(t, cfg, true, true)
}

// startRelaySockets runs a relay with the gRPC socket, the CONNECT socket or both; the cleanup
// stops it and checks that it removed its sockets.
func startRelaySockets(t *testing.T, cfg Config, grpcSocket, connectSocket bool) *running {
	t.Helper()
	// A short directory: a Unix socket path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "relay")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	logs := &lockedBuffer{}
	reg := prometheus.NewRegistry()
	if grpcSocket {
		cfg.Socket = filepath.Join(dir, "sock", "tendril-server.sock")
	}
	if connectSocket {
		cfg.ConnectSocket = filepath.Join(dir, "sock", "connect.sock")
	}
	cfg.Log = logs.logger(t)
	cfg.Registry = reg
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // once the relay has returned
		for _, sock := range []string{cfg.Socket, cfg.ConnectSocket} {
			if sock == "" {
				continue
			}
			if _, err := os.Lstat(sock); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("socket %s left behind: %v", sock, err)
			}
		}
	})
	testwait.Run(t, "relay", r.Run)
	deadline := time.Now().Add(5 * time.Second)
	for ok, _ := r.Ready(); !ok; ok, _ = r.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("relay not listening")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return &running{relay: r, socket: cfg.Socket, connectSocket: cfg.ConnectSocket, reg: reg, logs: logs}
}

// tunnel opens a konnectivity single-use tunnel through the relay's socket exactly as
// kube-apiserver's EgressSelector does for `GRPC` over `UDS` (k8s.io/apiserver
// egressselector.udsGRPCConnector): a context dialer to the socket and insecure credentials.
func (r *running) tunnel(ctx context.Context) (konnectivity.Tunnel, error) {
	dialer := grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", r.socket)
	})
	// kube-apiserver bounds the blocking dial with grpc.WithTimeout(30s); ctx bounds it here.
	return konnectivity.CreateSingleUseGrpcTunnelWithContext(ctx, ctx, r.socket, dialer, grpc.WithBlock(), //nolint:staticcheck // as kube-apiserver does
		grpc.WithReturnConnectionError(), grpc.WithTransportCredentials(insecure.NewCredentials())) //nolint:staticcheck // as kube-apiserver does
}

// dial opens a single-use tunnel through the relay and dials target with it, as kube-apiserver
// does; closing the connection ends the tunnel, and a failed dial closes it.
func (r *running) dial(ctx context.Context, target string) (net.Conn, error) {
	tun, err := r.tunnel(ctx)
	if err != nil {
		return nil, fmt.Errorf("tunnel: %w", err)
	}
	c, err := tun.DialContext(ctx, "tcp", target)
	if err != nil {
		tun.Done()
		return nil, err
	}
	return c, nil
}

func (r *running) count(outcome string) float64 {
	c, err := r.relay.metrics.connections.GetMetricWithLabelValues(outcome)
	if err != nil {
		panic(err)
	}
	return testutil.ToFloat64(c)
}

// echoAtOnce opens n tunnels with open at once and echoes 1 MiB through each.
func echoAtOnce(t *testing.T, n int, open func() (net.Conn, error)) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := open()
			if err != nil {
				t.Errorf("tunnel %d: %v", i, err)
				return
			}
			defer c.Close()
			echo(t, c, 1<<20)
		}()
	}
	wg.Wait()
}

func echo(t *testing.T, c net.Conn, size int) {
	t.Helper()
	payload := bytes.Repeat([]byte("relay"), size/5)
	errc := make(chan error, 1)
	go func() { _, err := c.Write(payload); errc <- err }()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through the relay differs (%v)", err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// TestKonnectivityThroughRelay: kube-apiserver's konnectivity client on the relay's socket
// reaches a target in the shoot through tendril-server, several tunnels at once; a target outside
// the shoot is refused by tendril-server, and the refusal reaches the client through the relay.
// All tunnels, one after another and at once, travel over one TCP connection to tendril-server
// (counted by a testnet.Proxy between the two): a dial costs no TLS handshake.
func TestKonnectivityThroughRelay(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	fw := testnet.NewProxy(t, b.grpc)
	r := startRelay(t, Config{Server: fw.Addr, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca})
	fi, err := os.Stat(r.socket)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v, want a socket with 0600", fi.Mode())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	echoAtOnce(t, 4, func() (net.Conn, error) { return r.dial(ctx, echoTarget) })
	if _, err := r.dial(ctx, "10.0.0.1:443"); err == nil || !strings.Contains(err.Error(), "outside the shoot") {
		t.Errorf("dial outside the shoot's networks: %v", err)
	}
	for range 10 {
		c, err := r.dial(ctx, echoTarget)
		if err != nil {
			t.Fatal(err)
		}
		echo(t, c, 1<<10)
		c.Close()
	}
	if got := r.count(outcomeRelayed); got != 15 {
		t.Errorf("relayed %v connections, want 15", got)
	}
	if got := fw.Accepted(); got != 1 {
		t.Errorf("%d TCP connections to tendril-server for 15 tunnels, want 1", got)
	}
	if got := r.relay.up.connections(); got != 1 {
		t.Errorf("relay holds %d connections to tendril-server", got)
	}
}

// TestStalledTunnelHoldsUpNoOther: a tunnel whose kube-apiserver side stops reading (a log
// stream nobody reads) fills its own flow-control window; another tunnel on the same connection
// to tendril-server still moves 4 MiB both ways (in 1 MiB writes: konnectivity-client sends a
// write as one message, and gRPC's limit is 4 MiB a message at both the relay and tendril-server).
func TestStalledTunnelHoldsUpNoOther(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	r := startRelay(t, Config{Server: b.grpc, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := func() net.Conn {
		c, err := r.dial(ctx, echoTarget)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	stalled := dial()
	// Write into the echo without reading: its answers pile up in every window on the way
	// back until the echo's writes block, then the writes here do.
	written := make(chan int64, 1)
	go func() {
		var n int64
		buf := make([]byte, 64<<10)
		for {
			_ = stalled.SetWriteDeadline(time.Now().Add(time.Second))
			m, err := stalled.Write(buf)
			n += int64(m)
			if err != nil {
				written <- n
				return
			}
		}
	}()
	n := <-written
	t.Logf("the stalled tunnel took %d KiB before its writes blocked for 1 s", n>>10)
	other := dial()
	// Held up, the echo would block for good: closing the connection after 20 s fails it.
	stop := time.AfterFunc(20*time.Second, func() { other.Close() })
	defer stop.Stop()
	for range 4 {
		echo(t, other, 1<<20)
	}
	if got := r.relay.up.connections(); got != 1 {
		t.Errorf("relay holds %d connections to tendril-server, want both tunnels on one", got)
	}
}

// TestWrongClientCertificate: a client certificate tendril-server does not trust is refused; the
// relay says so in its log and counts it, and kube-apiserver's tunnel fails. New certificate
// files (a rotated Secret) are used from the next connection on.
func TestWrongClientCertificate(t *testing.T) {
	b := newBackend(t)
	other, err := testpki.NewCA("another shoot's CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	f := writeFiles(t, dir, b.ca, other)
	r := startRelay(t, Config{Server: b.grpc, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca,
		HandshakeTimeout: 5 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	// kube-apiserver's tunnel to the relay opens; its dial fails.
	if c, err := r.dial(ctx, echoTarget); err == nil {
		c.Close()
		t.Fatal("dial with an untrusted client certificate succeeded")
	}
	if got := r.count(outcomeUnavailable); got < 1 {
		t.Errorf("failures counted: %v", got)
	}
	logs := r.logs.String()
	if !strings.Contains(logs, "No stream to tendril-server") || !strings.Contains(logs, "remote error: tls") {
		t.Errorf("no clear log line for the refused certificate:\n%s", logs)
	}

	// Rotation: the Secret's new content appears under the same names (the atomic writer swaps a
	// directory link; here the files are replaced by rename).
	nf := writeFiles(t, t.TempDir(), b.ca, b.ca)
	for _, p := range [][2]string{{nf.cert, f.cert}, {nf.key, f.key}, {nf.ca, f.ca}} {
		if err := os.Rename(p[0], p[1]); err != nil {
			t.Fatal(err)
		}
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel2()
	c, err := r.dial(ctx2, echoTarget)
	if err != nil {
		t.Fatalf("first dial after rotation: %v", err)
	}
	defer c.Close()
	echo(t, c, 64<<10)
	if got := testutil.ToFloat64(r.relay.metrics.certLoads.WithLabelValues("ok")); got != 2 {
		t.Errorf("certificate loads %v, want 2 (start, rotation)", got)
	}
}

// TestWrongServer: a server whose certificate does not carry the expected name fails the
// handshake, and a port without a server fails the dial; kube-apiserver's tunnel fails with the
// reason, the relay logs it (naming the server name) and counts it.
func TestWrongServer(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	closed := testnet.RefusedAddr(t)
	for _, tc := range []struct {
		name, server, serverName string
		why                      string // in the relay's log
	}{
		{"another name", b.grpc, "tendril-server.other.svc", "tendril-server.other.svc"},
		{"a closed port", closed, serverName, "connection refused"},
	} {
		r := startRelay(t, Config{Server: tc.server, ServerName: tc.serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		// konnectivity-client logs the relay's status (which says why) and returns "tunnel
		// closed" from the dial.
		if c, err := r.dial(ctx, echoTarget); err == nil {
			c.Close()
			t.Errorf("%s: dial succeeded", tc.name)
		}
		cancel()
		if got := r.count(outcomeUnavailable); got != 1 {
			t.Errorf("%s: failures counted: %v", tc.name, got)
		}
		if !strings.Contains(r.logs.String(), tc.why) {
			t.Errorf("%s: the log does not say %q:\n%s", tc.name, tc.why, r.logs.String())
		}
	}
}

// TestConnectionLimit: a connection beyond MaxConnections is closed at once and counted, and a
// slot freed is usable again.
func TestConnectionLimit(t *testing.T) {
	b := newBackend(t)
	f := writeFiles(t, t.TempDir(), b.ca, b.ca)
	r := startRelay(t, Config{Server: b.grpc, ServerName: serverName, CertFile: f.cert, KeyFile: f.key, CAFile: f.ca, MaxConnections: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	held, err := r.dial(ctx, echoTarget)
	if err != nil {
		t.Fatal(err)
	}
	extra, err := net.Dial("unix", r.socket)
	if err != nil {
		t.Fatal(err)
	}
	_ = extra.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := extra.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("connection beyond the limit: %v, want closed", err)
	}
	extra.Close()
	if got := r.count(outcomeTooMany); got != 1 {
		t.Errorf("refusals counted: %v", got)
	}
	if !strings.Contains(r.logs.String(), "Too many connections") {
		t.Errorf("no log line for the refusal:\n%s", r.logs.String())
	}
	echo(t, held, 1<<10)
	held.Close() // ends the single-use tunnel, so its gRPC connection, so the relayed one
	deadline := time.Now().Add(10 * time.Second)
	for r.relay.limit.Open() > 0 {
		if time.Now().After(deadline) {
			t.Fatal("slot not freed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := r.dial(ctx, echoTarget)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echo(t, c, 1<<10)
}

func TestListen(t *testing.T) {
	dir, err := os.MkdirTemp("", "relay")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "s.sock")
	// A stale socket (a killed relay) is replaced.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	l, err := Listen(path, 0o660)
	if err != nil {
		t.Fatalf("over a stale socket: %v", err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o660 {
		t.Errorf("mode %v (%v)", fi.Mode(), err)
	}
	l.Close()
	if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("socket not removed on close: %v", err)
	}
	// Anything else is not touched.
	if err := os.WriteFile(path, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(path, 0o600); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("over a regular file: %v", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "keep" {
		t.Error("regular file changed")
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	ca, err := testpki.NewCA("ca")
	if err != nil {
		t.Fatal(err)
	}
	f := writeFiles(t, dir, ca, ca)
	ok := Config{Socket: filepath.Join(dir, "s"), Server: "tendril-server.ns.svc:8090", CertFile: f.cert, KeyFile: f.key, CAFile: f.ca}
	for name, tc := range map[string]struct {
		mut  func(*Config)
		want string
	}{
		"no socket":    {func(c *Config) { c.Socket, c.ConnectSocket = "", "" }, "socket path is required"},
		"no server":    {func(c *Config) { c.Server = "" }, "address is required"},
		"no port":      {func(c *Config) { c.Server = "tendril-server" }, "server address"},
		"no key":       {func(c *Config) { c.KeyFile = "" }, "mutual TLS"},
		"missing cert": {func(c *Config) { c.CertFile = filepath.Join(dir, "nope") }, "client certificate"},
		"bad CA":       {func(c *Config) { c.CAFile = f.key }, "CA bundle: no PEM certificate"},
		"negative max": {func(c *Config) { c.MaxConnections = -1 }, "negative"},
		"both forms":   {func(c *Config) { c.Servers = []string{"tendril-server-0.x:8090"} }, "both set"},
		"twice": {func(c *Config) {
			c.Server, c.Servers = "", []string{"tendril-server-0.x:8090", "tendril-server-0.x:8090"}
		}, "listed twice"},
		"a list without a port": {func(c *Config) { c.Server, c.Servers = "", []string{"tendril-server-0.x:8090", "x"} }, "server address"},
		"replicas without a name": {func(c *Config) {
			c.Server, c.Servers = "", []string{"tendril-server-0.x:8090", "tendril-server-1.x:8090"}
		}, "name their certificate carries"},
	} {
		t.Run(name, func(t *testing.T) {
			c := ok
			tc.mut(&c)
			if _, err := New(c); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
	r, err := New(ok)
	if err != nil {
		t.Fatal(err)
	}
	if r.cfg.ServerName != "tendril-server.ns.svc" || r.cfg.SocketMode != 0o600 || r.cfg.MaxConnections != 1024 ||
		len(r.cfg.Servers) != 1 || r.cfg.Servers[0] != ok.Server {
		t.Errorf("defaults %+v", r.cfg)
	}
	// Replicas by their own names, their certificate's name given; or on one host, its name the
	// default.
	for _, c := range []Config{
		{Servers: []string{"tendril-server-0.t.ns.svc.cluster.local:8090", "tendril-server-1.t.ns.svc.cluster.local:8090"},
			ServerName: "tendril-server.ns.svc"},
		{Servers: []string{"tendril-server.ns.svc:8090", "tendril-server.ns.svc:8091"}},
	} {
		c.Socket, c.CertFile, c.KeyFile, c.CAFile = ok.Socket, ok.CertFile, ok.KeyFile, ok.CAFile
		r, err := New(c)
		if err != nil {
			t.Fatalf("%q: %v", c.Servers, err)
		}
		if r.cfg.ServerName != "tendril-server.ns.svc" || len(r.up.servers) != 2 {
			t.Errorf("%q: server name %q, %d servers", c.Servers, r.cfg.ServerName, len(r.up.servers))
		}
	}
}
