package tunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
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
// front-end at addr: mutual TLS when tlsConfig is set (network "tcp"), or
// plain on a Unix socket (network "unix"). A new TLS handshake per
// connection, as kube-apiserver's EgressSelector makes (no session cache).
func connectDialer(network, addr string, tlsConfig *tls.Config, target string) dialFunc {
	req := []byte("CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n\r\n")
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) {
		raw, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		c := raw
		stop := context.AfterFunc(ctx, func() { raw.Close() })
		defer stop()
		if tlsConfig != nil {
			tc := tls.Client(raw, tlsConfig)
			if err := tc.HandshakeContext(ctx); err != nil {
				raw.Close()
				return nil, fmt.Errorf("TLS handshake: %w", err)
			}
			c = tc
		}
		if _, err := c.Write(req); err != nil {
			c.Close()
			return nil, fmt.Errorf("CONNECT: %w", err)
		}
		br := bufio.NewReaderSize(c, 1024)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("CONNECT answer: %w", ctxErr(ctx, err))
		}
		if resp.StatusCode != http.StatusOK {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
			c.Close()
			return nil, fmt.Errorf("CONNECT answered %s: %q", resp.Status, body)
		}
		if ctx.Err() != nil {
			c.Close()
			return nil, ctx.Err()
		}
		if br.Buffered() == 0 {
			return c, nil
		}
		return &bufConn{Conn: c, r: br}, nil
	}
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// bufConn reads what the CONNECT answer's reader buffered first.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufConn) Read(b []byte) (int, error) { return c.r.Read(b) }

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
