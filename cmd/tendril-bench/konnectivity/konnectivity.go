// Package konnectivity is the tunnel mode's konnectivity client: it dials
// through a konnectivity ProxyService with konnectivity-client, the library
// kube-apiserver's EgressSelector uses. It lives here rather than in
// bench/tunnel, which may not import k8s.io modules (konnectivity-client
// logs with klog; see internal/depcheck): tendril-bench passes Dial to the
// tunnel mode, and bench/tunnel's tests import it.
package konnectivity

import (
	"context"
	"crypto/tls"
	"flag"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	konnclient "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
)

var quietKlog sync.Once

// Dial opens one connection to target through the ProxyService
// at server as kube-apiserver does: a single-use gRPC tunnel (its own gRPC
// connection, here over mutual TLS) per connection.
//
// It is a tunnel.KonnectivityDialer: server is "host:port", or "unix://PATH"
// for a Unix socket (then tlsConfig is nil and the connection is plain).
func Dial(ctx context.Context, server string, tlsConfig *tls.Config, target string) (net.Conn, error) {
	quietKlog.Do(func() {
		// konnectivity-client logs every stream it sees end as an error
		// ("stream read failure") on stderr; the benchmark ends thousands.
		fs := flag.NewFlagSet("klog", flag.ContinueOnError)
		klog.InitFlags(fs)
		_ = fs.Set("logtostderr", "false")
		_ = fs.Set("alsologtostderr", "false")
		_ = fs.Set("stderrthreshold", "FATAL")
		klog.SetOutput(io.Discard)
	})
	creds := insecure.NewCredentials()
	if tlsConfig != nil {
		creds = credentials.NewTLS(tlsConfig)
	}
	var opts []grpc.DialOption
	opts = append(opts, grpc.WithTransportCredentials(creds))
	if path, ok := strings.CutPrefix(server, "unix://"); ok {
		server = "passthrough:///unix"
		opts = append(opts, grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}))
	}
	// The tunnel lives until the connection is closed.
	tunnelCtx, cancel := context.WithCancel(context.Background())
	tun, err := konnclient.CreateSingleUseGrpcTunnelWithContext(ctx, tunnelCtx, server, opts...)
	if err != nil {
		cancel()
		return nil, err
	}
	c, err := tun.DialContext(ctx, "tcp", target)
	if err != nil {
		cancel()
		return nil, err
	}
	return &konnConn{Conn: c, cancel: cancel}, nil
}

// konnConn ends the tunnel on Close also when a Write is blocked in it:
// konnectivity-client's Close sends CLOSE_REQ on the stream, which waits for
// a Send in flight; cancelling the tunnel's context releases both.
type konnConn struct {
	net.Conn
	cancel context.CancelFunc
	once   sync.Once
}

// closeWait is how long Close waits for the orderly close before it cancels
// the tunnel.
const closeWait = time.Second

func (c *konnConn) Close() error {
	c.once.Do(func() {
		closed := make(chan struct{})
		go func() {
			_ = c.Conn.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(closeWait):
		}
		c.cancel()
	})
	return nil
}
