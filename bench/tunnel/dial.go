package tunnel

import (
	"context"
	"crypto/tls"
	"net"
	"time"

	"github.com/tendril-net/tendril/bench/internal/connectdial"
)

// dialFunc opens one connection to the pod through a target's data path.
// The connection's Close must also end a Read or Write blocked in it.
type dialFunc func(ctx context.Context) (net.Conn, error)

// KonnectivityDialer opens one connection to target (IP:port) through the
// konnectivity ProxyService at server ("host:port", or "unix://PATH" for a
// Unix socket, then tlsConfig is nil), as kube-apiserver's EgressSelector
// does: one single-use gRPC tunnel, its own gRPC connection, per
// connection. Closing the returned connection ends the tunnel, also when a
// Write is blocked in it.
//
// It is the caller's: the reference client is konnectivity-client's
// pkg/client, which logs with k8s.io/klog, and the bench packages may not
// import k8s.io modules (internal/depcheck), so cmd/tendril-bench supplies
// it (package cmd/tendril-bench/konnectivity). Without one the gRPC targets
// are skipped.
type KonnectivityDialer func(ctx context.Context, server string, tlsConfig *tls.Config, target string) (net.Conn, error)

// tcpDialer dials addr directly (direct, OpenVPN through its tun).
func tcpDialer(addr string) dialFunc {
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
}

// connectDialer opens a connection to target with an HTTP CONNECT to the
// front-end at addr (connectdial.Dialer): mutual TLS when tlsConfig is set,
// a new handshake per connection as kube-apiserver's EgressSelector makes.
func connectDialer(network, addr string, tlsConfig *tls.Config, target string) dialFunc {
	return connectdial.Dialer(network, addr, tlsConfig, target)
}

// grpcDialer opens a connection through a konnectivity ProxyService.
func grpcDialer(kd KonnectivityDialer, server string, tlsConfig *tls.Config, target string) dialFunc {
	return func(ctx context.Context) (net.Conn, error) { return kd(ctx, server, tlsConfig, target) }
}

// Client deadlines.
const (
	// dialTimeout bounds one dial with its round trip to the pod.
	dialTimeout = 10 * time.Second
	// ioIdle is how long a transfer may make no progress before the
	// connection counts as failed.
	ioIdle = 10 * time.Second
)
