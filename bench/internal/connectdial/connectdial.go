// Package connectdial opens connections through an HTTP CONNECT front-end, as
// kube-apiserver's EgressSelector does toward tendril-server (or a peer's
// front-end): one request per connection, the tunnel once answered 200.
//
// It is the benchmarks' client side only. It does not retry, pool, or keep a
// TLS session cache (each connection is a full handshake, as the
// EgressSelector makes), and it does not read what the target sends after the
// answer: that is the caller's.
package connectdial

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
)

// Dialer returns a dial of target (host:port) through the CONNECT front-end
// at addr: mutual TLS when tlsConfig is set (network "tcp"), or plain (a Unix
// socket, network "unix"). ctx bounds the dial, the handshake and the answer;
// it has no hold on the connection returned. The connection reads first what
// arrived with the answer (a greeting may share its segment).
func Dialer(network, addr string, tlsConfig *tls.Config, target string) func(context.Context) (net.Conn, error) {
	req := []byte("CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n\r\n")
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) {
		raw, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		c := raw
		// The close ends a handshake or an answer that does not come.
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
			return nil, fmt.Errorf("CONNECT: %w", ctxErr(ctx, err))
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
		if !stop() { // ctx ended: the AfterFunc closed c or is about to
			c.Close()
			return nil, ctx.Err()
		}
		if br.Buffered() == 0 {
			return c, nil
		}
		return &bufConn{Conn: c, r: br}, nil
	}
}

// ctxErr is ctx's error once it ended (the close it set off is the cause of
// err), else err.
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
