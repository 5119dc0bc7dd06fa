// Package seedserver is tendril-server, the seed side of one shoot's reversed VPN. It accepts the
// shoot agent's tunnel streams (which the ingress forwards from the agent's CONNECT), runs
// WireGuard over them, and serves kube-apiserver's egress: an HTTP CONNECT (over mutual TLS or a
// Unix socket) to a pod, service or node address becomes its own TCP connection through the
// tunnel, so one slow reader never blocks another. Targets outside the shoot's CIDRs are
// refused. Several agents (HA replicas) may connect; the shoot's CIDRs route to one live agent at
// a time and move to another when it dies (agents.go says why they move rather than being chosen
// per dial). The agents' heartbeats are echoed on the tunnel's inner addresses
// (wg.HeartbeatPort). It does not know Kubernetes objects; keys and CIDRs come from its
// configuration.
//
// UDP: the agent forwards UDP flows (DNS to the shoot's resolvers) as it forwards TCP, but the
// server has no UDP front-end: HTTP CONNECT is TCP, and kube-apiserver's konnectivity client
// dials "tcp" only (konnectivity's own server has no UDP either). UDP through the tunnel is for
// in-tunnel use: Tunnel().DialContext(ctx, "udp", "<shoot DNS IP>:53").
package seedserver

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/tunnel/wg"
)

// Config configures a Server. Tunnel and ShootCIDRs are required.
type Config struct {
	// Tunnel is the WireGuard end: the server's key and inner addresses, and one peer per agent
	// whose AllowedIPs are the agent's own inner addresses. The server routes the shoot's CIDRs
	// to one agent at a time itself (a single agent's peer may list them too, as before HA).
	Tunnel wg.Config
	// ShootCIDRs are the shoot's node, pod and service networks: the only egress targets.
	ShootCIDRs []netip.Prefix
	// MaxConcurrentDials caps dials in flight through the tunnel; a dial beyond it waits for a
	// slot up to DialTimeout and is then answered 503. If zero, 256 (kube-apiserver opens one
	// per exec/logs/port-forward or webhook call; a burst of 256 at ~1 ms each clears in well
	// under a second, so a burst of 1,000 waits, it does not fail).
	MaxConcurrentDials int
	// DialTimeout bounds a dial through the tunnel. If zero, 10 s.
	DialTimeout time.Duration
	// IdleTimeout ends an egress connection idle in both directions this long. If zero, 1 h.
	IdleTimeout time.Duration
	// RequestTimeout bounds a client's TLS handshake and CONNECT request (CONNECT front-end), or
	// its TLS handshake and HTTP/2 preface (gRPC front-end; grpc-go's own default is 120 s). If
	// zero, 10 s.
	RequestTimeout time.Duration
	// AgentTimeout is how long an agent may send no authenticated packet before it counts as
	// dead and another live agent takes the shoot's CIDRs over. If zero, 5 s: agents send a
	// heartbeat every second, so five missed ones.
	AgentTimeout time.Duration
	// Log receives the server's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
}

// Server is one shoot's seed-side tunnel endpoint and egress front-end.
type Server struct {
	cfg     Config
	log     logr.Logger
	tun     *wg.Tunnel
	dials   chan struct{} // a slot per dial in flight
	metrics *metrics
	agents  agents
}

// New starts the tunnel device; Close stops it.
func New(cfg Config) (*Server, error) {
	if len(cfg.ShootCIDRs) == 0 {
		return nil, errors.New("server: the shoot's CIDRs are required: without them no target is allowed")
	}
	cfg.MaxConcurrentDials = cmp.Or(cfg.MaxConcurrentDials, 256)
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, 10*time.Second)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, time.Hour)
	cfg.RequestTimeout = cmp.Or(cfg.RequestTimeout, 10*time.Second)
	cfg.AgentTimeout = cmp.Or(cfg.AgentTimeout, 5*time.Second)
	if err := checkAgentPrefixes(&cfg); err != nil {
		return nil, err
	}
	if cfg.Tunnel.Logger.GetSink() == nil {
		cfg.Tunnel.Logger = cfg.Log.WithName("tunnel")
	}
	t, err := wg.New(cfg.Tunnel)
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	s := &Server{cfg: cfg, log: cfg.Log, tun: t, dials: make(chan struct{}, cfg.MaxConcurrentDials)}
	s.metrics = newMetrics(cfg.Registry, s)
	if err := s.initAgents(); err != nil {
		t.Close()
		return nil, err
	}
	return s, nil
}

// Close stops the tunnel and ends every connection through it.
func (s *Server) Close() error { return s.tun.Close() }

// Tunnel is the server's WireGuard end, for status.
func (s *Server) Tunnel() *wg.Tunnel { return s.tun }

// HandshakeFresh is how recent the last handshake must be for an agent to count as live:
// WireGuard rejects a session 180 s after its handshake (RejectAfterTime) and, with the agent's
// keepalive, handshakes again every 120 s.
const HandshakeFresh = 180 * time.Second

// AgentKeepalive is the WireGuard persistent keepalive of tendril-agent (agent/vpn's default):
// an agent whose tunnel works sends an authenticated packet at least this often, whatever else
// it sends (its heartbeats, once a second, are authenticated packets too).
const AgentKeepalive = 10 * time.Second

// TunnelLiveWindow is how recent an agent's last authenticated packet must be for the tunnel to
// carry traffic now (Ready, tendril_server_tunnel_live): two keepalive intervals, so that a stream
// the agent redials (its path timeout, a backoff, a handshake) does not flap readiness, plus 1 s
// for the 250 ms between readings of WireGuard's state and the stream's delivery:
// 2 × 10 s + 1 s = 21 s. An agent that is killed closes its stream, which ends liveness at once;
// the window is the bound for a path that silently stopped forwarding.
const TunnelLiveWindow = 2*AgentKeepalive + time.Second

// Ready reports whether the tunnel carries traffic now: some agent's stream is attached and
// WireGuard accepted a packet of that agent within TunnelLiveWindow. It reads WireGuard's state
// once (a few hundred bytes per agent), so a probe may call it as often as it likes.
func (s *Server) Ready() (bool, string) {
	peers, err := s.tun.Peers()
	if err != nil {
		return false, err.Error()
	}
	now := time.Now()
	var last time.Time
	attached := false
	for _, p := range peers {
		if p.Attached {
			attached = true
			if now.Sub(p.LastAuthenticated) < TunnelLiveWindow {
				return true, ""
			}
		}
		if p.LastAuthenticated.After(last) {
			last = p.LastAuthenticated
		}
	}
	switch {
	case last.IsZero():
		return false, "no agent has sent an authenticated packet"
	case !attached:
		return false, fmt.Sprintf("no agent's stream is attached (last authenticated packet %s ago)", now.Sub(last).Round(time.Second))
	}
	return false, fmt.Sprintf("no authenticated packet from an attached agent for %s (window %s)", now.Sub(last).Round(time.Second), TunnelLiveWindow)
}

// handshakeAge is the time since the most recent handshake of any agent.
func (s *Server) handshakeAge() (time.Duration, bool) {
	peers, err := s.tun.Peers()
	if err != nil {
		return 0, false
	}
	var last time.Time
	for _, p := range peers {
		if p.LastHandshake.After(last) {
			last = p.LastHandshake
		}
	}
	if last.IsZero() {
		return 0, false
	}
	return time.Since(last), true
}

// ServeTunnel accepts agents' streams on l (the port the ingress forwards to, 1194) until ctx
// ends, echoes the agents' heartbeats and watches the agents (failover, silent streams). Who may
// use a stream is WireGuard's decision: a stream whose packets do not come from a configured
// peer key never carries anything. It returns once everything it started has stopped.
func (s *Server) ServeTunnel(ctx context.Context, l net.Listener) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.tun.ServeHeartbeat(ctx) })
	g.Go(func() error { return s.routineWatchAgents(ctx) })
	g.Go(func() error { return s.acceptTunnel(ctx, l) })
	return g.Wait()
}

// acceptTunnel attaches every stream accepted on l to the tunnel, which owns it from then on,
// and asks for a check of the agents when one ends: a killed agent's stream closes at once, and
// the failover grace starts then rather than at the next watchEvery. The handler of each
// attached stream waits for its end or acceptTunnel's (at most one per attached stream: the Bind
// bounds those by MaxStreams).
func (s *Server) acceptTunnel(ctx context.Context, l net.Listener) error {
	// One Attach at a time, as when the accept loop attached: each reads WireGuard's state to pick
	// the stream a full Bind evicts.
	var attach sync.Mutex
	a := &accept.Server{Handle: func(ctx context.Context, c net.Conn, conns *accept.Conns) {
		attach.Lock()
		ep, err := s.tun.Attach(c)
		attach.Unlock()
		if err != nil {
			s.log.Info("Tunnel stream refused", "remote", c.RemoteAddr().String(), "error", err.Error())
			return // c is closed
		}
		conns.Forget(c) // the tunnel's now: it stays open across acceptTunnel's end
		s.log.V(1).Info("Tunnel stream attached", "remote", c.RemoteAddr().String())
		select {
		case <-ep.Done():
			s.checkAgentsSoon()
		case <-ctx.Done():
		}
	}}
	if err := a.Serve(ctx, l); err != nil {
		return fmt.Errorf("server: accept tunnel: %w", err)
	}
	return nil
}

// ServeConnect serves HTTP CONNECT on l until ctx ends, then closes every egress connection.
// With tlsCfg (mutual TLS: it verifies kube-apiserver's client certificate) the connections are
// TLS, the handshake bounded by the request timeout; without it (a Unix socket) plain.
func (s *Server) ServeConnect(ctx context.Context, l net.Listener, tlsCfg *tls.Config) error {
	a := &accept.Server{Handle: func(ctx context.Context, c net.Conn, conns *accept.Conns) {
		if tlsCfg != nil {
			tc := tls.Server(&readAhead{Conn: c}, tlsCfg)
			// Closing the TLS connection sends close_notify; on shutdown the acceptor
			// closes the socket under it.
			defer tc.Close()
			c = tc
		}
		s.serveConnect(ctx, c, conns)
	}}
	if err := a.Serve(ctx, l); err != nil {
		return fmt.Errorf("server: accept egress: %w", err)
	}
	return nil
}

// Dial outcomes, the values of the metrics' outcome label.
const (
	outcomeOK          = "ok"
	outcomeBadRequest  = connect.OutcomeBadRequest
	outcomeNotAllowed  = "target_not_allowed"
	outcomeBadPort     = "target_port_invalid"
	outcomeTooMany     = "too_many_dials"
	outcomeDialFailed  = "dial_failed"
	outcomeDialTimeout = "dial_timeout"
)

// maxRequestBytes bounds a CONNECT request: kube-apiserver's are about 100 bytes.
const maxRequestBytes = 16 << 10

// serveConnect serves one CONNECT: the request is read within the request timeout and
// maxRequestBytes, its target checked, dialled through the tunnel, answered 200 and relayed; any
// refusal is answered with its status, counted and logged.
func (s *Server) serveConnect(ctx context.Context, c net.Conn, conns *accept.Conns) {
	limit := &io.LimitedReader{R: c}
	br := bufio.NewReaderSize(limit, 4096)
	req, r := connect.ReadRequest(c, br, limit, maxRequestBytes, s.cfg.RequestTimeout)
	if r != nil {
		if r.Status != 0 { // else the client went before a request (a TCP probe, say): not counted
			s.refuse(c, r)
		}
		return
	}
	if req.Method != http.MethodConnect {
		s.answer(c, outcomeBadRequest, http.StatusMethodNotAllowed, "only CONNECT is served", nil)
		return
	}
	target, outcome, reason := s.checkTarget("tcp", req.Host)
	switch outcome {
	case outcomeBadRequest, outcomeBadPort:
		s.answer(c, outcome, http.StatusBadRequest, reason, nil)
		return
	case outcomeNotAllowed:
		s.answer(c, outcome, http.StatusForbidden, reason, nil)
		return
	}
	if !s.acquireDial(ctx) {
		s.answer(c, outcomeTooMany, http.StatusServiceUnavailable, "too many dials in flight ("+strconv.Itoa(cap(s.dials))+")", nil)
		return
	}
	start := time.Now()
	dctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	up, err := s.tun.DialContext(dctx, "tcp", target.String())
	cancel()
	<-s.dials
	s.metrics.dialSeconds.Observe(time.Since(start).Seconds())
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || pipe.IsTimeout(err) {
			s.answer(c, outcomeDialTimeout, http.StatusGatewayTimeout, "dial "+target.String()+" through the tunnel timed out", err)
		} else {
			s.answer(c, outcomeDialFailed, http.StatusBadGateway, "dial "+target.String()+" through the tunnel failed", err)
		}
		return
	}
	if !conns.Add(up) {
		return // shutting down: up is closed
	}
	defer conns.Remove(up)
	s.metrics.dials.WithLabelValues(outcomeOK).Inc()
	if err := connect.Established(c); err != nil {
		return
	}
	// Bytes the client sent right after its request are the tunnel's first bytes.
	if n := br.Buffered(); n > 0 {
		b, _ := br.Peek(n)
		if _, err := up.Write(b); err != nil {
			return
		}
	}
	s.metrics.active.Inc()
	defer s.metrics.active.Dec()
	if tc, ok := c.(*tls.Conn); ok {
		c = &recordBatcher{Conn: tc}
	}
	toShoot, fromShoot := pipe.Pipe(c, up, s.cfg.IdleTimeout)
	s.metrics.bytes.WithLabelValues("to_shoot").Add(float64(toShoot))
	s.metrics.bytes.WithLabelValues("from_shoot").Add(float64(fromShoot))
}

// acquireDial takes a dial slot, waiting up to DialTimeout for one.
func (s *Server) acquireDial(ctx context.Context) bool {
	select {
	case s.dials <- struct{}{}:
		return true
	default:
	}
	t := time.NewTimer(s.cfg.DialTimeout)
	defer t.Stop()
	select {
	case s.dials <- struct{}{}:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}

func (s *Server) allowed(a netip.Addr) bool {
	for _, p := range s.cfg.ShootCIDRs {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// answer refuses a CONNECT with a status and reason (refuse).
func (s *Server) answer(c net.Conn, outcome string, status int, reason string, err error) {
	s.refuse(c, &connect.Refusal{Outcome: outcome, Status: status, Body: reason + "\n", Err: err})
}

// refuse counts and logs a refused CONNECT and answers it with its status.
func (s *Server) refuse(c net.Conn, r *connect.Refusal) {
	s.metrics.dials.WithLabelValues(r.Outcome).Inc()
	kv := []any{"remote", c.RemoteAddr().String(), "status", r.Status, "reason", strings.TrimSuffix(r.Body, "\n")}
	if r.Err != nil {
		kv = append(kv, "error", r.Err.Error())
	}
	s.log.Info("Egress refused", kv...)
	r.Answer(c)
}
