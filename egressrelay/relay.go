// Package egressrelay carries kube-apiserver's konnectivity gRPC egress from a Unix socket in
// kube-apiserver's pod to tendril-server in another pod. kube-apiserver's EgressSelector dials
// gRPC only over a Unix socket ("UDS transport must be specified for GRPC"), so the relay runs as
// a sidecar beside it: it serves konnectivity's ProxyService on the socket, in a volume both
// containers share, and relays every tunnel kube-apiserver opens (konnectivity-client opens one
// gRPC connection with one Proxy stream per dial) as a stream of one long-lived gRPC connection
// to tendril-server's front-end over mutual TLS. A dial thus costs a new HTTP/2 stream, not a
// TCP connection and a TLS handshake; each stream has its own HTTP/2 flow control, so one
// tunnel whose reader stalls holds up no other. The relay relays gRPC messages as they are: it
// does not decode konnectivity's packets, and kube-apiserver and tendril-server speak the
// protocol to each other through it. On a second socket (beside the first or instead of it) it
// serves kube-apiserver's HTTP CONNECT egress the same way, a stream per CONNECT, speaking
// konnectivity's client side itself there (connect.go). Given several tendril-servers (an HA
// shoot's replicas), it keeps a connection to each and sends every tunnel to the first that
// answers its dial (servers.go). It knows nothing of Kubernetes objects;
// the certificate files it is given may be rotated under it (mounted Secrets) and are read again
// when they change.
package egressrelay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/internal/pki/tlsreload"
)

// Config configures a Relay. Socket or ConnectSocket (or both), Server or Servers and the three
// certificate files are required.
type Config struct {
	// Socket is the Unix socket on which the relay serves konnectivity's gRPC (kube-apiserver's
	// egress selection with proxyProtocol GRPC: its udsName). A stale socket left there by an
	// earlier run is removed; any other file there is an error. Empty: no gRPC socket.
	Socket string
	// SocketMode is the socket's permission bits (ConnectSocket's too). If zero, 0600: only the
	// relay's user, which runs kube-apiserver too, may connect.
	SocketMode fs.FileMode
	// ConnectSocket is the Unix socket on which the relay serves HTTP CONNECT (kube-apiserver's
	// egress selection with proxyProtocol HTTPConnect and a Unix socket): each CONNECT is a
	// konnectivity dial on a stream of the same connection to tendril-server (connect.go).
	// Empty: no CONNECT socket. MaxConnections counts both sockets' connections.
	ConnectSocket string
	// Server is tendril-server's konnectivity gRPC front-end, host:port: the one-server form of
	// Servers (set one of the two).
	Server string
	// Servers are several tendril-servers' konnectivity gRPC front-ends, host:port each: an HA
	// shoot's replicas by their own names (tendril-server-N.tendril-server.<namespace>.svc.cluster.local:8090),
	// not by the Service, through which kube-proxy would send dials to a lost node's pod too. Each
	// tunnel goes to the first server that answers its dial (servers.go); each server has its own
	// connection.
	Servers []string
	// ServerName is the name tendril-server's certificate must carry
	// (tendril-server.<namespace>.svc), whatever host is dialled: both replicas carry the
	// Service's names. If empty, the servers' host, which must then be the same for all.
	ServerName string
	// CertFile and KeyFile are the relay's client certificate for tendril-server (PEM), CAFile
	// the CA bundle that signed tendril-server's certificate. They are checked on every new
	// connection and read again when one of them changed.
	CertFile, KeyFile, CAFile string
	// MaxConnections caps kube-apiserver's connections (one tunnel each) at once; one beyond it
	// is closed at once and counted (kube-apiserver's dial fails and it retries). If zero, 1024:
	// kube-apiserver opens one per exec, logs, port-forward, proxy or webhook call, and
	// tendril-server caps dials in flight (256) itself. Each relayed tunnel holds two gRPC
	// streams and three goroutines; the messages in flight are gRPC's pooled buffers, bounded by
	// HTTP/2's flow-control windows (streamWindow, 256 KiB per stream and side).
	MaxConnections int
	// HandshakeTimeout bounds opening a stream to tendril-server, a new connection's dial and TLS
	// handshake included, and then the wait for tendril-server's answer to a CONNECT's dial (with
	// several servers, to any tunnel's dial). With several servers it bounds each server's
	// attempt; the next server is tried long before (attemptDelay). If zero, 10 s.
	HandshakeTimeout time.Duration
	// IdleTimeout ends a relayed tunnel without a message in either direction for this long.
	// If zero, 1 h (tendril-server's own egress idle timeout).
	IdleTimeout time.Duration
	// DrainTimeout is how long relayed connections may continue once shutdown began. If zero,
	// 30 s.
	DrainTimeout time.Duration
	// Log receives the relay's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
}

func (c *Config) defaults() error {
	if c.Socket == "" && c.ConnectSocket == "" {
		return errors.New("egressrelay: a socket path is required (the gRPC socket, the CONNECT socket or both)")
	}
	switch {
	case c.Server != "" && len(c.Servers) > 0:
		return errors.New("egressrelay: Server and Servers both set: give one server as Server or all as Servers")
	case c.Server != "":
		c.Servers = []string{c.Server}
	case len(c.Servers) == 0:
		return errors.New("egressrelay: tendril-server's gRPC address is required")
	default:
		c.Servers = slices.Clone(c.Servers)
	}
	var hosts []string
	seen := map[string]bool{}
	for _, s := range c.Servers {
		host, _, err := net.SplitHostPort(s)
		if err != nil {
			return fmt.Errorf("egressrelay: server address %q: %w", s, err)
		}
		if seen[s] {
			return fmt.Errorf("egressrelay: server %s listed twice", s)
		}
		seen[s] = true
		if !slices.Contains(hosts, host) {
			hosts = append(hosts, host)
		}
	}
	if c.ServerName == "" {
		// The replicas' own names are not on their certificate (it carries the Service's), so
		// a host of one of them is no default for the others.
		if len(hosts) > 1 {
			return fmt.Errorf("egressrelay: the servers are on several hosts (%s): the name their certificate carries "+
				"(tendril-server.<namespace>.svc) is required", strings.Join(hosts, ", "))
		}
		c.ServerName = hosts[0]
	}
	if c.CertFile == "" || c.KeyFile == "" || c.CAFile == "" {
		return errors.New("egressrelay: the client certificate, its key and the CA bundle are required (mutual TLS)")
	}
	c.SocketMode = cmp.Or(c.SocketMode, 0o600)
	c.MaxConnections = cmp.Or(c.MaxConnections, 1024)
	if c.MaxConnections < 0 {
		return fmt.Errorf("egressrelay: MaxConnections %d is negative", c.MaxConnections)
	}
	c.HandshakeTimeout = cmp.Or(c.HandshakeTimeout, 10*time.Second)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, time.Hour)
	c.DrainTimeout = cmp.Or(c.DrainTimeout, 30*time.Second)
	return nil
}

// Outcomes of kube-apiserver's connections, the label of tendril_egress_relay_connections_total.
const (
	outcomeRelayed     = "relayed"     // a stream to tendril-server opened, messages relayed until either end finished
	outcomeTooMany     = "too_many"    // MaxConnections reached: closed at once
	outcomeNoCerts     = "no_certs"    // the certificate files could never be loaded
	outcomeUnavailable = "unavailable" // no connection to tendril-server: dial, TLS handshake or client certificate refused (the log says which)
	outcomeTimeout     = "timeout"     // no stream to tendril-server within HandshakeTimeout
	outcomeNotProxy    = "not_proxy"   // kube-apiserver called another method than konnectivity's Proxy
	outcomeShutdown    = "shutdown"    // the relay was stopping
)

var errShutdown = errors.New("egressrelay: shutting down")

// Relay relays kube-apiserver's konnectivity tunnels from a Unix socket to tendril-server's gRPC
// front-end.
type Relay struct {
	cfg     Config
	log     logr.Logger
	certs   *clientTLS
	up      *pool
	metrics *metrics
	ready   atomic.Bool
	limit   accept.Limit   // kube-apiserver's connections open, against MaxConnections
	streams sync.WaitGroup // the relaying goroutines a handler leaves behind (see forward)

	// refusals and failures log connections refused for MaxConnections and tunnels failed for
	// want of a stream to tendril-server, each at most once a second (all are counted).
	refusals, failures accept.LimitedLog
}

// New checks cfg and loads the certificates once (a relay that could never dial fails at start).
func New(cfg Config) (*Relay, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, log: cfg.Log,
		refusals: accept.LimitedLog{Log: cfg.Log, Burst: 1}, failures: accept.LimitedLog{Log: cfg.Log, Burst: 1}}
	// Beyond MaxConnections kube-apiserver's connection is closed at once and counted, so that
	// its dial fails fast and it retries, rather than waiting in the socket's backlog.
	r.limit.Max = cfg.MaxConnections
	r.limit.Refused = func(net.Conn) {
		r.metrics.connections.WithLabelValues(outcomeTooMany).Inc()
		r.refusals.Info("Too many connections, refusing (counted in tendril_egress_relay_connections_total{outcome=\"too_many\"})",
			"max", r.cfg.MaxConnections)
	}
	r.metrics = newMetrics(cfg.Registry, r)
	r.certs = &clientTLS{serverName: cfg.ServerName, files: &tlsreload.Files{Cert: cfg.CertFile, Key: cfg.KeyFile, CA: cfg.CAFile,
		Log: cfg.Log.WithName("client-certificate"), Loaded: func(err error) {
			outcome := "ok"
			if err != nil {
				outcome = "failed"
			}
			r.metrics.certLoads.WithLabelValues(outcome).Inc()
		}}}
	if _, err := r.certs.config(); err != nil {
		return nil, err
	}
	r.up = newPool(cfg.Servers, cfg.HandshakeTimeout, r.certs, cfg.Log, r.metrics)
	return r, nil
}

// Ready reports whether the relay is listening (it does not probe tendril-server: in
// kube-apiserver's pod, readiness that followed the shoot's reachability would take
// kube-apiserver out of service).
func (r *Relay) Ready() (bool, string) {
	if r.ready.Load() {
		return true, ""
	}
	return false, "not listening yet"
}

// Run listens on the configured sockets and relays until ctx ends; then it stops accepting,
// removes the sockets, lets relayed connections finish for up to DrainTimeout and closes the rest.
func (r *Relay) Run(ctx context.Context) error {
	// Serve takes interfaces: a nil *net.UnixListener must stay a nil net.Listener.
	var l, cl net.Listener
	if r.cfg.Socket != "" {
		ul, err := Listen(r.cfg.Socket, r.cfg.SocketMode)
		if err != nil {
			return err
		}
		l = ul
	}
	if r.cfg.ConnectSocket != "" {
		ul, err := Listen(r.cfg.ConnectSocket, r.cfg.SocketMode)
		if err != nil {
			if l != nil {
				l.Close()
			}
			return err
		}
		cl = ul
	}
	r.log.Info("Relaying", "socket", r.cfg.Socket, "connectSocket", r.cfg.ConnectSocket, "servers", r.cfg.Servers,
		"serverName", r.cfg.ServerName, "maxConnections", r.cfg.MaxConnections)
	return r.Serve(ctx, l, cl)
}

// Listen creates the Unix socket at path with mode, removing a stale socket first (a relay that
// was killed leaves it behind). Anything else at path is left alone and is an error.
func Listen(path string, mode fs.FileMode) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("egressrelay: socket directory: %w", err)
	}
	switch fi, err := os.Lstat(path); {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("egressrelay: socket %s: %w", path, err)
	case fi.Mode().Type() != fs.ModeSocket:
		return nil, fmt.Errorf("egressrelay: %s exists and is not a socket (%s): not removing it", path, fi.Mode().Type())
	default:
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("egressrelay: remove stale socket: %w", err)
		}
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("egressrelay: listen: %w", err)
	}
	// The socket is created with the umask's bits (0755 at most: no write, so no connect, for
	// others) and narrowed here before anything is accepted.
	if err := os.Chmod(path, mode); err != nil {
		l.Close()
		return nil, fmt.Errorf("egressrelay: socket mode: %w", err)
	}
	return l, nil
}

// Serve is Run with the listeners already bound: l for konnectivity's gRPC, connectL for HTTP
// CONNECT (either may be nil, not both); it closes them (which removes sockets made by Listen).
// When ctx ends, kube-apiserver's gRPC connections get HTTP/2 GOAWAY (no new tunnels on them) and
// the CONNECT socket stops accepting, tunnels in flight may finish for DrainTimeout, then the
// rest are closed, and last the connection to tendril-server. When one side fails, the other
// stops too and Serve returns the error.
func (r *Relay) Serve(ctx context.Context, l, connectL net.Listener) error {
	if l == nil && connectL == nil {
		return errors.New("egressrelay: nothing to serve (no gRPC and no CONNECT listener)")
	}
	g := grpc.NewServer(grpc.UnknownServiceHandler(r.forward), grpc.ForceServerCodecV2(rawCodec{}),
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow), grpc.SharedWriteBuffer(true))
	// A nil channel is a side not served: the select below never picks it.
	var served, connectServed chan error
	r.ready.Store(true)
	if l != nil {
		served = make(chan error, 1)
		go func() { served <- g.Serve(r.limit.Listener(l)) }()
	}
	if connectL != nil {
		connectServed = make(chan error, 1)
		go func() { connectServed <- r.serveConnect(ctx, r.limit.Listener(connectL)) }()
	}
	var err, cerr error
	select {
	case err = <-served:
		served = nil
	case cerr = <-connectServed:
		connectServed = nil
	case <-ctx.Done():
		r.ready.Store(false)
		drained := make(chan struct{})
		go func() { g.GracefulStop(); close(drained) }()
		t := time.NewTimer(r.cfg.DrainTimeout)
		select {
		case <-drained:
		case <-t.C:
			r.log.Info("Drain period over, closing the tunnels still relayed", "drainTimeout", r.cfg.DrainTimeout)
			g.Stop()
			<-drained
		}
		t.Stop()
	}
	r.ready.Store(false)
	g.Stop()
	if served != nil {
		err = <-served
	}
	r.streams.Wait()
	if connectServed != nil {
		if ctx.Err() == nil {
			connectL.Close() // the gRPC side failed: stop the CONNECT side too
		}
		cerr = <-connectServed
	}
	r.up.close()
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return errors.Join(fmt.Errorf("egressrelay: serve: %w", err), cerr)
	}
	return cerr
}

// forward relays one of kube-apiserver's Proxy streams as a stream to tendril-server. Two
// goroutines copy messages, one per direction. The handler returns as soon as tendril-server's
// side ended (its status, OK or an error such as a refused dial, goes to kube-apiserver), and
// the goroutine still blocked reading kube-apiserver's side ends when gRPC cancels that stream,
// right after: the relay owns it (r.streams) and Serve waits for it. With several servers the
// stream goes to the first that answers kube-apiserver's first message (openRaced).
func (r *Relay) forward(_ any, down grpc.ServerStream) error {
	if m, _ := grpc.MethodFromServerStream(down); m != proxyMethod {
		r.metrics.connections.WithLabelValues(outcomeNotProxy).Inc()
		return status.Errorf(codes.Unimplemented, "tendril-egress-relay relays konnectivity's %s only, not %s", proxyMethod, m)
	}
	ctx, cancel := context.WithCancel(down.Context())
	defer cancel()
	idle := newIdleTimer(r.cfg.IdleTimeout, cancel)
	defer idle.stop()
	var toServer, fromServer atomic.Int64
	defer func() {
		r.metrics.bytes.WithLabelValues("to_server").Add(float64(toServer.Load()))
		r.metrics.bytes.WithLabelValues("from_server").Add(float64(fromServer.Load()))
	}()
	var (
		up    grpc.ClientStream
		c     *upstream
		reply *frame // tendril-server's answer to the first message, not relayed yet (several servers)
	)
	if len(r.up.servers) == 1 {
		var err error
		if up, c, err = r.open(ctx, cancel, "tunnel"); err != nil {
			return status.Errorf(codes.Unavailable, "tendril-egress-relay: %v", err)
		}
	} else {
		first, err := r.firstMessage(ctx, down)
		switch {
		case errors.Is(err, io.EOF):
			return nil // kube-apiserver ended the tunnel before it dialled: nothing to relay
		case idle.fired():
			return status.Errorf(codes.DeadlineExceeded, "tendril-egress-relay: no message either way for %v", r.cfg.IdleTimeout)
		case err != nil:
			return err
		}
		t, tcancel, err := r.openRaced(ctx, first)
		if err != nil {
			return status.Errorf(codes.Unavailable, "tendril-egress-relay: %v", err)
		}
		defer tcancel()
		up, c, reply = t.up, t.c, &t.reply
		toServer.Add(int64(len(first)))
	}
	defer c.release()
	r.metrics.connections.WithLabelValues(outcomeRelayed).Inc()
	r.metrics.active.Inc()
	defer r.metrics.active.Dec()
	if reply != nil {
		n := int64(reply.data.Len())
		if err := down.SendMsg(reply); err != nil {
			reply.data.Free()
			return err
		}
		fromServer.Add(n)
	}
	r.streams.Add(1)
	go func() { // kube-apiserver → tendril-server
		defer r.streams.Done()
		for {
			var f frame
			if err := down.RecvMsg(&f); err != nil {
				if errors.Is(err, io.EOF) {
					_ = up.CloseSend() // kube-apiserver closed its side; tendril-server's may go on
				} else {
					cancel()
				}
				return
			}
			n := int64(f.data.Len())
			idle.touch()
			if err := up.SendMsg(&f); err != nil {
				f.data.Free() // nil when gRPC took it
				return        // up's status comes from RecvMsg below
			}
			toServer.Add(n)
		}
	}()
	for { // tendril-server → kube-apiserver
		var f frame
		if err := up.RecvMsg(&f); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			if idle.fired() {
				return status.Errorf(codes.DeadlineExceeded, "tendril-egress-relay: no message either way for %v", r.cfg.IdleTimeout)
			}
			return err // tendril-server's status, or the cancellation of kube-apiserver's stream
		}
		n := int64(f.data.Len())
		idle.touch()
		if err := down.SendMsg(&f); err != nil {
			f.data.Free()
			return err
		}
		fromServer.Add(n)
	}
}

// open opens a stream to the one tendril-server for one of kube-apiserver's tunnels; a failure is
// counted by its outcome and logged.
func (r *Relay) open(ctx context.Context, cancel context.CancelFunc, what string) (grpc.ClientStream, *upstream, error) {
	up, c, outcome, err := r.openStream(ctx, cancel, r.up.servers[0])
	if err != nil {
		r.fail(what, outcome, err)
	}
	return up, c, err
}

// fail counts and logs a tunnel of kube-apiserver's (what: "tunnel", "CONNECT") that no
// tendril-server took.
func (r *Relay) fail(what, outcome string, err error) {
	r.metrics.connections.WithLabelValues(outcome).Inc()
	r.failures.Info("No stream to tendril-server, failing kube-apiserver's "+what+" (log lines at most once a second; all counted)",
		"outcome", outcome, "servers", r.cfg.Servers, "serverName", r.cfg.ServerName, "error", err.Error())
}

// firstMessage waits for kube-apiserver's first message on down (konnectivity's DIAL_REQ, sent
// as soon as the tunnel is open) until ctx ends (the idle timer included). The read runs in a
// goroutine the relay owns (r.streams), as gRPC ends it only by ending down, once the handler
// returned.
func (r *Relay) firstMessage(ctx context.Context, down grpc.ServerStream) ([]byte, error) {
	type message struct {
		f   frame
		err error
	}
	got := make(chan message, 1)
	r.streams.Add(1)
	go func() {
		defer r.streams.Done()
		var m message
		m.err = down.RecvMsg(&m.f)
		got <- m // buffered: the handler may be gone, and the frame with it (it is garbage then)
	}()
	select {
	case m := <-got:
		if m.err != nil {
			return nil, m.err
		}
		b := m.f.data.Materialize()
		m.f.data.Free()
		return b, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// relayedStream is a stream to tendril-server that answered kube-apiserver's first message.
type relayedStream struct {
	up    grpc.ClientStream
	c     *upstream
	reply frame // the answer
}

// openRaced is open with several servers: kube-apiserver's first message (first), the dial, goes
// to the servers in the race's order (servers.go), each attempt bounded by HandshakeTimeout for
// its stream and again for the answer, and the first stream that answered without refusing
// carries the tunnel; if all refused, the first refusal is relayed as kube-apiserver's answer, as
// with one server. The answer is decoded to tell a refusal (a DIAL_RSP with an error), nothing
// else: the relayed bytes stay as they came. A failure is counted and logged.
func (r *Relay) openRaced(ctx context.Context, first []byte) (*relayedStream, context.CancelFunc, error) {
	try := func(ctx context.Context, cancel context.CancelFunc, u *upstreams) (*relayedStream, error, error) {
		up, c, outcome, err := r.openStream(ctx, cancel, u)
		if err != nil {
			return nil, nil, &attemptError{server: u.server, outcome: outcome, stage: stageOpen, err: err}
		}
		// Each attempt sends a frame of its own, gRPC taking the buffers it is given; the bytes
		// are shared and only read. A failed send shows in RecvMsg as the stream's status.
		_ = up.SendMsg(&frame{data: mem.BufferSlice{mem.SliceBuffer(first)}})
		t := &relayedStream{up: up, c: c}
		timer := time.AfterFunc(r.cfg.HandshakeTimeout, cancel)
		err = up.RecvMsg(&t.reply)
		inTime := timer.Stop()
		if err == nil {
			return t, refusal(t.reply), nil
		}
		c.release()
		outcome = outcomeUnavailable
		switch {
		case !inTime:
			outcome, err = outcomeTimeout, fmt.Errorf("no answer to the dial from %s within %v", u.server, r.cfg.HandshakeTimeout)
		case ctx.Err() != nil:
			outcome = outcomeShutdown
		case errors.Is(err, io.EOF):
			err = fmt.Errorf("%s ended the stream without answering the dial", u.server)
		}
		return nil, nil, &attemptError{server: u.server, outcome: outcome, stage: stageDial, err: err}
	}
	drop := func(t *relayedStream) {
		t.reply.data.Free()
		t.c.release()
	}
	t, _, tcancel, err := race(ctx, r.up, try, drop)
	if err != nil {
		var f *failure
		outcome := outcomeUnavailable
		if errors.As(err, &f) {
			outcome = f.outcome()
		}
		r.fail("tunnel", outcome, err)
		return nil, nil, err
	}
	return t, tcancel, nil
}

// refusal is the error of a DIAL_RSP that refused the dial, nil for any other answer.
func refusal(f frame) error {
	pkt := &client.Packet{}
	if proto.Unmarshal(f.data.Materialize(), pkt) != nil || pkt.GetType() != client.PacketType_DIAL_RSP ||
		pkt.GetDialResponse().GetError() == "" {
		return nil
	}
	return errors.New(pkt.GetDialResponse().GetError())
}

// openStream opens a stream to tendril-server u under ctx, bounded by HandshakeTimeout: cancel
// ends ctx, and so the stream, if the timer fires first. It is timed, failures included.
func (r *Relay) openStream(ctx context.Context, cancel context.CancelFunc, u *upstreams) (grpc.ClientStream, *upstream, string, error) {
	start := time.Now()
	defer func() { r.metrics.dialSeconds.Observe(time.Since(start).Seconds()) }()
	c, err := u.acquire()
	if err != nil {
		if errors.Is(err, errShutdown) {
			return nil, nil, outcomeShutdown, err
		}
		return nil, nil, outcomeNoCerts, err
	}
	timer := time.AfterFunc(r.cfg.HandshakeTimeout, cancel)
	// While gRPC connects, the stream waits for the connection; the timer bounds the wait. After
	// a connection failed (refused, TLS) and until the next attempt, streams fail at once with
	// the reason, which kube-apiserver logs with its failed dial, rather than waiting for the
	// timeout.
	up, err := c.cc.NewStream(ctx, proxyStream, proxyMethod)
	inTime := timer.Stop()
	switch {
	case err == nil && inTime:
		return up, c, "", nil
	case err == nil:
		err = fmt.Errorf("no stream to %s within %v", u.server, r.cfg.HandshakeTimeout)
	}
	c.release()
	switch {
	case !inTime:
		return nil, nil, outcomeTimeout, err
	case ctx.Err() != nil:
		return nil, nil, outcomeShutdown, err
	}
	return nil, nil, outcomeUnavailable, err
}

// idleTimer cancels a tunnel without a message either way for its period. Messages only stamp
// the time; the timer checks the stamp when it fires and sleeps again for the rest, so a busy
// tunnel costs an atomic store per message, not a timer reset.
type idleTimer struct {
	period time.Duration
	last   atomic.Int64 // unix nanoseconds of the last message
	t      *time.Timer
	done   atomic.Bool
}

func newIdleTimer(period time.Duration, cancel context.CancelFunc) *idleTimer {
	it := &idleTimer{period: period}
	it.touch()
	var check func()
	check = func() {
		if rest := time.Duration(it.last.Load() + int64(period) - time.Now().UnixNano()); rest > 0 {
			it.t.Reset(rest)
			return
		}
		it.done.Store(true)
		cancel()
	}
	// Armed for later and reset once it.t is set: check reads it.t.
	it.t = time.AfterFunc(time.Duration(1<<62), check)
	it.t.Reset(period)
	return it
}

func (it *idleTimer) touch()      { it.last.Store(time.Now().UnixNano()) }
func (it *idleTimer) fired() bool { return it.done.Load() }
func (it *idleTimer) stop()       { it.t.Stop() }
