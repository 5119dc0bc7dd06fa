// Package egressrelay carries kube-apiserver's konnectivity gRPC egress from a Unix socket in
// kube-apiserver's pod to tendril-server in another pod. kube-apiserver's EgressSelector dials
// gRPC only over a Unix socket ("UDS transport must be specified for GRPC"), so the relay runs as
// a sidecar beside it: it listens on the socket in a volume both containers share, and for each
// accepted connection dials tendril-server's gRPC front-end over mutual TLS (ALPN h2) and copies
// the bytes both ways. It does not speak gRPC or konnectivity: kube-apiserver and tendril-server
// speak it to each other through the relay, one gRPC connection per relayed connection (the
// konnectivity client opens a single-use connection per dial). It knows nothing of Kubernetes
// objects; the certificate files it is given may be rotated under it (mounted Secrets) and are
// read again when they change.
package egressrelay

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/internal/acceptor"
	"github.com/tendril-net/tendril/internal/relay"
)

// Config configures a Relay. Socket, Server and the three certificate files are required.
type Config struct {
	// Socket is the Unix socket kube-apiserver dials (its egress selection's udsName). A stale
	// socket left there by an earlier run is removed; any other file there is an error.
	Socket string
	// SocketMode is the socket's permission bits. If zero, 0600: only the relay's user, which
	// runs kube-apiserver too, may connect.
	SocketMode fs.FileMode
	// Server is tendril-server's konnectivity gRPC front-end, host:port.
	Server string
	// ServerName is the name tendril-server's certificate must carry
	// (tendril-server.<namespace>.svc). If empty, the host of Server.
	ServerName string
	// CertFile and KeyFile are the relay's client certificate for tendril-server (PEM), CAFile
	// the CA bundle that signed tendril-server's certificate. They are checked on every new
	// connection and read again when one of them changed.
	CertFile, KeyFile, CAFile string
	// MaxConnections caps connections relayed at once; one beyond it is closed at once and
	// counted (kube-apiserver's dial fails and it retries). If zero, 1024: kube-apiserver opens
	// one per exec, logs, port-forward, proxy or webhook call, and tendril-server caps dials in
	// flight (256) itself; each relayed connection holds two goroutines and two 128 KiB buffers.
	MaxConnections int
	// HandshakeTimeout bounds the dial, the TLS handshake and tendril-server's first bytes. If
	// zero, 10 s.
	HandshakeTimeout time.Duration
	// IdleTimeout ends a relayed connection without a byte in either direction for this long.
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
	if c.Socket == "" {
		return errors.New("egressrelay: a socket path is required")
	}
	if c.Server == "" {
		return errors.New("egressrelay: tendril-server's gRPC address is required")
	}
	host, _, err := net.SplitHostPort(c.Server)
	if err != nil {
		return fmt.Errorf("egressrelay: server address %q: %w", c.Server, err)
	}
	if c.ServerName == "" {
		c.ServerName = host
	}
	if c.CertFile == "" || c.KeyFile == "" || c.CAFile == "" {
		return errors.New("egressrelay: the client certificate, its key and the CA bundle are required (mutual TLS)")
	}
	if c.SocketMode == 0 {
		c.SocketMode = 0o600
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = 1024
	}
	if c.MaxConnections < 0 {
		return fmt.Errorf("egressrelay: MaxConnections %d is negative", c.MaxConnections)
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = 10 * time.Second
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = time.Hour
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 30 * time.Second
	}
	return nil
}

// Connection outcomes, the label of tendril_egress_relay_connections_total.
const (
	outcomeRelayed    = "relayed"     // dialled, handshake done, bytes relayed
	outcomeTooMany    = "too_many"    // MaxConnections reached: closed at once
	outcomeNoCerts    = "no_certs"    // the certificate files could never be loaded
	outcomeDialFailed = "dial_failed" // TCP dial to tendril-server failed or timed out
	outcomeTLSFailed  = "tls_failed"  // the TLS handshake failed (server certificate, protocol)
	outcomeRejected   = "rejected"    // tendril-server closed before its first bytes (client certificate refused)
	outcomeNotGRPC    = "not_grpc"    // the server did not negotiate h2
	outcomeClientGone = "client_gone" // kube-apiserver's connection ended before the server's first bytes reached it
	outcomeShutdown   = "shutdown"    // the relay was stopping
)

// Relay relays connections from a Unix socket to tendril-server's gRPC front-end.
type Relay struct {
	cfg     Config
	log     logr.Logger
	certs   *certLoader
	accept  *acceptor.Server
	metrics *metrics
	ready   atomic.Bool

	refusedLogged atomic.Int64 // unix nanoseconds of the last "too many connections" log line
}

// New checks cfg and loads the certificates once (a relay that could never dial fails at start).
func New(cfg Config) (*Relay, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	r := &Relay{cfg: cfg, log: cfg.Log}
	r.accept = &acceptor.Server{
		Handle: func(ctx context.Context, c net.Conn, _ *acceptor.Conns) { r.serve(ctx, c) },
		Max:    cfg.MaxConnections,
		Refused: func(net.Conn) {
			r.metrics.connections.WithLabelValues(outcomeTooMany).Inc()
			r.logRefusal()
		},
		DrainTimeout: cfg.DrainTimeout,
		Log:          cfg.Log,
	}
	r.metrics = newMetrics(cfg.Registry, r)
	r.certs = &certLoader{certFile: cfg.CertFile, keyFile: cfg.KeyFile, caFile: cfg.CAFile, serverName: cfg.ServerName,
		log: cfg.Log, loaded: r.metrics.certLoads}
	if _, err := r.certs.config(); err != nil {
		return nil, err
	}
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

// Run listens on the socket and relays until ctx ends; then it stops accepting, removes the
// socket, lets relayed connections finish for up to DrainTimeout and closes the rest.
func (r *Relay) Run(ctx context.Context) error {
	l, err := Listen(r.cfg.Socket, r.cfg.SocketMode)
	if err != nil {
		return err
	}
	r.log.Info("Relaying", "socket", r.cfg.Socket, "server", r.cfg.Server, "serverName", r.cfg.ServerName,
		"maxConnections", r.cfg.MaxConnections)
	return r.Serve(ctx, l)
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

// Serve is Run with the listener already bound; it closes l (which removes a socket made by
// Listen). Closing kube-apiserver's side of a relayed connection ends it both ways.
func (r *Relay) Serve(ctx context.Context, l net.Listener) error {
	r.ready.Store(true)
	defer r.ready.Store(false)
	if err := r.accept.Serve(ctx, l); err != nil {
		return fmt.Errorf("egressrelay: accept: %w", err)
	}
	return nil
}

// logRefusal logs a refused connection at most once a second (a flood is in the counter).
func (r *Relay) logRefusal() {
	now := time.Now().UnixNano()
	last := r.refusedLogged.Load()
	if now-last < int64(time.Second) || !r.refusedLogged.CompareAndSwap(last, now) {
		return
	}
	r.log.Info("Too many connections, refusing (counted in tendril_egress_relay_connections_total{outcome=\"too_many\"})",
		"max", r.cfg.MaxConnections)
}

// serve relays one connection from kube-apiserver.
func (r *Relay) serve(ctx context.Context, c net.Conn) {
	start := time.Now()
	up, outcome, err := r.dial(ctx, c)
	r.metrics.dialSeconds.Observe(time.Since(start).Seconds())
	if err != nil {
		r.metrics.connections.WithLabelValues(outcome).Inc()
		r.log.Info("Connection to tendril-server failed, closing kube-apiserver's connection",
			"outcome", outcome, "server", r.cfg.Server, "error", err.Error())
		return
	}
	defer up.Close()
	r.metrics.connections.WithLabelValues(outcomeRelayed).Inc()
	r.metrics.active.Inc()
	defer r.metrics.active.Dec()
	toServer, fromServer := relay.Pipe(c, up, r.cfg.IdleTimeout)
	r.metrics.bytes.WithLabelValues("to_server").Add(float64(toServer))
	r.metrics.bytes.WithLabelValues("from_server").Add(float64(fromServer))
}

// firstBytes is the most the relay reads of tendril-server's first bytes (its HTTP/2 SETTINGS
// frame: a 9-byte header and a few 6-byte settings).
const firstBytes = 4 << 10

// dial connects to tendril-server over mutual TLS and waits for its first bytes, which it passes
// on to c. Waiting is how a refused client certificate shows up here, in the relay's log and
// metrics, rather than as a broken stream inside kube-apiserver: in TLS 1.3 the client's
// handshake ends before the server has checked the client's certificate, and the server's
// verdict is an alert on the first read. An HTTP/2 server sends its SETTINGS frame as soon as
// the connection is up (RFC 9113 §3.4; tendril-server's grpc-go does so without waiting for the
// client's preface), so the first bytes arrive within a round trip. The whole dial is bounded
// by HandshakeTimeout; kube-apiserver's bytes wait in c meanwhile.
func (r *Relay) dial(ctx context.Context, c net.Conn) (net.Conn, string, error) {
	tlsCfg, err := r.certs.config()
	if err != nil {
		return nil, outcomeNoCerts, err
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, r.cfg.HandshakeTimeout)
	defer cancel()
	failed := func(outcome string) string {
		if parent.Err() != nil {
			return outcomeShutdown
		}
		return outcome
	}
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", r.cfg.Server)
	if err != nil {
		return nil, failed(outcomeDialFailed), fmt.Errorf("dial %s: %w", r.cfg.Server, err)
	}
	up := tls.Client(raw, tlsCfg)
	deadline, _ := ctx.Deadline()
	_ = up.SetDeadline(deadline)
	if err := up.HandshakeContext(ctx); err != nil {
		up.Close()
		return nil, failed(outcomeTLSFailed), fmt.Errorf("TLS handshake with %s (server name %s): %w", r.cfg.Server, r.cfg.ServerName, err)
	}
	if p := up.ConnectionState().NegotiatedProtocol; p != "h2" {
		up.Close()
		return nil, outcomeNotGRPC, fmt.Errorf("%s negotiated ALPN %q, not h2: not a gRPC front-end", r.cfg.Server, p)
	}
	stop := context.AfterFunc(ctx, func() { up.Close() }) // shutdown while waiting
	buf := make([]byte, firstBytes)
	n, err := up.Read(buf)
	if !stop() || err != nil {
		up.Close()
		if err == nil {
			err = ctx.Err()
		}
		return nil, failed(outcomeRejected), fmt.Errorf("tendril-server %s sent nothing after the TLS handshake "+
			"(a client certificate it does not trust shows here as a remote TLS error): %w", r.cfg.Server, err)
	}
	_ = up.SetDeadline(time.Time{})
	_ = c.SetWriteDeadline(deadline)
	if _, err := c.Write(buf[:n]); err != nil {
		up.Close()
		return nil, outcomeClientGone, fmt.Errorf("pass tendril-server's first bytes on to kube-apiserver: %w", err)
	}
	_ = c.SetWriteDeadline(time.Time{})
	return up, "", nil
}
