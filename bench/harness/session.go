package harness

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/tendril-net/tendril/bench/internal/inflight"
	"github.com/tendril-net/tendril/bench/peers"
)

// session is a run's shoots: the CA, the upstream TLS servers, the routes to
// them, the client that reaches them through a data plane, and the temporary
// directory the peers' files go to. Run measures rate and bulk over one;
// Session lends one to a mode that measures something else (idle).
type session struct {
	client *client
	ups    upstreams
	names  []string
	routes []peers.Route
	tmp    string
}

// newSession starts cfg.Shoots upstreams and makes the client for them.
// Close stops the upstreams and removes the temporary directory.
func newSession(cfg Config, name string) (*session, error) {
	var names, hosts []string
	for i := range cfg.Shoots {
		names, hosts = append(names, ShootName(i)), append(hosts, ShootHost(i))
	}
	p, err := newPKI(hosts)
	if err != nil {
		return nil, fmt.Errorf("test PKI: %w", err)
	}
	ups, err := startUpstreams(p, hosts, cfg.Payload, cfg.BulkBytes)
	if err != nil {
		return nil, err
	}
	var routes []peers.Route
	for i, u := range ups {
		routes = append(routes, peers.Route{Name: names[i], Host: hosts[i], Upstream: u.addr(), Advertised: ShootAdvertised(i)})
	}
	tmp, err := os.MkdirTemp("", "tendril-bench-"+name+"-")
	if err != nil {
		ups.Close()
		return nil, fmt.Errorf("temporary directory: %w", err)
	}
	// A peer that drops root (squid) reaches its own directory inside.
	if err := os.Chmod(tmp, 0o711); err != nil {
		ups.Close()
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("temporary directory: %w", err)
	}
	return &session{client: newClient(p, routes, cfg.Payload, cfg.BulkBytes), ups: ups, names: names, routes: routes, tmp: tmp}, nil
}

// Close stops the upstreams (aborting their connections) and removes the
// temporary directory.
func (s *session) Close() {
	s.ups.Close()
	os.RemoveAll(s.tmp)
}

// Session is the shoots of a mode other than rate and bulk, which holds
// connections through the same targets with the same client, upstreams and
// routes as Run: the idle mode. Targets of several Modes (listeners) can be
// started from one Session, one after another; the upstreams are shared.
type Session struct {
	cfg Config
	s   *session
}

// NewSession starts cfg.Shoots upstreams (4 if 0) and the client. The caller
// closes the Session after stopping its targets.
func NewSession(cfg Config) (*Session, error) {
	cfg.Shoots = cmp.Or(cfg.Shoots, 4)
	if cfg.Shoots < 1 || cfg.Shoots > 1000 {
		return nil, fmt.Errorf("shoots %d: want 1..1000", cfg.Shoots)
	}
	cfg.Payload = cmp.Or(cfg.Payload, 64)
	cfg.BulkBytes = cmp.Or(cfg.BulkBytes, 1)
	cfg.BinDir = cmp.Or(cfg.BinDir, "bin")
	s, err := newSession(cfg, "session")
	if err != nil {
		return nil, err
	}
	return &Session{cfg: cfg, s: s}, nil
}

// Close stops the upstreams, which closes what the targets' connections to
// them left open, and removes the peers' files.
func (s *Session) Close() { s.s.Close() }

// Routes are the shoots' routes, as every target gets them.
func (s *Session) Routes() []peers.Route { return s.s.routes }

// Upstreams are the upstreams' counters so far.
func (s *Session) Upstreams() []UpstreamStats { return s.s.ups.stats(s.s.names) }

// Target is a running data plane of a Session.
type Target struct {
	t *target
	// TLS names the parameters the readiness probe negotiated.
	TLS string
}

// Name is the target's name ("tendril").
func (t *Target) Name() string { return t.t.name }

// Instance is the running peer.
func (t *Target) Instance() *peers.Instance { return t.t.inst }

// Stop stops the target's processes.
func (t *Target) Stop() error { return t.t.inst.Stop() }

// Start starts the target name of mode (not TargetDirect), with its files in
// a directory of its own, and waits until every route works through it, as
// Run does. It returns nil and the reason in info.Skipped if the target
// cannot run here.
func (s *Session) Start(ctx context.Context, mode Mode, name string, progress io.Writer) (*Target, TargetInfo) {
	if name == TargetDirect {
		return nil, TargetInfo{Name: name, Skipped: "direct has no data plane"}
	}
	rep := &Report{}
	r := &runner{cfg: s.cfg, mode: mode, client: s.s.client, progress: progress, report: rep}
	dir, err := os.MkdirTemp(s.s.tmp, mode.Name+"-")
	if err != nil {
		return nil, TargetInfo{Name: name, Skipped: fmt.Sprintf("temporary directory: %v", err)}
	}
	t, info := r.startTarget(ctx, name, s.s.ups, dir, s.s.routes)
	if t == nil {
		return nil, info
	}
	return &Target{t: t, TLS: rep.Settings.TLS}, info
}

// reqEcho asks an upstream to answer with the same byte and then echo every
// byte it reads, without a deadline, until the client closes: a connection
// that stays idle between pings.
const reqEcho byte = 'e'

// Held is a connection held open through a target: TLS end to end with the
// shoot's upstream, which echoes.
type Held struct {
	raw net.Conn
	tc  *tls.Conn
	buf [1]byte
}

// Hold opens a connection to shoot i through t (preamble, verified
// handshake), switches the upstream to echoing and checks its first answer,
// all within timeout, and returns the connection, idle and without a
// deadline. A failure's reason is FailureReason(err).
func (s *Session) Hold(ctx context.Context, t *Target, i int, timeout time.Duration) (*Held, error) {
	var sl inflight.Slot
	raw, tc, err := s.s.client.connect(ctx, t.t, i, &sl, time.Now().Add(timeout))
	if err != nil {
		return nil, err
	}
	h := &Held{raw: raw, tc: tc}
	if _, err := tc.Write([]byte{reqEcho}); err != nil {
		raw.Close()
		return nil, fail(reasonWrite, err)
	}
	if err := h.readEcho(reqEcho); err != nil {
		raw.Close()
		return nil, err
	}
	if err := raw.SetDeadline(time.Time{}); err != nil {
		raw.Close()
		return nil, fail(reasonRead, err)
	}
	return h, nil
}

func (h *Held) readEcho(want byte) error {
	if _, err := io.ReadFull(h.tc, h.buf[:]); err != nil {
		return fail(reasonRead, err)
	}
	if h.buf[0] != want {
		return fail(reasonRead, fmt.Errorf("echo %q, want %q", h.buf[0], want))
	}
	return nil
}

// pingByte is what Ping sends; the upstream sends it back.
const pingByte byte = 'p'

// Ping sends one byte through the connection and waits up to timeout for
// the upstream's echo; the connection is idle again afterwards.
func (h *Held) Ping(timeout time.Duration) error {
	if err := h.raw.SetDeadline(time.Now().Add(timeout)); err != nil {
		return fail(reasonWrite, err)
	}
	if _, err := h.tc.Write([]byte{pingByte}); err != nil {
		return fail(reasonWrite, err)
	}
	if err := h.readEcho(pingByte); err != nil {
		return err
	}
	return h.raw.SetDeadline(time.Time{})
}

// Close closes the connection (the TCP connection: the upstream reads EOF).
func (h *Held) Close() error { return h.raw.Close() }

// FailureReason classifies an error of Hold or Ping: "dial", "proxy",
// "handshake", "verify", "write", "read", ….
func FailureReason(err error) string {
	var ce *connError
	if errors.As(err, &ce) {
		return ce.reason.String()
	}
	return "other"
}
