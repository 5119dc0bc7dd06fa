// Package vpn is the shoot side of tendril's reversed VPN: the agent dials out to the seed (through
// the ingress's CONNECT listener with the Reversed-VPN header, or straight to tendril-server),
// runs WireGuard over that stream, and keeps it up with jittered reconnects. Connections the seed
// opens through the tunnel to the shoot's networks are terminated in the agent's netstack and
// dialled for real. It knows nothing of Kubernetes objects.
package vpn

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/tunnel/bind"
	"github.com/tendril-net/tendril/tunnel/netstack"
	"github.com/tendril-net/tendril/tunnel/tundev"
	"github.com/tendril-net/tendril/tunnel/wg"
	"github.com/tendril-net/tendril/tunnel/wgmetrics"
	"github.com/tendril-net/tendril/wire"
)

// Config configures an Agent. PrivateKey, ServerPublicKey and Seed are required.
type Config struct {
	PrivateKey      wg.Key
	ServerPublicKey wg.Key
	// Address is the agent's inner address; ServerAddresses are the server's (an IPv6 one from
	// Gardener's VPN range and an IPv4 one, the source of connections to IPv4 shoot networks).
	Address         netip.Addr
	ServerAddresses []netip.Addr
	// ShootCIDRs are the networks the seed may reach through this agent.
	ShootCIDRs []netip.Prefix
	// Seed is where the agent dials: the ingress's tunnel listener (host:8132), or with Direct
	// the server's tunnel port.
	Seed string
	// Direct dials the server without a CONNECT (a seed reachable without the ingress).
	Direct bool
	// Header and Destination make the CONNECT: Header defaults to "Reversed-VPN", Destination is
	// "outbound|1194||tendril-server.<ns>.svc.cluster.local" (required unless Direct).
	Header, Destination string
	// DialTimeout bounds a dial and its CONNECT answer. If zero, 10 s.
	DialTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between reconnects. If zero, 200 ms and 15 s.
	MinBackoff, MaxBackoff time.Duration
	// Keepalive is WireGuard's persistent keepalive from the agent. If zero, 10 s.
	Keepalive time.Duration
	// HeartbeatInterval is how often the agent sends a heartbeat through the tunnel to the
	// server, which echoes it (wg.HeartbeatPort). If zero, 1 s.
	HeartbeatInterval time.Duration
	// PathTimeout ends a stream whose heartbeats have gone unanswered this long, and the agent
	// dials again: a path that stopped forwarding without closing (a proxy or NAT that lost the
	// connection) is replaced within seconds, where TCP would notice only after minutes, if at
	// all. If zero, 5 s. The timeout is armed once the server has answered a heartbeat (a
	// server without echo never ends a stream this way), or while no handshake has completed on
	// the stream.
	PathTimeout time.Duration
	// Dial dials the real destination of a connection the seed opened into the shoot. If nil,
	// a net.Dialer's DialContext.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// TUN, if set, names a TUN device for the tunnel and the kernel's TCP/IP stack carries
	// its connections (needs NET_ADMIN, and IP forwarding on for UDP): the seed's TCP
	// connections into ShootCIDRs are redirected to the agent, which dials each with Dial as
	// ever; UDP (DNS) is forwarded by the kernel, masqueraded, and not counted. Empty: the
	// userspace netstack.
	TUN string
	// Log receives the agent's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// NoProcessMetrics leaves out the metrics that are the process's, not the tunnel's (the
	// relay's buffers): a Set's agents after the first, which share the process.
	NoProcessMetrics bool
}

// Agent keeps one tunnel to the seed.
type Agent struct {
	cfg       Config
	tun       *wg.Tunnel
	connected atomic.Bool
	echoSeen  atomic.Bool // the server has answered a heartbeat: it serves them
	// echoedStreams counts the streams on which the server answered a heartbeat.
	echoedStreams atomic.Uint64
	reconnects    prometheus.Counter
	dialErrors    *prometheus.CounterVec
	forwards      *prometheus.CounterVec
	pathTimeouts  prometheus.Counter
}

// New starts the WireGuard end; Run connects it.
func New(cfg Config) (*Agent, error) {
	if cfg.PrivateKey.IsZero() || cfg.ServerPublicKey.IsZero() {
		return nil, errors.New("vpn: the agent's private key and the server's public key are required")
	}
	if cfg.Seed == "" {
		return nil, errors.New("vpn: the seed address is required")
	}
	if !cfg.Direct && cfg.Destination == "" {
		return nil, errors.New("vpn: the CONNECT destination (outbound|1194||tendril-server.<ns>.svc.cluster.local) is required")
	}
	cfg.Header = cmp.Or(cfg.Header, wire.ReversedVPNHeader)
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, 10*time.Second)
	cfg.MinBackoff = cmp.Or(cfg.MinBackoff, 200*time.Millisecond)
	cfg.MaxBackoff = cmp.Or(cfg.MaxBackoff, 15*time.Second)
	cfg.Keepalive = cmp.Or(cfg.Keepalive, 10*time.Second)
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, time.Second)
	cfg.PathTimeout = cmp.Or(cfg.PathTimeout, 5*time.Second)
	if cfg.Dial == nil {
		cfg.Dial = (&net.Dialer{}).DialContext
	}
	wcfg := wg.Config{
		PrivateKey:     cfg.PrivateKey,
		LocalAddresses: []netip.Addr{cfg.Address},
		Peers: []wg.Peer{{
			PublicKey:           cfg.ServerPublicKey,
			AllowedIPs:          hostPrefixes(cfg.ServerAddresses),
			PersistentKeepalive: cfg.Keepalive,
		}},
		Logger: cfg.Log.WithName("tunnel"),
		TUN:    cfg.TUN,
	}
	a := &Agent{cfg: cfg}
	a.forwards = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_forwarded_total", Help: "Connections (TCP) and flows (UDP) from the seed into the shoot, by outcome (ok, dial_failed, accept_failed, udp_ok, udp_dial_failed).",
	}, []string{"outcome"})
	a.reconnects = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_streams_total", Help: "Tunnel streams established to the seed (more than one: reconnects).",
	})
	a.pathTimeouts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_path_timeouts_total", Help: "Streams ended because the server's heartbeat echoes stopped (a dead path).",
	})
	a.dialErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_dial_errors_total", Help: "Failed attempts to reach the seed, by stage (dial, connect).",
	}, []string{"stage"})
	if len(cfg.ShootCIDRs) > 0 {
		// Connections the seed opens to the shoot's networks end in the netstack; each is
		// dialled for real here. Anything else is reset by the netstack.
		wcfg.Forward = netstack.Forward{Prefixes: cfg.ShootCIDRs, Handler: a.forward, UDP: a.forwardUDP}
		wcfg.TUNHandler = a.forwardTUN
	}
	t, err := wg.New(wcfg)
	if err != nil {
		return nil, fmt.Errorf("vpn: %w", err)
	}
	a.tun = t
	if cfg.Registry != nil {
		cfg.Registry.MustRegister(a.reconnects, a.dialErrors, a.forwards, a.pathTimeouts, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_agent_vpn_handshake_age_seconds", Help: "Seconds since the last handshake with the server (-1: none).",
		}, func() float64 {
			if last := a.lastHandshake(); !last.IsZero() {
				return time.Since(last).Seconds()
			}
			return -1
		}), wgmetrics.New("tendril_agent_vpn", len(cfg.ShootCIDRs) > 0, t.StackStats))
		if !cfg.NoProcessMetrics {
			cfg.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "tendril_agent_vpn_relay_buffers",
				Help: "128 KiB copy buffers the agent's connections into the shoot hold now: one per direction moving bytes or blocked writing them; an idle connection holds none.",
			}, func() float64 { return float64(pipe.BuffersHeld()) }))
		}
	}
	return a, nil
}

func hostPrefixes(addrs []netip.Addr) []netip.Prefix {
	var ps []netip.Prefix
	for _, a := range addrs {
		ps = append(ps, netip.PrefixFrom(a, a.BitLen()))
	}
	return ps
}

// Tunnel is the agent's WireGuard end.
func (a *Agent) Tunnel() *wg.Tunnel { return a.tun }

// Close stops the tunnel.
func (a *Agent) Close() error { return a.tun.Close() }

// Ready reports whether the tunnel is up: a stream is attached and the last handshake is fresh
// (WireGuard drops a session 180 s after its handshake).
func (a *Agent) Ready() (bool, string) {
	if !a.connected.Load() {
		return false, "not connected to " + a.cfg.Seed
	}
	last := a.lastHandshake()
	if last.IsZero() || time.Since(last) > 180*time.Second {
		return false, "no recent handshake with the server"
	}
	return true, ""
}

func (a *Agent) lastHandshake() time.Time {
	peers, err := a.tun.Peers()
	if err != nil || len(peers) == 0 {
		return time.Time{}
	}
	return peers[0].LastHandshake
}

// Run keeps a stream to the seed until ctx ends: dial, CONNECT, attach, wait for the stream to
// end, back off with jitter, again.
func (a *Agent) Run(ctx context.Context) error {
	backoff := a.cfg.MinBackoff
	for ctx.Err() == nil {
		start := time.Now()
		echoed := false
		c, err := a.dial(ctx)
		if err == nil {
			var ep *bind.Endpoint
			ep, err = a.tun.AttachPeer(c, a.cfg.ServerPublicKey)
			if err == nil {
				a.connected.Store(true)
				a.reconnects.Inc()
				a.cfg.Log.Info("Tunnel stream up", "seed", a.cfg.Seed)
				echoed = a.watchPath(ctx, ep, start)
				if ctx.Err() == nil {
					a.cfg.Log.Info("Tunnel stream ended", "seed", a.cfg.Seed, "after", time.Since(start).Round(time.Millisecond).String())
				}
				a.connected.Store(false)
				c.Close()
			} else {
				c.Close()
			}
		}
		if err != nil && ctx.Err() == nil {
			a.cfg.Log.Info("Reaching the seed failed", "seed", a.cfg.Seed, "error", err.Error())
		}
		// A stream that lived a while, or on which the server answered a heartbeat, was healthy:
		// start the backoff over. Without the echo case, every restart of the server or the
		// ingress within MaxBackoff of the last doubled the wait, so restarts a few seconds apart
		// found the agent ever longer away (e2e TestHAFailoverTimes; docs/performance.md,
		// "Failover"). A server that answers and then drops the stream at once costs a reconnect
		// every MinBackoff, each with a completed handshake: not a storm.
		if echoed || time.Since(start) > a.cfg.MaxBackoff {
			backoff = a.cfg.MinBackoff
		}
		wait := backoff/2 + rand.N(backoff/2+1) // jitter: many agents do not return in step
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		backoff = min(2*backoff, a.cfg.MaxBackoff)
	}
	return nil
}

// watchPath sends heartbeats through the tunnel until the stream ends or ctx does, and ends the
// stream when the echoes stop for PathTimeout (see Config.PathTimeout). It reports whether the
// server answered a heartbeat on this stream.
func (a *Agent) watchPath(ctx context.Context, ep *bind.Endpoint, attached time.Time) (echoed bool) {
	var hb net.Conn
	err := errors.New("the server has no inner address")
	if len(a.cfg.ServerAddresses) > 0 {
		dst := netip.AddrPortFrom(a.heartbeatAddr(), wg.HeartbeatPort)
		hb, err = a.tun.DialContext(ctx, "udp", dst.String())
	}
	if err != nil {
		// Without heartbeats the stream lives until it fails by itself, as before them.
		a.cfg.Log.Error(err, "Heartbeats off for this stream")
		select {
		case <-ep.Done():
		case <-ctx.Done():
		}
		return false
	}
	var lastEcho atomic.Int64 // Unix nanoseconds of the last echo on this stream
	readerDone := make(chan struct{})
	go func() { // routineReadEchoes
		defer close(readerDone)
		buf := make([]byte, wg.MaxHeartbeatSize)
		for {
			if _, err := hb.Read(buf); err != nil {
				return
			}
			if lastEcho.Swap(time.Now().UnixNano()) == 0 {
				a.echoedStreams.Add(1)
			}
			a.echoSeen.Store(true)
		}
	}()
	defer func() { hb.Close(); <-readerDone; echoed = lastEcho.Load() != 0 }()
	tick := time.NewTicker(a.cfg.HeartbeatInterval)
	defer tick.Stop()
	var seq uint64
	for {
		seq++
		// The first goes out at once: WireGuard sends it right after the handshake, and its
		// echo arms the timeout. A failed send is a missed heartbeat, counted below.
		_, _ = hb.Write(binary.BigEndian.AppendUint64(nil, seq))
		select {
		case <-ep.Done():
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		last := attached
		if e := lastEcho.Load(); e != 0 {
			last = time.Unix(0, e)
		}
		silent := time.Since(last)
		if silent <= a.cfg.PathTimeout || !a.pathTimeoutArmed(attached) {
			continue
		}
		a.pathTimeouts.Inc()
		a.cfg.Log.Info("No heartbeat echo from the server: ending the stream", "seed", a.cfg.Seed, "silentFor", silent.Round(time.Millisecond).String())
		_ = ep.Close()
		return
	}
}

// pathTimeoutArmed: the server is known to echo heartbeats, or the stream has not completed a
// handshake (it carries nothing at all).
func (a *Agent) pathTimeoutArmed(attached time.Time) bool {
	return a.echoSeen.Load() || a.lastHandshake().Before(attached)
}

// heartbeatAddr is the server's inner address of the agent's family (the first one else).
func (a *Agent) heartbeatAddr() netip.Addr {
	for _, s := range a.cfg.ServerAddresses {
		if s.Is4() == a.cfg.Address.Is4() {
			return s
		}
	}
	return a.cfg.ServerAddresses[0]
}

// forwardDialTimeout bounds the real dial of a forwarded connection; the seed's own dial through
// the tunnel waits for it (tendril-server's default dial timeout is 10 s).
const forwardDialTimeout = 8 * time.Second

// dialShoot dials a forwarded connection's or flow's real destination; a failure is counted
// as failed (its outcome) and logged.
func (a *Agent) dialShoot(ctx context.Context, network string, dst netip.AddrPort, failed string) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, forwardDialTimeout)
	defer cancel()
	up, err := a.cfg.Dial(dctx, network, dst.String())
	if err != nil {
		a.forwards.WithLabelValues(failed).Inc()
		a.cfg.Log.V(1).Info("Forwarded dial failed", "network", network, "destination", dst.String(), "error", err.Error())
	}
	return up, err
}

// forward serves one connection from the seed into the shoot: dial the real destination first,
// so that a refused destination is refused through the tunnel too, then relay.
func (a *Agent) forward(ctx context.Context, r *netstack.Request) {
	up, err := a.dialShoot(ctx, "tcp", r.Dst(), "dial_failed")
	if err != nil {
		r.Refuse()
		return
	}
	defer up.Close()
	c, err := r.Accept()
	if err != nil {
		a.forwards.WithLabelValues("accept_failed").Inc()
		return
	}
	a.forwards.WithLabelValues("ok").Inc()
	pipe.Pipe(c, up, time.Hour)
}

// forwardTUN serves one connection from the seed into the shoot on a TUN device (Config.TUN):
// the kernel completed the seed's handshake already, so a failed dial resets the connection
// where forward refuses it.
func (a *Agent) forwardTUN(ctx context.Context, c *net.TCPConn, dst netip.AddrPort) {
	up, err := a.dialShoot(ctx, "tcp", dst, "dial_failed")
	if err != nil {
		tundev.Reset(c)
		return
	}
	defer up.Close()
	a.forwards.WithLabelValues("ok").Inc()
	pipe.Pipe(c, up, time.Hour)
}

// UDP flow timeouts. A DNS flow (destination port 53) ends with its first answer (resolvers
// use a fresh source port per query, so a flow is one query; a retry opens a new flow) or after
// dnsIdleTimeout, glibc's and Go's resolver timeout: nobody waits longer for the answer. Any
// other flow ends after udpIdleTimeout without a datagram either way.
const (
	dnsIdleTimeout = 5 * time.Second
	udpIdleTimeout = 30 * time.Second
	// udpBufferSize holds any datagram (the 16-bit UDP length).
	udpBufferSize = 64 << 10
)

// forwardUDP serves one UDP flow from the seed into the shoot (DNS to the shoot's resolvers,
// above all): a socket to the real destination, datagrams relayed both ways until the flow
// ends (see dnsIdleTimeout).
func (a *Agent) forwardUDP(ctx context.Context, src, dst netip.AddrPort, c net.Conn) {
	up, err := a.dialShoot(ctx, "udp", dst, "udp_dial_failed")
	if err != nil {
		return
	}
	a.forwards.WithLabelValues("udp_ok").Inc()
	dns := dst.Port() == 53
	idle := udpIdleTimeout
	if dns {
		idle = dnsIdleTimeout
	}
	var last atomic.Int64 // Unix nanoseconds of the flow's last datagram, either way
	last.Store(time.Now().UnixNano())
	// Either direction ending ends the flow: closing both wakes the other.
	end := func() { _ = up.Close(); _ = c.Close() }
	stop := context.AfterFunc(ctx, end)
	defer stop()
	done := make(chan struct{})
	go func() { // routineUDPFromShoot
		defer close(done)
		defer end()
		relayDatagrams(c, up, idle, &last, dns)
	}()
	relayDatagrams(up, c, idle, &last, false)
	end()
	<-done
}

// relayDatagrams copies datagrams from src to dst until a read or write fails or the flow has
// been idle (no datagram either way, per last) for idle; with once, after the first datagram.
func relayDatagrams(dst, src net.Conn, idle time.Duration, last *atomic.Int64, once bool) {
	buf := make([]byte, udpBufferSize)
	for {
		_ = src.SetReadDeadline(time.Unix(0, last.Load()).Add(idle))
		n, err := src.Read(buf)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && time.Since(time.Unix(0, last.Load())) < idle {
				continue // the other direction carried a datagram meanwhile
			}
			return
		}
		last.Store(time.Now().UnixNano())
		if _, err := dst.Write(buf[:n]); err != nil {
			return
		}
		if once {
			return
		}
	}
}

// dial opens the stream: TCP to the seed, then (unless Direct) CONNECT with the destination
// header, answered 200 by the ingress only once the server is connected.
func (a *Agent) dial(ctx context.Context) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	d := net.Dialer{KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 10 * time.Second, Interval: 5 * time.Second, Count: 3}}
	c, err := d.DialContext(ctx, "tcp", a.cfg.Seed)
	if err != nil {
		a.dialErrors.WithLabelValues("dial").Inc()
		return nil, err
	}
	if a.cfg.Direct {
		return c, nil
	}
	deadline, _ := ctx.Deadline()
	_ = c.SetDeadline(deadline)
	// The request line needs an authority; the header routes.
	if err := connect.Open(c, "tendril-server:1194", a.cfg.Header, a.cfg.Destination); err != nil {
		a.dialErrors.WithLabelValues("connect").Inc()
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}
