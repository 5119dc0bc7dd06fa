package seedserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"

	"github.com/tendril-net/tendril/edge/pipe"
)

// ServeGRPC serves konnectivity's ProxyService (the EgressSelector's grpc mode, with
// konnectivity-client as kube-apiserver's client) on l until ctx ends. creds is mutual TLS for
// TCP, or nil for a Unix socket. Each dial becomes its own TCP connection through the tunnel;
// kube-apiserver's single-use tunnels carry one connection per gRPC stream, so one slow reader
// never holds up another connection's bytes. Through tendril-egress-relay, all of one
// kube-apiserver's tunnels are streams of one connection.
func (s *Server) ServeGRPC(ctx context.Context, l net.Listener, creds credentials.TransportCredentials) error {
	opts := []grpc.ServerOption{grpc.ConnectionTimeout(s.cfg.RequestTimeout),
		// tendril-egress-relay keeps one connection open for all of kube-apiserver's tunnels and
		// pings it after 30 s without a frame; gRPC's default policy (a ping at most every
		// 5 min, none without a stream) would answer those pings with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 15 * time.Second, PermitWithoutStream: true})}
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	opts = append(opts, grpc.ForceServerCodecV2(newPacketCodec()),
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow))
	g := grpc.NewServer(opts...)
	client.RegisterProxyServiceServer(g, &proxyService{s: s})
	stop := context.AfterFunc(ctx, g.Stop)
	defer stop()
	if err := g.Serve(l); err != nil && ctx.Err() == nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("server: serve konnectivity: %w", err)
	}
	return nil
}

// HTTP/2 flow control toward kube-apiserver (and tendril-egress-relay), static as the relay's
// own: a stream's window bounds what gRPC holds of it here before Proxy writes it into the
// tunnel. gRPC's default grows a stream's window with its estimate of the bandwidth-delay
// product, up to 16 MiB, and a few bulk streams' received frames then keep the heap at its soft
// limit; 256 KiB keeps one stream's throughput (docs/performance.md, "The gRPC front-end's
// window and packet size").
// Bound: 256 KiB per stream whose connection through the tunnel takes bytes slower than
// kube-apiserver sends them (the connection window, returned on receipt, bounds bytes in
// flight, not memory).
const (
	streamWindow = 256 << 10
	connWindow   = 16 << 20
)

type proxyService struct {
	client.UnimplementedProxyServiceServer
	s *Server
}

// dataChunk is the most a DATA packet carries from the shoot. Every packet costs a gRPC send (a
// copy, framing, a wake of the transport's writer), so fewer, larger packets move more than
// konnectivity's own 32 KiB (docs/performance.md, "The gRPC front-end's window and packet size").
// The reader's buffer is this large only while a connection is open; kube-apiserver's gRPC client
// takes messages up to 4 MiB.
const dataChunk = 128 << 10

// Proxy serves one gRPC stream: DIAL_REQ → dial through the tunnel → DIAL_RSP; DATA both ways;
// CLOSE_REQ/CLOSE_RSP; DIAL_CLS cancels a dial in flight. Packets are sent by one goroutine at a
// time (gRPC streams are not safe for concurrent Send).
func (p *proxyService) Proxy(stream client.ProxyService_ProxyServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	ps := &proxyStream{s: p.s, stream: stream, ctx: ctx, conns: map[int64]net.Conn{}, dialing: map[int64]context.CancelFunc{}}
	defer func() {
		cancel()
		ps.mu.Lock()
		for _, c := range ps.conns {
			c.Close()
		}
		ps.mu.Unlock()
		ps.wg.Wait()
	}()
	for {
		var in packetIn
		if err := stream.RecvMsg(&in); err != nil {
			return nil // the client ended the stream (or it broke): close everything
		}
		if in.buf != nil { // DATA, its bytes in a buffer of dataChunks (packetCodec)
			ps.toShoot(in.id, *in.buf)
			dataChunks.Put(in.buf)
			continue
		}
		pkt := in.pkt
		switch pkt.GetType() {
		case client.PacketType_DIAL_REQ:
			ps.dialRequest(pkt.GetDialRequest())
		case client.PacketType_DATA: // one packetCodec did not take apart itself
			ps.toShoot(pkt.GetData().GetConnectID(), pkt.GetData().GetData())
		case client.PacketType_CLOSE_REQ:
			id := pkt.GetCloseRequest().GetConnectID()
			ps.mu.Lock()
			c := ps.conns[id]
			delete(ps.conns, id)
			ps.mu.Unlock()
			if c != nil {
				c.Close()
			}
			ps.closeResponse(id, "")
		case client.PacketType_DIAL_CLS:
			ps.mu.Lock()
			if cancelDial := ps.dialing[pkt.GetCloseDial().GetRandom()]; cancelDial != nil {
				cancelDial()
			}
			ps.mu.Unlock()
		}
	}
}

// proxyStream is one konnectivity Proxy stream: the connections it dialed through the tunnel,
// by connect ID, and the dials in flight, by the client's random. Proxy owns it and waits for
// its dialers and readers (wg) before it returns.
type proxyStream struct {
	s      *Server
	stream client.ProxyService_ProxyServer
	ctx    context.Context
	// sendMu serializes SendMsg, which gRPC allows from one goroutine at a time.
	sendMu sync.Mutex
	// mu guards conns, dialing and nextID.
	mu      sync.Mutex
	conns   map[int64]net.Conn
	dialing map[int64]context.CancelFunc
	nextID  int64
	wg      sync.WaitGroup
}

// send sends a *client.Packet or a *dataOut.
func (ps *proxyStream) send(pkt any) error {
	ps.sendMu.Lock()
	defer ps.sendMu.Unlock()
	return ps.stream.SendMsg(pkt)
}

func (ps *proxyStream) dialResponse(random int64, id int64, err string) {
	_ = ps.send(&client.Packet{Type: client.PacketType_DIAL_RSP, Payload: &client.Packet_DialResponse{
		DialResponse: &client.DialResponse{Random: random, ConnectID: id, Error: err}}})
}

func (ps *proxyStream) closeResponse(id int64, err string) {
	_ = ps.send(&client.Packet{Type: client.PacketType_CLOSE_RSP, Payload: &client.Packet_CloseResponse{
		CloseResponse: &client.CloseResponse{ConnectID: id, Error: err}}})
}

// toShoot writes a DATA packet's bytes to its connection.
func (ps *proxyStream) toShoot(id int64, data []byte) {
	ps.mu.Lock()
	c := ps.conns[id]
	ps.mu.Unlock()
	if c == nil {
		ps.closeResponse(id, "unknown connection")
		return
	}
	if _, err := c.Write(data); err != nil {
		c.Close() // the reader ends and answers CLOSE_RSP
		return
	}
	ps.s.metrics.bytes.WithLabelValues("to_shoot").Add(float64(len(data)))
}

// dialRequest checks a DIAL_REQ's target and dials it through the tunnel on a goroutine of its
// own, which then reads the connection until it ends (fromShoot).
func (ps *proxyStream) dialRequest(req *client.DialRequest) {
	s := ps.s
	target, outcome, reason := s.checkTarget(req.GetProtocol(), req.GetAddress())
	if outcome != "" {
		s.metrics.dials.WithLabelValues(outcome).Inc()
		ps.dialResponse(req.GetRandom(), 0, reason)
		return
	}
	if !s.acquireDial(ps.ctx) {
		s.metrics.dials.WithLabelValues(outcomeTooMany).Inc()
		ps.dialResponse(req.GetRandom(), 0, "too many dials in flight")
		return
	}
	dctx, dcancel := context.WithTimeout(ps.ctx, s.cfg.DialTimeout)
	ps.mu.Lock()
	ps.dialing[req.GetRandom()] = dcancel
	ps.mu.Unlock()
	ps.wg.Add(1)
	go func() {
		defer ps.wg.Done()
		c, err := s.tun.DialContext(dctx, "tcp", target.String())
		dcancel()
		<-s.dials
		ps.mu.Lock()
		delete(ps.dialing, req.GetRandom())
		if err != nil {
			ps.mu.Unlock()
			s.metrics.dials.WithLabelValues(dialOutcome(err)).Inc()
			ps.dialResponse(req.GetRandom(), 0, fmt.Sprintf("dial %s through the tunnel: %v", target, err))
			return
		}
		if ps.ctx.Err() != nil {
			ps.mu.Unlock()
			c.Close()
			return
		}
		ps.nextID++
		id := ps.nextID
		ps.conns[id] = c
		ps.mu.Unlock()
		s.metrics.dials.WithLabelValues(outcomeOK).Inc()
		s.metrics.active.Inc()
		defer s.metrics.active.Dec()
		ps.dialResponse(req.GetRandom(), id, "")
		ps.fromShoot(id, c)
	}()
}

// fromShoot reads c and sends its bytes until the target ends, then closes it and answers
// CLOSE_RSP unless the client closed it first. A buffer sent is gRPC's (packetCodec): each read
// takes one from the pool, once there are bytes to read, so an idle connection holds none.
func (ps *proxyStream) fromShoot(id int64, c net.Conn) {
	for {
		if _, err := pipe.WaitReadable(c, time.Time{}); err != nil {
			break
		}
		buf := dataChunks.Get(dataChunk)
		n, err := c.Read(*buf)
		if n == 0 {
			dataChunks.Put(buf)
		} else {
			*buf = (*buf)[:n]
			ps.s.metrics.bytes.WithLabelValues("from_shoot").Add(float64(n))
			if serr := ps.send(&dataOut{id: id, buf: buf}); serr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	ps.mu.Lock()
	_, open := ps.conns[id]
	delete(ps.conns, id)
	ps.mu.Unlock()
	c.Close()
	if open {
		ps.closeResponse(id, "")
	}
}

// checkTarget validates a dial's target: TCP to an IP:port inside the shoot's CIDRs, port not 0.
// kube-apiserver dials pod, service and node IPs; a name would need DNS inside the shoot. Port 0
// is no destination (TCP cannot connect to it; dialled through the tunnel it would only come
// back as a failed dial after a round trip to the agent). A refusal comes with its outcome
// (bad_request, target_port_invalid, target_not_allowed) and a reason for the client.
func (s *Server) checkTarget(protocol, address string) (target netip.AddrPort, outcome, reason string) {
	if protocol != "tcp" {
		return target, outcomeBadRequest, fmt.Sprintf("protocol %q not supported (tcp only)", protocol)
	}
	target, err := netip.ParseAddrPort(address)
	if err != nil {
		return target, outcomeBadRequest, fmt.Sprintf("target %q must be IP:port", address)
	}
	target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	if target.Port() == 0 {
		return target, outcomeBadPort, "target " + target.String() + ": port 0 is not a destination"
	}
	if !s.allowed(target.Addr()) {
		return target, outcomeNotAllowed, "target " + target.String() + " is outside the shoot's networks"
	}
	return target, "", ""
}

func dialOutcome(err error) string {
	if errors.Is(err, context.DeadlineExceeded) || pipe.IsTimeout(err) {
		return outcomeDialTimeout
	}
	return outcomeDialFailed
}
