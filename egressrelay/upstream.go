package egressrelay

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/mem"
)

// proxyMethod is konnectivity's one RPC (service ProxyService in konnectivity-client's
// client.proto, no package), the only one kube-apiserver calls and the only one relayed.
const proxyMethod = "/ProxyService/Proxy"

// proxyStream describes proxyMethod: packets both ways.
var proxyStream = &grpc.StreamDesc{StreamName: "Proxy", ServerStreams: true, ClientStreams: true}

// frame is one gRPC message as it came off the wire, relayed without decoding: the relay reads
// no konnectivity packet, so it copies no bytes either (the buffer received is the buffer sent).
type frame struct{ data mem.BufferSlice }

// rawCodec moves frames. It is named "proto" so that the content-type both ends see stays
// application/grpc+proto: the bytes are konnectivity's protobuf packets, untouched.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

// Marshal hands the frame's buffers to gRPC, which frees them once written.
func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	f, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("egressrelay: codec given %T, not a frame", v)
	}
	d := f.data
	f.data = nil
	return d, nil
}

// Unmarshal keeps a reference to the received buffers (gRPC frees its own when this returns).
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	f, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("egressrelay: codec given %T, not a frame", v)
	}
	data.Ref()
	f.data = data
	return nil
}

// Keepalive on the long-lived connection to tendril-server: a ping after 30 s without a frame,
// and the connection is given up 10 s after an unanswered one, so a server that vanished without
// a FIN (its node gone) costs at most 40 s of streams that cannot finish, not TCP's ~15 min of
// retransmits. tendril-server permits pings every 15 s (server.ServeGRPC).
var upstreamKeepalive = keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}

// upstreamBackoff paces reconnects after a failed connection: 100 ms, then ×1.6 up to 5 s. gRPC's
// default starts at 1 s and grows to 120 s, which would hold kube-apiserver's dials failing for
// minutes after tendril-server came back.
var upstreamBackoff = backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second}

// HTTP/2 flow control on both of the relay's sides, static (gRPC's default estimates the
// bandwidth-delay product and grows a stream's window up to 16 MiB). With gRPC's 64 KiB start,
// tendril-server's 128 KiB DATA messages waited for window updates at each of the two hops, and
// the relay moved a fraction of what kube-apiserver moves on tendril-server's gRPC front-end
// directly; 256 KiB windows take most of that back, and 1 MiB ones do no better
// (docs/performance.md, "kube-apiserver's gRPC egress over one connection").
//
// Memory: a stream's window bounds what the relay holds of it, per side: a tunnel whose reader
// stalls holds at most 2 × 256 KiB here, all MaxConnections (1024) stalled at once 512 MiB. The
// connection windows are returned on receipt (gRPC), so they bound bytes in flight, not memory,
// and one stalled stream cannot hold up the others.
const (
	streamWindow = 256 << 10
	connWindow   = 16 << 20
	// upstreamBuffer is the read and write buffer of the one connection to tendril-server
	// (gRPC's default 32 KiB meant four syscalls per DATA message). kube-apiserver's
	// connections keep gRPC's 32 KiB and share write buffers while idle.
	upstreamBuffer = 128 << 10
)

// upstreams is the relay's connection to one tendril-server: one long-lived gRPC connection over
// mutual TLS that carries every relayed tunnel as its own stream (HTTP/2 flow control per
// stream, so a tunnel whose reader stalls holds up no other). gRPC dials it on the first stream
// (with several servers: when the pool first orders them, servers.go) and again after it broke,
// with its own backoff. When the certificate files change, new streams go to a new connection
// made with them, and the old one is closed when its last stream ends.
type upstreams struct {
	server           string
	handshakeTimeout time.Duration
	certs            *clientTLS

	mu     sync.Mutex
	cur    *upstream
	open   int // connections not closed yet (cur and retired ones with streams)
	closed bool
	// With several servers (pool): failing is whether it failed (an attempt, or its connection)
	// since it last answered, so that the change is logged once, not every failed dial;
	// avoidUntil puts it last in the order until then, after it failed or was slower than
	// attemptDelay while another server answered.
	failing    bool
	avoidUntil time.Time
}

type upstream struct {
	owner   *upstreams
	cc      *grpc.ClientConn
	tls     *tls.Config // the configuration cc was made with
	streams int
	retired bool
}

// acquire returns the connection for a new stream; release must follow.
func (u *upstreams) acquire() (*upstream, error) {
	tlsCfg, err := u.certs.config()
	if err != nil {
		return nil, err
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	c, err := u.currentLocked(tlsCfg)
	if err != nil {
		return nil, err
	}
	c.streams++
	return c, nil
}

// currentLocked returns the connection made with tlsCfg, making it (and retiring the one made
// with older files) if there is none. u.mu is held.
func (u *upstreams) currentLocked(tlsCfg *tls.Config) (*upstream, error) {
	if u.closed {
		return nil, errShutdown
	}
	if u.cur == nil || u.cur.tls != tlsCfg {
		cc, err := grpc.NewClient("passthrough:///"+u.server,
			grpc.WithTransportCredentials(&answeredTLS{TransportCredentials: credentials.NewTLS(tlsCfg), server: u.server,
				timeout: u.handshakeTimeout}),
			grpc.WithKeepaliveParams(upstreamKeepalive),
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: upstreamBackoff, MinConnectTimeout: u.handshakeTimeout}),
			grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})),
			grpc.WithInitialWindowSize(streamWindow), grpc.WithInitialConnWindowSize(connWindow),
			grpc.WithReadBufferSize(upstreamBuffer), grpc.WithWriteBufferSize(upstreamBuffer))
		if err != nil {
			return nil, fmt.Errorf("egressrelay: client for %s: %w", u.server, err)
		}
		if old := u.cur; old != nil {
			old.retired = true
			u.closeIfDone(old)
		}
		u.cur = &upstream{owner: u, cc: cc, tls: tlsCfg}
		u.open++
	}
	return u.cur, nil
}

// state is the state of the connection for new streams, made with tlsCfg. An idle one (never
// used, or idle for gRPC's idle timeout) is told to connect, so that the pool learns whether the
// server answers before a tunnel depends on it.
func (u *upstreams) state(tlsCfg *tls.Config) connectivity.State {
	u.mu.Lock()
	defer u.mu.Unlock()
	c, err := u.currentLocked(tlsCfg)
	if err != nil {
		return connectivity.Shutdown
	}
	st := c.cc.GetState()
	if st == connectivity.Idle {
		c.cc.Connect()
	}
	return st
}

func (c *upstream) release() {
	u := c.owner
	u.mu.Lock()
	defer u.mu.Unlock()
	c.streams--
	u.closeIfDone(c)
}

func (u *upstreams) closeIfDone(c *upstream) {
	if c.retired && c.streams == 0 {
		c.cc.Close()
		u.open--
	}
}

// connections is the number of connections to this tendril-server the relay holds (one, two
// while a rotated certificate's streams finish on the old one).
func (u *upstreams) connections() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.open
}

// close ends every connection; streams still on them fail. Called once the relay's streams ended.
func (u *upstreams) close() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.closed = true
	if c := u.cur; c != nil {
		c.retired = true
		c.streams = 0
		u.closeIfDone(c)
		u.cur = nil
	}
}

// firstBytes is the most the relay reads of tendril-server's first bytes (its HTTP/2 SETTINGS
// frame: a 9-byte header and a few 6-byte settings).
const firstBytes = 4 << 10

// answeredTLS is mutual TLS that also waits for tendril-server's first bytes. Waiting is how a
// refused client certificate shows up in the relay's log as what it is: in TLS 1.3 the client's
// handshake ends before the server has checked the client's certificate, and the server's
// verdict is an alert on the first read; gRPC itself would first write its preface and report
// "broken pipe". An HTTP/2 server sends its SETTINGS frame as soon as the connection is up (RFC
// 9113 §3.4; tendril-server's grpc-go does so without waiting for the client's preface), so the
// bytes arrive within a round trip. They are handed to gRPC's transport as the connection's first.
type answeredTLS struct {
	credentials.TransportCredentials
	server  string
	timeout time.Duration
}

func (c *answeredTLS) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return nil, nil, err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(c.timeout)
	}
	_ = conn.SetReadDeadline(deadline)
	buf := make([]byte, firstBytes)
	n, err := conn.Read(buf)
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("tendril-server %s sent nothing after the TLS handshake "+
			"(a client certificate it does not trust shows here as a remote TLS error): %w", c.server, err)
	}
	_ = conn.SetReadDeadline(time.Time{})
	return &answeredConn{Conn: conn, first: buf[:n]}, info, nil
}

func (c *answeredTLS) Clone() credentials.TransportCredentials {
	return &answeredTLS{TransportCredentials: c.TransportCredentials.Clone(), server: c.server, timeout: c.timeout}
}

// answeredConn returns the bytes read ahead before the rest of the connection.
type answeredConn struct {
	net.Conn
	first []byte
}

func (c *answeredConn) Read(p []byte) (int, error) {
	if len(c.first) > 0 {
		n := copy(p, c.first)
		c.first = c.first[n:]
		if len(c.first) == 0 {
			c.first = nil
		}
		return n, nil
	}
	return c.Conn.Read(p)
}
