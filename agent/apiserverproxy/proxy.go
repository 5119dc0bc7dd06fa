// Package apiserverproxy is the shoot node agent of GEP-8: it holds kube-apiserver's advertised
// address on a dummy link of the node, accepts in-cluster connections to that address and
// forwards each to the seed ingress, announcing the original destination either with a PROXY v2
// header (the ingress routes by it) or with an HTTP CONNECT carrying X-Gardener-Destination. TLS
// stays end to end between the pod and kube-apiserver. It knows nothing of Kubernetes objects.
package apiserverproxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/pires/go-proxyproto"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/edge/accept"
	"github.com/tendril-net/tendril/edge/connect"
	"github.com/tendril-net/tendril/edge/pipe"
	"github.com/tendril-net/tendril/wire"
)

// Mode is how the agent tells the ingress where a connection was going.
type Mode string

const (
	// ModeProxyProtocol prefixes each connection with a PROXY v2 header (GEP-8).
	ModeProxyProtocol Mode = "proxy-protocol"
	// ModeConnect opens each connection with CONNECT and X-Gardener-Destination (Gardener ≥ 1.130).
	ModeConnect Mode = "connect"
)

// Config configures the agent. AdvertisedAddress and Ingress are required.
type Config struct {
	// AdvertisedAddress is kube-apiserver's --advertise-address, the endpoint of the shoot's
	// "kubernetes" Service.
	AdvertisedAddress netip.Addr
	// Port is the port in-cluster clients dial. If zero, 443.
	Port uint16
	// Ingress is the seed ingress's PROXY/CONNECT listener, host:port.
	Ingress string
	// Mode selects the announcement. If empty, ModeProxyProtocol.
	Mode Mode
	// Namespace is the shoot's namespace in the seed; ModeConnect needs it for the header value.
	Namespace string
	// Interface is the dummy link that holds the address (at most 15 characters). If empty, the
	// address must already be on the node and the agent does not touch links.
	Interface string
	// DialTimeout bounds a dial to the ingress and, in ModeConnect, its answer. If zero, 10 s.
	DialTimeout time.Duration
	// IdleTimeout ends a relayed connection after this long without bytes. If zero, 1 h (the
	// ingress's own idle timeout).
	IdleTimeout time.Duration
	// DrainTimeout is how long connections may continue after shutdown began. If zero, 30 s.
	DrainTimeout time.Duration
	// MaxConnections caps the in-cluster connections forwarded at once; one beyond it is closed
	// at once (outcome too_many). If zero, DefaultMaxConnections; negative: no cap.
	MaxConnections int
	// MaxConnectionsPerSource caps the connections of one source address (a pod; host-network
	// pods share the node's) forwarded at once, so that one client leaking connections cannot
	// take the node's others' places; one beyond it is closed at once (outcome source_limit). If
	// zero, DefaultMaxConnectionsPerSource; negative: no cap.
	MaxConnectionsPerSource int
	// CheckInterval is how often the ingress's reachability (readiness) and the link are
	// checked. If zero, 10 s.
	CheckInterval time.Duration
	// Log receives the agent's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the metrics. If nil, they are not registered.
	Registry prometheus.Registerer
}

// Defaults of the connection bounds (Config).
const (
	// DefaultMaxConnections: each forwarded connection holds two descriptors (the client's and
	// the ingress's), 40,000 at the cap, well inside the 1,048,576 a container runtime commonly
	// allows; the relay splices, so the memory is the kernel's socket buffers.
	DefaultMaxConnections = 20000
	// DefaultMaxConnectionsPerSource: a client holds one connection or a few (client-go
	// multiplexes its requests over HTTP/2), so 1,000 is far beyond any pod's need and leaves
	// 19,000 places to the others when one pod leaks connections.
	DefaultMaxConnectionsPerSource = 1000
)

// bound is the value of a bound: n, def when n is zero, no cap (0) when n is negative.
func bound(n, def int) int {
	switch {
	case n == 0:
		return def
	case n < 0:
		return 0
	}
	return n
}

func (c *Config) defaults() error {
	if !c.AdvertisedAddress.IsValid() {
		return errors.New("apiserver-proxy: an advertised address is required")
	}
	if c.Ingress == "" {
		return errors.New("apiserver-proxy: the ingress address is required")
	}
	c.Port = cmp.Or(c.Port, 443)
	switch c.Mode {
	case "":
		c.Mode = ModeProxyProtocol
	case ModeProxyProtocol:
	case ModeConnect:
		if c.Namespace == "" {
			return errors.New("apiserver-proxy: connect mode needs the shoot namespace")
		}
	default:
		return fmt.Errorf("apiserver-proxy: unknown mode %q (proxy-protocol, connect)", c.Mode)
	}
	if len(c.Interface) > 15 {
		return fmt.Errorf("apiserver-proxy: interface name %q longer than 15 characters", c.Interface)
	}
	c.DialTimeout = cmp.Or(c.DialTimeout, 10*time.Second)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, time.Hour)
	c.DrainTimeout = cmp.Or(c.DrainTimeout, 30*time.Second)
	c.CheckInterval = cmp.Or(c.CheckInterval, 10*time.Second)
	return nil
}

// Agent forwards connections to the advertised address to the ingress.
type Agent struct {
	cfg     Config
	metrics *metrics
	ready   atomic.Bool
	// refusals logs the connections refused for a bound without letting a flood flood the log.
	refusals *accept.LimitedLog
}

// New validates cfg and returns an agent.
func New(cfg Config) (*Agent, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	return &Agent{cfg: cfg, metrics: newMetrics(cfg.Registry), refusals: &accept.LimitedLog{Log: cfg.Log}}, nil
}

// Ready reports whether the ingress answered the last check.
func (a *Agent) Ready() bool { return a.ready.Load() }

// Run sets up the link, listens on the advertised address and forwards until ctx ends; then it
// stops accepting, lets open connections finish for up to DrainTimeout, and closes the rest.
// The address stays on the link: in-cluster clients keep reaching it across agent restarts.
func (a *Agent) Run(ctx context.Context) error {
	if a.cfg.Interface != "" {
		if err := ensureAddress(a.cfg.Interface, a.cfg.AdvertisedAddress); err != nil {
			return err
		}
	}
	addr := netip.AddrPortFrom(a.cfg.AdvertisedAddress, a.cfg.Port).String()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("apiserver-proxy: listen on %s: %w", addr, err)
	}
	a.cfg.Log.Info("Forwarding", "address", addr, "ingress", a.cfg.Ingress, "mode", string(a.cfg.Mode))
	return a.Serve(ctx, l)
}

// Serve is Run with the listener already bound.
func (a *Agent) Serve(ctx context.Context, l net.Listener) error {
	checkCtx, stopCheck := context.WithCancel(ctx)
	checked := make(chan struct{})
	go func() {
		defer close(checked)
		a.routineCheck(checkCtx)
	}()
	defer func() {
		stopCheck()
		<-checked
	}()
	// On shutdown open connections may finish; after the drain timeout they are closed.
	s := &accept.Server{
		Handle: a.forward, DrainTimeout: a.cfg.DrainTimeout, Log: a.cfg.Log,
		Max:          bound(a.cfg.MaxConnections, DefaultMaxConnections),
		MaxPerSource: bound(a.cfg.MaxConnectionsPerSource, DefaultMaxConnectionsPerSource),
		Refused: func(c net.Conn, reason string) {
			a.metrics.connections.WithLabelValues(reason).Inc()
			a.refusals.Info("Connection refused", "client", c.RemoteAddr().String(), "reason", reason)
		},
	}
	if err := s.Serve(ctx, l); err != nil {
		return fmt.Errorf("apiserver-proxy: accept: %w", err)
	}
	return nil
}

// forward relays one in-cluster connection through the ingress.
func (a *Agent) forward(ctx context.Context, c net.Conn, conns *accept.Conns) {
	start := time.Now()
	up, err := a.dialIngress(context.WithoutCancel(ctx), c)
	a.metrics.dialSeconds.Observe(time.Since(start).Seconds())
	if err != nil {
		a.metrics.connections.WithLabelValues("dial_failed").Inc()
		a.cfg.Log.Info("Ingress unreachable, connection closed", "client", c.RemoteAddr().String(), "error", err.Error())
		return
	}
	if !conns.Add(up) {
		return // shutting down: up is closed
	}
	defer conns.Remove(up)
	a.metrics.connections.WithLabelValues("forwarded").Inc()
	a.metrics.active.Inc()
	defer a.metrics.active.Dec()
	toUp, toDown := pipe.Pipe(c, up, a.cfg.IdleTimeout)
	a.metrics.bytes.WithLabelValues("upstream").Add(float64(toUp))
	a.metrics.bytes.WithLabelValues("downstream").Add(float64(toDown))
}

// dialIngress connects to the ingress and announces c's destination.
func (a *Agent) dialIngress(ctx context.Context, c net.Conn) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	up, err := (&net.Dialer{}).DialContext(ctx, "tcp", a.cfg.Ingress)
	if err != nil {
		return nil, err
	}
	deadline, _ := ctx.Deadline()
	_ = up.SetDeadline(deadline)
	switch a.cfg.Mode {
	case ModeConnect:
		err = a.connect(up)
	default:
		h := proxyproto.HeaderProxyFromAddrs(2, c.RemoteAddr(), c.LocalAddr())
		_, err = h.WriteTo(up)
	}
	if err != nil {
		up.Close()
		return nil, err
	}
	_ = up.SetDeadline(time.Time{})
	return up, nil
}

// APIServerDestination is the X-Gardener-Destination value for shoot ns's kube-apiserver.
func APIServerDestination(ns string) string { return wire.APIServerWireName(ns) }

// connect opens a CONNECT tunnel on up to the shoot's kube-apiserver. The request target must be
// an authority (host:port); the header routes.
func (a *Agent) connect(up net.Conn) error {
	return connect.Open(up, "kube-apiserver."+a.cfg.Namespace+".svc.cluster.local:443",
		wire.GardenerDestinationHeader, wire.APIServerWireName(a.cfg.Namespace))
}

// routineCheck keeps readiness (the ingress accepts TCP) and the link's address up to date.
func (a *Agent) routineCheck(ctx context.Context) {
	t := time.NewTicker(a.cfg.CheckInterval)
	defer t.Stop()
	for {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
		c, err := (&net.Dialer{}).DialContext(cctx, "tcp", a.cfg.Ingress)
		cancel()
		if err == nil {
			c.Close()
		}
		if ready := err == nil; ready != a.ready.Swap(ready) {
			a.cfg.Log.Info("Ingress reachability changed", "ready", ready)
		}
		if a.cfg.Interface != "" {
			// Something else (a network plugin, an operator) may have removed the address.
			if err := ensureAddress(a.cfg.Interface, a.cfg.AdvertisedAddress); err != nil {
				a.cfg.Log.Error(err, "Restoring the advertised address failed")
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

type metrics struct {
	connections *prometheus.CounterVec
	active      prometheus.Gauge
	bytes       *prometheus.CounterVec
	dialSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		connections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_apiserver_proxy_connections_total", Help: "In-cluster connections, by outcome (forwarded, dial_failed; refused: too_many, source_limit).",
		}, []string{"outcome"}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tendril_apiserver_proxy_active_connections", Help: "Connections being forwarded.",
		}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tendril_apiserver_proxy_bytes_total", Help: "Bytes forwarded, by direction, counted when a connection ends.",
		}, []string{"direction"}),
		dialSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "tendril_apiserver_proxy_dial_seconds", Help: "Time to connect to the ingress and announce the destination.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
	}
	if reg != nil {
		reg.MustRegister(m.connections, m.active, m.bytes, m.dialSeconds)
	}
	return m
}
