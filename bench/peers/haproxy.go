package peers

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// HAProxy runs the distribution's haproxy for a Job, one backend per route:
//
//   - JobSNI, TCP mode: the frontend waits for the ClientHello
//     (tcp-request inspect-delay) and picks the backend with req_ssl_sni.
//   - JobProxy, TCP mode: the bind line has accept-proxy, so the PROXY
//     header's addresses stand for the connection's own everywhere but in
//     "tcp-request connection" rules (configuration manual, accept-proxy):
//     the dst and dst_port fetches return the header's destination, and
//     "use_backend X if { dst A } { dst_port 443 }" picks the backend.
//   - JobConnect, HTTP mode: "use_backend X if METH_CONNECT
//     { req.hdr(X-Gardener-Destination) -m str … }". HAProxy is a reverse
//     proxy, not a CONNECT endpoint: it forwards the CONNECT request to the
//     chosen server and tunnels only after that server answers 2xx. An
//     upstream TLS server does not, so HAProxy 2.6 answers 502 and this job
//     does not work with it; the configuration exists to show that by trying.
//
// The zero value does JobSNI with "haproxy" from PATH, DefaultTimeouts and
// one thread per CPU.
type HAProxy struct {
	Bin      string   // path or name in PATH; "" means "haproxy"
	Job      Job      // "" means JobSNI
	Timeouts Timeouts // zero means DefaultTimeouts
	Threads  int      // nbthread; 0 means one per CPU
	// MaxConn is the global maxconn; 0 means 8192. HAProxy raises its own
	// descriptor limit to about twice this (two sockets per connection).
	MaxConn int
}

var _ Peer = HAProxy{}

// HAProxyConfig is the data for haproxy.cfg.tmpl.
type HAProxyConfig struct {
	Job      Job    // "" means JobSNI
	Listen   string // ip:port of the frontend
	Threads  int
	MaxConn  int
	Timeouts Timeouts
	Routes   []Route
}

// RenderHAProxy renders the HAProxy configuration for c.
func RenderHAProxy(c HAProxyConfig) (string, error) {
	if c.Job == "" {
		c.Job = JobSNI
	}
	if err := validateRoutes(c.Routes); err != nil {
		return "", err
	}
	switch c.Job {
	case JobSNI, JobConnect:
	case JobProxy:
		for _, r := range c.Routes {
			if !r.Advertised.IsValid() {
				return "", fmt.Errorf("route %s: no advertised address to route PROXY headers by", r.Name)
			}
		}
	default:
		return "", fmt.Errorf("haproxy: unknown job %q", c.Job)
	}
	return render(haproxyTmpl, c)
}

// Name implements Peer.
func (HAProxy) Name() string { return "haproxy" }

func (h HAProxy) bin() (string, error) { return lookBin(h.Bin, "haproxy", "haproxy") }

// Check implements Peer.
func (h HAProxy) Check(context.Context) error {
	_, err := h.bin()
	return err
}

// Config returns the configuration Start would write for routes on listen.
func (h HAProxy) Config(listen string, routes []Route) (string, error) {
	threads := h.Threads
	if threads <= 0 {
		threads = cores()
	}
	conns := h.MaxConn
	if conns <= 0 {
		conns = maxConn
	}
	return RenderHAProxy(HAProxyConfig{Job: h.Job, Listen: listen, Threads: threads, MaxConn: conns, Timeouts: h.Timeouts.orDefault(), Routes: routes})
}

// CheckConfig runs "haproxy -c -f path".
func (h HAProxy) CheckConfig(ctx context.Context, path string) error {
	bin, err := h.bin()
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, bin, "-c", "-f", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("haproxy -c -f %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Version returns the first line of "haproxy -v".
func (h HAProxy) Version(ctx context.Context) string {
	return versionOf(ctx, h.bin, "-v")
}

// Start implements Peer: "haproxy -db -f dir/haproxy.cfg" in the foreground.
func (h HAProxy) Start(ctx context.Context, dir string, routes []Route) (*Instance, error) {
	bin, err := h.bin()
	if err != nil {
		return nil, err
	}
	return fileStart{name: "haproxy", bin: bin, version: h.Version(ctx), dir: dir, file: "haproxy.cfg", ready: 10 * time.Second,
		config: func(addr string) (string, error) { return h.Config(addr, routes) },
		args:   func(_, path string) []string { return []string{"-db", "-f", path} },
	}.start(ctx)
}
