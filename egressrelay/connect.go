package egressrelay

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/pipe"
)

// kube-apiserver's HTTP CONNECT egress over the relay's second socket (Config.ConnectSocket):
// each CONNECT becomes a konnectivity dial on a new stream of the relay's one connection to
// tendril-server, so that the default egress mode, too, costs a stream per dial instead of a TCP
// connection and a mutual-TLS handshake. Here the relay speaks konnectivity's client side
// itself: DIAL_REQ, DIAL_RSP, then DATA both ways, CLOSE_REQ when kube-apiserver's side ends
// (konnectivity has no half-close: like konnectivity's own client, the relay closes the whole
// connection then), CLOSE_RSP when the shoot's side ended.

// Outcomes of CONNECT requests that are not the gRPC path's (the rest are shared: relayed,
// too_many, no_certs, unavailable, timeout, shutdown).
const (
	outcomeNotConnect = "not_connect" // a request with another method than CONNECT
	outcomeDialFailed = "dial_failed" // tendril-server refused or failed the dial (its reason goes to kube-apiserver)
)

const (
	// connectMaxHeader bounds a CONNECT request's head: kube-apiserver sends a request line and
	// a Host header.
	connectMaxHeader = 8 << 10
	// connectChunk is the most a DATA packet carries toward the shoot: tendril-server's chunk
	// size the other way (seedserver's dataChunk).
	connectChunk = 128 << 10
)

// serveConnect accepts CONNECT connections on l until ctx ends, then closes l, lets tunnels
// finish for DrainTimeout and closes the rest (accept.Server). It returns once every tunnel ended.
func (r *Relay) serveConnect(ctx context.Context, l net.Listener) error {
	srv := accept.Server{
		Handle:       func(ctx context.Context, c net.Conn, _ *accept.Conns) { r.tunnelConnect(ctx, c) },
		DrainTimeout: r.cfg.DrainTimeout,
		Log:          r.log.WithValues("socket", "connect"),
	}
	if err := srv.Serve(ctx, l); err != nil {
		return fmt.Errorf("egressrelay: accept on the CONNECT socket: %w", err)
	}
	return nil
}

// tunnelConnect serves one of kube-apiserver's CONNECT connections and closes it.
func (r *Relay) tunnelConnect(ctx context.Context, c net.Conn) {
	defer c.Close()
	limit := &io.LimitedReader{R: c}
	br := bufio.NewReaderSize(limit, 4<<10)
	req, refusal := connect.ReadRequest(c, br, limit, connectMaxHeader, r.cfg.HandshakeTimeout)
	if refusal != nil {
		r.metrics.connections.WithLabelValues(refusal.Outcome).Inc()
		refusal.Answer(c)
		return
	}
	if req.Method != http.MethodConnect {
		r.metrics.connections.WithLabelValues(outcomeNotConnect).Inc()
		(&connect.Refusal{Status: http.StatusMethodNotAllowed, Body: "tendril-egress-relay tunnels CONNECT only\n"}).Answer(c)
		return
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, refused, scancel, err := race(sctx, r.up, func(ctx context.Context, cancel context.CancelFunc, u *upstreams) (*connectStream, error, error) {
		return r.tryConnect(ctx, cancel, u, req.Host)
	}, func(s *connectStream) { s.c.release() })
	var f *failure
	switch {
	case errors.As(err, &f) && f.dialStage() != nil:
		// A stream opened but the dial got no answer on it (nor on any other): the dial's
		// failure, as when tendril-server refused it.
		r.metrics.connections.WithLabelValues(outcomeDialFailed).Inc()
		(&connect.Refusal{Status: http.StatusBadGateway, Body: err.Error() + "\n"}).Answer(c)
		return
	case err != nil:
		outcome := outcomeUnavailable
		if f != nil {
			outcome = f.outcome()
		}
		r.fail("CONNECT", outcome, err)
		(&connect.Refusal{Status: http.StatusServiceUnavailable, Body: "tendril-egress-relay: " + err.Error() + "\n"}).Answer(c)
		return
	}
	defer scancel()
	defer s.c.release()
	if refused != nil {
		r.metrics.connections.WithLabelValues(outcomeDialFailed).Inc()
		(&connect.Refusal{Status: http.StatusBadGateway, Body: refused.Error() + "\n"}).Answer(c)
		return
	}
	up, id := s.up, s.id
	if err := connect.Established(c); err != nil {
		_ = sendPacket(up, closeRequest(id))
		return
	}
	r.metrics.connections.WithLabelValues(outcomeRelayed).Inc()
	r.metrics.active.Inc()
	defer r.metrics.active.Dec()
	r.pumpConnect(sctx, cancel, c, br, up, id)
}

// connectStream is a stream to tendril-server that answered a CONNECT's dial.
type connectStream struct {
	up grpc.ClientStream
	c  *upstream
	id int64 // the connection's ID; 0 when refused
}

// tryConnect is one server's attempt at a CONNECT (tryFunc): a stream, then the dial of target
// on it.
func (r *Relay) tryConnect(ctx context.Context, cancel context.CancelFunc, u *upstreams, target string) (*connectStream, error, error) {
	up, c, outcome, err := r.openStream(ctx, cancel, u)
	if err != nil {
		return nil, nil, &attemptError{server: u.server, outcome: outcome, stage: stageOpen, err: err}
	}
	id, refused, err := dial(up, target, r.cfg.HandshakeTimeout, cancel)
	if err != nil {
		c.release()
		outcome := outcomeUnavailable
		switch {
		case errors.Is(err, errNoAnswerInTime):
			outcome = outcomeTimeout
		case ctx.Err() != nil:
			outcome = outcomeShutdown
		}
		return nil, nil, &attemptError{server: u.server, outcome: outcome, stage: stageDial, err: err}
	}
	return &connectStream{up: up, c: c, id: id}, refused, nil
}

// errNoAnswerInTime marks a dial that tendril-server did not answer within the timeout.
var errNoAnswerInTime = errors.New("no answer in time")

// dial asks tendril-server for a connection to target and waits up to timeout for its answer;
// it returns the connection's ID, or tendril-server's refusal, or err when there was no answer.
func dial(up grpc.ClientStream, target string, timeout time.Duration, cancel context.CancelFunc) (id int64, refused, err error) {
	random := rand.Int64()
	err = sendPacket(up, &client.Packet{Type: client.PacketType_DIAL_REQ, Payload: &client.Packet_DialRequest{
		DialRequest: &client.DialRequest{Protocol: "tcp", Address: target, Random: random}}})
	if err != nil {
		return 0, nil, fmt.Errorf("tendril-egress-relay: dial %s: %w", target, err)
	}
	// tendril-server answers within its own dial timeout; past this one the stream is cancelled.
	timer := time.AfterFunc(timeout, cancel)
	pkt, err := recvPacket(up)
	if !timer.Stop() && err != nil {
		err = fmt.Errorf("%w (%v): %w", errNoAnswerInTime, timeout, err)
	}
	switch {
	case err != nil:
		return 0, nil, fmt.Errorf("tendril-egress-relay: dial %s: no answer from tendril-server: %w", target, err)
	case pkt.GetType() != client.PacketType_DIAL_RSP || pkt.GetDialResponse().GetRandom() != random:
		return 0, nil, fmt.Errorf("tendril-egress-relay: dial %s: tendril-server answered %v", target, pkt.GetType())
	case pkt.GetDialResponse().GetError() != "":
		return 0, fmt.Errorf("tendril-egress-relay: dial %s: %s", target, pkt.GetDialResponse().GetError()), nil
	}
	return pkt.GetDialResponse().GetConnectID(), nil, nil
}

// connectBuffers are the buffers of kube-apiserver's bytes toward the shoot, one per tunnel
// only while it has bytes to read (an idle tunnel holds none).
var connectBuffers = sync.Pool{New: func() any { b := make([]byte, connectChunk); return &b }}

// pumpConnect moves bytes between kube-apiserver's connection c (whose first bytes may be in br)
// and the connection id on stream up until either side ends or idles for IdleTimeout.
func (r *Relay) pumpConnect(ctx context.Context, cancel context.CancelFunc, c net.Conn, br *bufio.Reader, up grpc.ClientStream, id int64) {
	idle := newIdleTimer(r.cfg.IdleTimeout, cancel)
	defer idle.stop()
	// Closing c wakes the reader below when the shoot's side ends, the stream breaks or ctx ends.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	done := make(chan struct{})
	defer func() { c.Close(); <-done }()
	go func() { // kube-apiserver → tendril-server; the only sender on up after the dial
		defer close(done)
		defer cancel()
		var toServer int64
		defer func() { r.metrics.bytes.WithLabelValues("to_server").Add(float64(toServer)) }()
		data := func(b []byte) error {
			idle.touch()
			toServer += int64(len(b))
			return sendPacket(up, &client.Packet{Type: client.PacketType_DATA, Payload: &client.Packet_Data{
				Data: &client.Data{ConnectID: id, Data: b}}})
		}
		if n := br.Buffered(); n > 0 { // bytes kube-apiserver sent right behind its request
			b, _ := br.Peek(n)
			if data(b) != nil {
				return
			}
		}
		for {
			if _, err := pipe.WaitReadable(c, time.Time{}); err != nil {
				break
			}
			buf := connectBuffers.Get().(*[]byte)
			n, err := c.Read(*buf)
			var serr error
			if n > 0 {
				serr = data((*buf)[:n]) // marshalled into a packet of its own: the buffer is free again
			}
			connectBuffers.Put(buf)
			if err != nil || serr != nil {
				break
			}
		}
		// kube-apiserver's side ended: the whole connection ends (konnectivity has no
		// half-close); tendril-server answers CLOSE_RSP, which ends the loop below.
		_ = sendPacket(up, closeRequest(id))
	}()
	var fromServer int64
	defer func() { r.metrics.bytes.WithLabelValues("from_server").Add(float64(fromServer)) }()
	for { // tendril-server → kube-apiserver
		pkt, err := recvPacket(up)
		if err != nil {
			return
		}
		idle.touch()
		switch pkt.GetType() {
		case client.PacketType_DATA:
			d := pkt.GetData().GetData()
			if _, err := c.Write(d); err != nil {
				return
			}
			fromServer += int64(len(d))
		case client.PacketType_CLOSE_RSP:
			return
		}
	}
}

func closeRequest(id int64) *client.Packet {
	return &client.Packet{Type: client.PacketType_CLOSE_REQ, Payload: &client.Packet_CloseRequest{
		CloseRequest: &client.CloseRequest{ConnectID: id}}}
}

// sendPacket sends pkt as a frame (the relay's connection to tendril-server moves raw frames).
func sendPacket(up grpc.ClientStream, pkt *client.Packet) error {
	b, err := proto.Marshal(pkt)
	if err != nil {
		return err
	}
	return up.SendMsg(&frame{data: mem.BufferSlice{mem.SliceBuffer(b)}})
}

// recvPacket receives one frame and decodes it.
func recvPacket(up grpc.ClientStream) (*client.Packet, error) {
	var f frame
	if err := up.RecvMsg(&f); err != nil {
		return nil, err
	}
	defer f.data.Free()
	pkt := &client.Packet{}
	if err := proto.Unmarshal(f.data.Materialize(), pkt); err != nil {
		return nil, errors.Join(errors.New("tendril-egress-relay: a packet from tendril-server does not decode"), err)
	}
	return pkt, nil
}
