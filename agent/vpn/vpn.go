// Package vpn is the shoot side of tendril's reversed VPN: the agent dials out to the seed (through
// the ingress's CONNECT listener with the Reversed-VPN header, or straight to tendril-server),
// runs WireGuard over that stream, and keeps it up with jittered reconnects. Connections the seed
// opens through the tunnel to the shoot's networks are terminated in the agent's netstack and
// dialled for real. It knows nothing of Kubernetes objects.
package vpn

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/internal/connect"
	"github.com/tendril-net/tendril/internal/relay"
	"github.com/tendril-net/tendril/tunnel/netstack"
	"github.com/tendril-net/tendril/tunnel/wg"
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
	// "outbound|1194||vpn-seed-server.<ns>.svc.cluster.local" (required unless Direct).
	Header, Destination string
	// DialTimeout bounds a dial and its CONNECT answer. If zero, 10 s.
	DialTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between reconnects. If zero, 200 ms and 15 s.
	MinBackoff, MaxBackoff time.Duration
	// Keepalive is WireGuard's persistent keepalive from the agent. If zero, 10 s.
	Keepalive time.Duration
	// Log receives the agent's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
}

// Agent keeps one tunnel to the seed.
type Agent struct {
	cfg        Config
	tun        *wg.Tunnel
	connected  atomic.Bool
	reconnects prometheus.Counter
	dialErrors *prometheus.CounterVec
	forwards   *prometheus.CounterVec
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
		return nil, errors.New("vpn: the CONNECT destination (outbound|1194||vpn-seed-server.<ns>.svc.cluster.local) is required")
	}
	if cfg.Header == "" {
		cfg.Header = "Reversed-VPN"
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 200 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 15 * time.Second
	}
	if cfg.Keepalive == 0 {
		cfg.Keepalive = 10 * time.Second
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
	}
	a := &Agent{cfg: cfg}
	a.forwards = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_forwarded_total", Help: "Connections from the seed into the shoot, by outcome (ok, dial_failed, accept_failed).",
	}, []string{"outcome"})
	a.reconnects = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_streams_total", Help: "Tunnel streams established to the seed (more than one: reconnects).",
	})
	a.dialErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tendril_agent_vpn_dial_errors_total", Help: "Failed attempts to reach the seed, by stage (dial, connect).",
	}, []string{"stage"})
	if len(cfg.ShootCIDRs) > 0 {
		// Connections the seed opens to the shoot's networks end in the netstack; each is
		// dialled for real here. Anything else is reset by the netstack.
		wcfg.Forward = netstack.Forward{Prefixes: cfg.ShootCIDRs, Handler: a.forward}
	}
	t, err := wg.New(wcfg)
	if err != nil {
		return nil, fmt.Errorf("vpn: %w", err)
	}
	a.tun = t
	if cfg.Registry != nil {
		cfg.Registry.MustRegister(a.reconnects, a.dialErrors, a.forwards, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tendril_agent_vpn_handshake_age_seconds", Help: "Seconds since the last handshake with the server (-1: none).",
		}, func() float64 {
			if last := a.lastHandshake(); !last.IsZero() {
				return time.Since(last).Seconds()
			}
			return -1
		}))
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
		c, err := a.dial(ctx)
		if err == nil {
			var ep interface{ Done() <-chan struct{} }
			ep, err = a.tun.AttachPeer(c, a.cfg.ServerPublicKey)
			if err == nil {
				a.connected.Store(true)
				a.reconnects.Inc()
				a.cfg.Log.Info("Tunnel stream up", "seed", a.cfg.Seed)
				select {
				case <-ep.Done():
					a.cfg.Log.Info("Tunnel stream ended", "seed", a.cfg.Seed, "after", time.Since(start).Round(time.Millisecond).String())
				case <-ctx.Done():
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
		// A stream that lived a while was healthy: start the backoff over.
		if time.Since(start) > a.cfg.MaxBackoff {
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

// forwardDialTimeout bounds the real dial of a forwarded connection; the seed's own dial through
// the tunnel waits for it (tendril-server's default dial timeout is 10 s).
const forwardDialTimeout = 8 * time.Second

// forward serves one connection from the seed into the shoot: dial the real destination first,
// so that a refused destination is refused through the tunnel too, then relay.
func (a *Agent) forward(ctx context.Context, r *netstack.Request) {
	dctx, cancel := context.WithTimeout(ctx, forwardDialTimeout)
	up, err := (&net.Dialer{}).DialContext(dctx, "tcp", r.Dst().String())
	cancel()
	if err != nil {
		a.forwards.WithLabelValues("dial_failed").Inc()
		a.cfg.Log.V(1).Info("Forwarded dial failed", "destination", r.Dst().String(), "error", err.Error())
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
	relay.Pipe(c, up, time.Hour)
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
	if err := connect.Open(c, "vpn-seed-server:1194", a.cfg.Header, a.cfg.Destination); err != nil {
		a.dialErrors.WithLabelValues("connect").Inc()
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}
