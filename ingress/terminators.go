package ingress

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tendril-net/tendril/ingress/terminate"
)

// terminators runs one terminate.Proxy per terminating shoot (per internal listener), built
// from the configuration after each change: created when its listener, clusters and secrets are
// all there, updated (new handshakes and requests see the change, nothing open is reset) when
// one of them changes, shut down when its listener goes.
type terminators struct {
	log logr.Logger
	// netHTTP2: HTTP/2 clients are served by net/http, not h2relay (Config.TerminateNetHTTP2).
	netHTTP2 bool
	mu       sync.Mutex
	// running are the proxies by listener name; closed refuses new ones once the ingress stops.
	running map[string]*runningProxy
	closed  bool
	// serving counts the proxies' Serve goroutines.
	serving sync.WaitGroup
	// stopping are the proxies shutting down, by their listener; retired the counts of those
	// that have, by listener, so that the exported counters never go back.
	stopping map[*terminate.Proxy]string
	retired  map[string]terminate.Counts
}

type runningProxy struct {
	p   *terminate.Proxy
	cfg terminate.Config
	in  terminateInputs
}

// terminateInputs are what a proxy was built from, compared to skip an Update when a change
// elsewhere left them as they were (an Update closes the proxy's idle upstream connections).
type terminateInputs struct {
	tc                              *terminateConfig
	cl, upgrade                     *clusterConfig
	serving, clientCA, front, apiCA *secretConfig
	endpoints                       []netip.AddrPort
}

func (a terminateInputs) equal(b terminateInputs) bool {
	return a.tc == b.tc && a.cl == b.cl && a.upgrade == b.upgrade && a.serving == b.serving && a.clientCA == b.clientCA &&
		a.front == b.front && a.apiCA == b.apiCA && slices.Equal(a.endpoints, b.endpoints)
}

func newTerminators(log logr.Logger, netHTTP2 bool) *terminators {
	return &terminators{log: log, netHTTP2: netHTTP2, running: map[string]*runningProxy{}, stopping: map[*terminate.Proxy]string{}, retired: map[string]terminate.Counts{}}
}

// get returns the proxy of an internal listener, nil while it has none.
func (ts *terminators) get(listener string) *terminate.Proxy {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if r := ts.running[listener]; r != nil {
		return r.p
	}
	return nil
}

// sync brings the proxies in line with cfg. A terminating listener whose parts are not all
// there yet (its secrets arrive separately) is logged and served once they are.
func (ts *terminators) sync(cfg *config) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.closed {
		return
	}
	for name, r := range ts.running {
		if cfg.terminates[name] == nil {
			delete(ts.running, name)
			ts.stop(name, r)
			ts.log.Info("Terminating listener removed", "listener", name)
		}
	}
	for name, tc := range cfg.terminates {
		in, err := cfg.terminateShoot(tc)
		if err != nil {
			ts.log.Info("Terminating listener not served yet", "listener", name, "reason", err.Error())
			continue
		}
		pcfg := terminate.Config{
			Log:              ts.log.WithValues("listener", name),
			HandshakeTimeout: tc.headersTimeout,
			IdleTimeout:      tc.idleTimeout,
			MaxHeaderBytes:   tc.maxHeaderBytes,
			DialTimeout:      in.cl.connectTimeout,
			NetHTTP2:         ts.netHTTP2,
		}
		r := ts.running[name]
		switch {
		case r != nil && r.cfg.HandshakeTimeout == pcfg.HandshakeTimeout && r.cfg.IdleTimeout == pcfg.IdleTimeout &&
			r.cfg.MaxHeaderBytes == pcfg.MaxHeaderBytes && r.cfg.DialTimeout == pcfg.DialTimeout:
			if r.in.equal(in) {
				continue
			}
			if err := r.p.Update(in.shoot()); err != nil {
				ts.log.Error(err, "Updating a terminating listener failed; it serves its previous configuration", "listener", name)
				continue
			}
			r.in = in
		default:
			// New, or its limits changed (they are the proxy's own): a new proxy takes the new
			// connections and the old one finishes its own.
			p, err := terminate.New(pcfg, in.shoot())
			if err != nil {
				ts.log.Error(err, "Starting a terminating listener failed", "listener", name)
				continue
			}
			if r != nil {
				ts.stop(name, r)
			}
			ts.running[name] = &runningProxy{p: p, cfg: pcfg, in: in}
			ts.serving.Go(func() { _ = p.Serve(nil) })
			ts.log.Info("Terminating listener serving", "listener", name, "replicas", len(in.endpoints))
		}
	}
}

// stop shuts r down in the background: its requests in flight finish and its idle connections
// close. What stays open (a watch, an exec) is the ingress's to end: its connections are in
// the SNI server's handed set, which a drain closes at its timeout.
// ts.mu is held.
func (ts *terminators) stop(name string, r *runningProxy) {
	ts.stopping[r.p] = name
	ts.serving.Go(func() {
		_ = r.p.Shutdown(context.Background())
		ts.mu.Lock()
		delete(ts.stopping, r.p)
		ts.retired[name] = ts.retired[name].Add(r.p.Counts())
		ts.mu.Unlock()
	})
}

// parked are the parked connections of every listener's proxies that still serve.
func (ts *terminators) parked() map[string]int64 {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	out := make(map[string]int64, len(ts.running))
	for name, r := range ts.running {
		out[name] += r.p.Parked()
	}
	for p, name := range ts.stopping {
		out[name] += p.Parked()
	}
	return out
}

// counts are the counters of every listener's proxies, running and retired.
func (ts *terminators) counts() map[string]terminate.Counts {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	out := make(map[string]terminate.Counts, len(ts.running)+len(ts.retired))
	for name, c := range ts.retired {
		out[name] = c
	}
	for name, r := range ts.running {
		out[name] = out[name].Add(r.p.Counts())
	}
	for p, name := range ts.stopping {
		out[name] = out[name].Add(p.Counts())
	}
	return out
}

// drain starts shutting every proxy down, for the ingress's drain: idle client connections
// close at once, HTTP/2 ones are told to go away (GOAWAY), requests in flight finish; what is
// left when the drain times out is closed with the rest. No proxy starts after it.
func (ts *terminators) drain() {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.closed = true
	for name, r := range ts.running {
		ts.stop(name, r)
	}
	ts.running = map[string]*runningProxy{}
}

// close drains and waits for every proxy; the ingress calls it once its connections have
// ended or been closed.
func (ts *terminators) close() {
	ts.drain()
	ts.serving.Wait()
}

// terminateShoot gathers what tc's proxy needs from the configuration.
func (c *config) terminateShoot(tc *terminateConfig) (terminateInputs, error) {
	in := terminateInputs{tc: tc, cl: c.clusters[tc.cluster], upgrade: c.clusters[tc.upgradeCluster]}
	switch {
	case in.cl == nil || in.cl.upstream == nil || !in.cl.upstream.http2:
		return in, fmt.Errorf("no HTTP/2 upstream cluster %q", tc.cluster)
	case in.upgrade == nil || in.upgrade.upstream == nil || in.upgrade.upstream.http2:
		return in, fmt.Errorf("no HTTP/1.1 upstream cluster %q", tc.upgradeCluster)
	case in.cl.service != in.upgrade.service || in.cl.upstream.certSecret != in.upgrade.upstream.certSecret ||
		in.cl.upstream.caSecret != in.upgrade.upstream.caSecret || in.cl.upstream.name != in.upgrade.upstream.name:
		// One proxy carries both: requests and upgrades go to the same replicas the same way.
		return in, errors.New("the HTTP/2 and HTTP/1.1 clusters differ in endpoints or TLS")
	}
	var err error
	secret := func(name string, cert bool) *secretConfig {
		s := c.secrets[name]
		if s == nil || cert && s.cert == nil || !cert && s.cas == nil {
			err = errors.Join(err, fmt.Errorf("no secret %q", name))
			return nil
		}
		return s
	}
	in.serving, in.clientCA = secret(tc.servingSecret, true), secret(tc.clientCASecret, false)
	in.front, in.apiCA = secret(in.cl.upstream.certSecret, true), secret(in.cl.upstream.caSecret, false)
	if err != nil {
		return in, err
	}
	in.endpoints = c.upstreams(in.cl)
	return in, nil
}

// shoot is the proxy's view of the inputs: built only when a proxy is created or updated, not on
// every configuration change that leaves a shoot as it was.
func (in terminateInputs) shoot() terminate.Shoot {
	s := terminate.Shoot{
		Serving: *in.serving.cert, ClientCAs: in.clientCA.cas,
		FrontProxy: *in.front.cert, UpstreamCAs: in.apiCA.cas, UpstreamName: in.cl.upstream.name,
	}
	for _, e := range in.endpoints {
		s.Upstreams = append(s.Upstreams, e.String())
	}
	return s
}

// replayConn is a connection handed off after the loop read its ClientHello: those bytes are
// read again first. Its Close ends the ingress's tracking of it, once.
type replayConn struct {
	net.Conn
	r       io.Reader
	once    sync.Once
	onClose func()
}

func (c *replayConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// NetConn is the connection under c: the relay parks a quiet client connection on its socket.
func (c *replayConn) NetConn() net.Conn { return c.Conn }

func (c *replayConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.onClose)
	return err
}

func newReplayConn(c net.Conn, first []byte, onClose func()) *replayConn {
	return &replayConn{Conn: c, r: io.MultiReader(bytes.NewReader(first), c), onClose: onClose}
}

// terminateCollector exports the terminating proxies' counters.
type terminateCollector struct {
	ts                        *terminators
	refused, stripped, parked *prometheus.Desc
}

func newTerminateCollector(ts *terminators) *terminateCollector {
	return &terminateCollector{ts: ts,
		refused: prometheus.NewDesc("tendril_ingress_terminate_refused_requests_total",
			"Requests and connections of terminating shoots that did not reach kube-apiserver, by internal listener and reason.", []string{"listener", "reason"}, nil),
		stripped: prometheus.NewDesc("tendril_ingress_terminate_stripped_requests_total",
			"Requests of terminating shoots whose client-sent X-Remote-* headers were dropped, by internal listener.", []string{"listener"}, nil),
		parked: prometheus.NewDesc("tendril_ingress_terminate_parked_connections",
			"HTTP/2 client connections of terminating shoots that are parked (quiet, without a reader goroutine), by internal listener.", []string{"listener"}, nil),
	}
}

func (c *terminateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.refused
	ch <- c.stripped
	ch <- c.parked
}

func (c *terminateCollector) Collect(ch chan<- prometheus.Metric) {
	for name, n := range c.ts.counts() {
		for reason, v := range map[string]uint64{"handshake_failed": n.Handshake, "smuggling": n.Smuggling, "bad_certificate": n.BadCertificate,
			"no_upstream": n.NoUpstream, "upstream_failed": n.Upstream} {
			ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(v), name, reason)
		}
		ch <- prometheus.MustNewConstMetric(c.stripped, prometheus.CounterValue, float64(n.Stripped), name)
	}
	for name, n := range c.ts.parked() {
		ch <- prometheus.MustNewConstMetric(c.parked, prometheus.GaugeValue, float64(n), name)
	}
}
