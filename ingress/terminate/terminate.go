// Package terminate is the ingress's terminating mode for one shoot's kube-apiserver: it ends the
// client's TLS with the shoot's serving certificate, checks a client certificate against the
// shoot's client CA and passes the user and groups it names on in kube-apiserver's
// authenticating-proxy headers (X-Remote-User, X-Remote-Group), and sends each request on its own
// to the kube-apiserver replica with the fewest requests in flight, over HTTP/2 and with the
// front-proxy client certificate that kube-apiserver's --requestheader-client-ca-file trusts.
// So one client's requests spread over the replicas, where SNI passthrough pins a connection,
// and all its requests, to one.
//
// What a client sends in X-Remote-* headers never reaches kube-apiserver: the front-proxy
// certificate makes kube-apiserver believe those headers, so only this package may write them.
// A bearer token goes through untouched, and kube-apiserver authenticates it; a request without
// either goes through as it came (kube-apiserver decides about anonymous access). Upgrades
// (exec, attach, port-forward over SPDY or WebSocket) go to kube-apiserver over HTTP/1.1, the
// only protocol they upgrade from; watches stream.
//
// It does not pick the shoot (the SNI listener does, from the ClientHello), does not parse or
// verify tokens, authorizes nothing, and keeps no state per request beyond its upstream's count.
package terminate

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"

	"github.com/tendril-net/tendril/ingress/h2relay"
	"github.com/tendril-net/tendril/wire"
)

// Authenticating-proxy headers, as kube-apiserver's --requestheader-username-headers,
// --requestheader-group-headers and --requestheader-extra-headers-prefix name them (Gardener
// sets these three for its own front proxy).
const (
	HeaderUser  = wire.RemoteUserHeader
	HeaderGroup = wire.RemoteGroupHeader
	// HeaderCredentialID carries the certificate's credential id as an extra (set as written:
	// http.Header would canonicalize it, which kube-apiserver would lower-case all the same).
	HeaderCredentialID = wire.CredentialIDHeader
	HeaderExtraPrefix  = wire.RemoteExtraHeaderPrefix
	// headerPrefix covers all three: whatever a client sends under it is dropped.
	headerPrefix = wire.RemoteHeaderPrefix
)

// Shoot is what one shoot's terminating route needs. It is read whole at every handshake and
// request; Proxy.Update swaps it.
type Shoot struct {
	// Serving is the shoot's kube-apiserver serving certificate and key.
	Serving tls.Certificate
	// ClientCAs verify client certificates (the shoot's client CA bundle).
	ClientCAs *x509.CertPool
	// Upstreams are the kube-apiserver replicas, "host:port".
	Upstreams []string
	// FrontProxy is the client certificate presented to kube-apiserver.
	FrontProxy tls.Certificate
	// UpstreamCAs verify kube-apiserver's serving certificate, for the name UpstreamName.
	UpstreamCAs  *x509.CertPool
	UpstreamName string
}

// Config tunes the Proxy; its zero value works.
type Config struct {
	// Log receives a line per refused request and upstream failure.
	Log logr.Logger
	// HandshakeTimeout bounds a client's TLS handshake and its request headers (default 10 s).
	HandshakeTimeout time.Duration
	// IdleTimeout closes a client connection without requests for this long (default 1 h,
	// kube-apiserver's own keep-alive order of magnitude).
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's header block (default 1 MiB, as kube-apiserver's);
	// a larger one gets 431.
	MaxHeaderBytes int
	// DialTimeout bounds a connection to a replica (default 10 s).
	DialTimeout time.Duration
	// NetHTTP2 serves HTTP/2 clients with net/http's server and forwardH2 instead of h2relay
	// (frame by frame, the default).
	NetHTTP2 bool
}

// Proxy serves one shoot's terminating route. Its methods may be called concurrently.
type Proxy struct {
	cfg   Config
	state atomic.Pointer[state]
	srv   *http.Server
	conns chan net.Conn // connections after their handshake, taken by the server's Accept

	// ctx ends at Shutdown; hsMu orders ServeConn's check of it with Shutdown's cancel, so
	// that no handshake starts after Serve stopped waiting for them.
	ctx        context.Context
	cancel     context.CancelFunc
	hsMu       sync.Mutex
	handshakes sync.WaitGroup

	// outstanding counts requests in flight per upstream address; an address keeps its count
	// across updates, so a replica that stays keeps its load.
	mu          sync.Mutex
	outstanding map[string]*atomic.Int64
	relay       *h2relay.Relay
	relayUps    map[string]*h2relay.Upstream
	next        atomic.Uint64 // where the tie-break starts

	// Refused counts requests refused here, by reason; Stripped requests whose X-Remote-*
	// headers were dropped.
	Refused  refusals
	Stripped atomic.Uint64
}

// refusals are the counted reasons a request does not reach kube-apiserver.
type refusals struct {
	Handshake      atomic.Uint64 // the TLS handshake failed or took longer than HandshakeTimeout
	Smuggling      atomic.Uint64 // both Content-Length and Transfer-Encoding (400), and what followed
	BadCertificate atomic.Uint64 // a client certificate the client CA does not verify (401)
	NoUpstream     atomic.Uint64 // no replica configured (503)
	Upstream       atomic.Uint64 // the replica failed (502)
}

// Counts are a Proxy's counters at one moment.
type Counts struct {
	// Refused by reason (the refusals' fields); Stripped as Proxy.Stripped.
	Handshake, Smuggling, BadCertificate, NoUpstream, Upstream, Stripped uint64
}

// Add returns the sum of c and o.
func (c Counts) Add(o Counts) Counts {
	return Counts{c.Handshake + o.Handshake, c.Smuggling + o.Smuggling, c.BadCertificate + o.BadCertificate,
		c.NoUpstream + o.NoUpstream, c.Upstream + o.Upstream, c.Stripped + o.Stripped}
}

// Parked is how many of the proxy's HTTP/2 client connections are parked: quiet, their reader
// goroutine given up until the socket is readable (h2relay).
func (p *Proxy) Parked() int64 {
	if p.relay == nil {
		return 0
	}
	return p.relay.Parked()
}

// Counts reads the counters.
func (p *Proxy) Counts() Counts {
	r := &p.Refused
	return Counts{r.Handshake.Load(), r.Smuggling.Load(), r.BadCertificate.Load(), r.NoUpstream.Load(), r.Upstream.Load(), p.Stripped.Load()}
}

// state is one Shoot made ready: its TLS configuration and its transports.
type state struct {
	shoot     Shoot
	tls       *tls.Config
	upstreams []upstream
	h2, h1    *http.Transport
}

type upstream struct {
	addr        string
	outstanding *atomic.Int64
}

// New returns a Proxy for s.
func New(cfg Config, s Shoot) (*Proxy, error) {
	cfg.HandshakeTimeout = cmp.Or(cfg.HandshakeTimeout, 10*time.Second)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, time.Hour)
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, 10*time.Second)
	cfg.MaxHeaderBytes = cmp.Or(cfg.MaxHeaderBytes, 1<<20)
	p := &Proxy{cfg: cfg, conns: make(chan net.Conn), outstanding: map[string]*atomic.Int64{}, relayUps: map[string]*h2relay.Upstream{}}
	if !cfg.NetHTTP2 {
		p.relay = h2relay.New(h2relay.Config{Log: cfg.Log, MaxHeaderListSize: uint32(cfg.MaxHeaderBytes), IdleTimeout: cfg.IdleTimeout,
			BadGateway: statusAnswer(http.StatusBadGateway, "InternalError", "kube-apiserver replica failed"),
			OnUpstreamFailure: func(err error) {
				p.Refused.Upstream.Add(1)
				p.cfg.Log.Info("kube-apiserver replica failed", "error", err.Error())
			}})
	}
	if err := p.Update(s); err != nil {
		return nil, err
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.srv = &http.Server{
		Handler: p,
		// No TLSConfig: the Proxy makes the handshakes (handshake) and hands the server
		// *tls.Conn for HTTP/2, which it then serves itself, and h1Conn for HTTP/1.1.
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			ctx = context.WithValue(ctx, identityKey{}, &connIdentity{})
			if h, ok := c.(*h1Conn); ok {
				return context.WithValue(ctx, h1Key{}, h)
			}
			return ctx
		},
		ReadHeaderTimeout: cfg.HandshakeTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ErrorLog:          log.New(logWriter{cfg.Log}, "", 0),
	}
	return p, nil
}

// logWriter turns the http.Server's own lines (TLS handshake errors, panics) into log lines.
type logWriter struct{ log logr.Logger }

func (w logWriter) Write(b []byte) (int, error) {
	w.log.Info(strings.TrimSpace(string(b)))
	return len(b), nil
}

// Update makes s the shoot served from now on: new handshakes get its certificate and CA, new
// requests its replicas and front-proxy certificate. Connections and requests already under way
// are not touched.
func (p *Proxy) Update(s Shoot) error {
	if len(s.Serving.Certificate) == 0 || len(s.FrontProxy.Certificate) == 0 {
		return errors.New("terminate: the serving and front-proxy certificates are required")
	}
	if s.ClientCAs == nil || s.UpstreamCAs == nil {
		return errors.New("terminate: the client CA and kube-apiserver's CA are required")
	}
	st := &state{shoot: s}
	st.tls = &tls.Config{
		Certificates: []tls.Certificate{s.Serving},
		// Requested, not verified in the handshake: a certificate the client CA does not
		// verify gets 401 and a log line, as kube-apiserver answers it, not a bare alert.
		ClientAuth: tls.RequestClientCert,
		NextProtos: []string{"h2", "http/1.1"},
		MinVersion: tls.VersionTLS12,
	}
	p.mu.Lock()
	for _, a := range s.Upstreams {
		n := p.outstanding[a]
		if n == nil {
			n = new(atomic.Int64)
			p.outstanding[a] = n
		}
		st.upstreams = append(st.upstreams, upstream{addr: a, outstanding: n})
	}
	p.mu.Unlock()
	upTLS := &tls.Config{Certificates: []tls.Certificate{s.FrontProxy}, RootCAs: s.UpstreamCAs, ServerName: s.UpstreamName, MinVersion: tls.VersionTLS12}
	dialer := &net.Dialer{Timeout: p.cfg.DialTimeout, KeepAlive: 30 * time.Second}
	var h2, h1 http.Protocols
	h2.SetHTTP2(true)
	h1.SetHTTP1(true)
	st.h2 = &http.Transport{DialContext: dialer.DialContext, TLSClientConfig: upTLS, Protocols: &h2,
		TLSHandshakeTimeout: p.cfg.HandshakeTimeout, IdleConnTimeout: 90 * time.Second, MaxIdleConnsPerHost: 4}
	st.h1 = &http.Transport{DialContext: dialer.DialContext, TLSClientConfig: upTLS.Clone(), Protocols: &h1,
		TLSHandshakeTimeout: p.cfg.HandshakeTimeout, IdleConnTimeout: 90 * time.Second}
	if old := p.state.Swap(st); old != nil {
		// Requests in flight keep their connections; idle ones would carry the old
		// certificate into new requests.
		old.h2.CloseIdleConnections()
		old.h1.CloseIdleConnections()
		p.retireRelayUpstreams(old.shoot, s)
	}
	return nil
}

// ServeConn serves one client connection, whose first bytes are its ClientHello (a connection
// the SNI listener peeked at replays them). It returns at once; the Proxy owns c from then on.
// handshaken, if not nil, is called once the TLS handshake has ended, either way (the ingress
// counts a connection as pending until then).
func (p *Proxy) ServeConn(c net.Conn, handshaken func()) error {
	p.hsMu.Lock()
	defer p.hsMu.Unlock()
	if p.ctx.Err() != nil {
		c.Close()
		if handshaken != nil {
			handshaken()
		}
		return http.ErrServerClosed
	}
	p.handshakes.Add(1)
	go p.handshake(c, handshaken)
	return nil
}

// handshake ends the client's TLS within HandshakeTimeout and gives the connection to the HTTP
// server: as it is for HTTP/2, as an h1Conn for HTTP/1.1.
func (p *Proxy) handshake(c net.Conn, handshaken func()) {
	defer p.handshakes.Done()
	tc := tls.Server(c, &tls.Config{
		// Read at every handshake, so a rotated certificate serves the next one; the
		// connections already open keep theirs.
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return p.state.Load().tls, nil },
	})
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.HandshakeTimeout)
	err := tc.HandshakeContext(ctx)
	cancel()
	if handshaken != nil {
		handshaken()
	}
	if err != nil {
		p.Refused.Handshake.Add(1)
		p.cfg.Log.V(1).Info("TLS handshake failed", "remote", c.RemoteAddr().String(), "error", err.Error())
		c.Close()
		return
	}
	var hc net.Conn = tc
	if p.relay != nil && tc.ConnectionState().NegotiatedProtocol == "h2" {
		d := &relayDirector{p: p, cs: tc.ConnectionState(), peer: hostOf(c.RemoteAddr().String())}
		// The certificate is verified here, on this goroutine, which ends now: the
		// connection's reader, which lives as long as the connection, would keep the stack
		// the chain's verification grew to (kilobytes per idle connection).
		_, _ = d.id.of(&d.cs, p.state.Load().shoot.ClientCAs)
		p.relay.ServeConn(context.Background(), tc, d)
		return
	}
	if tc.ConnectionState().NegotiatedProtocol != "h2" {
		hc = &h1Conn{Conn: tc, state: tc.ConnectionState(), framing: newFraming(p.cfg.MaxHeaderBytes + maxLine)}
	}
	select {
	case p.conns <- hc:
	case <-p.ctx.Done():
		hc.Close()
	}
}

// Serve serves the connections of ln and ServeConn until Shutdown. It returns
// http.ErrServerClosed after Shutdown.
func (p *Proxy) Serve(ln net.Listener) error {
	var wg sync.WaitGroup
	if ln != nil {
		wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				if p.ServeConn(c, nil) != nil {
					return
				}
			}
		})
	}
	err := p.srv.Serve(handoff{p})
	if ln != nil {
		ln.Close()
	}
	wg.Wait()
	p.handshakes.Wait()
	return err
}

// Shutdown stops accepting, waits for the requests in flight until ctx ends, then closes the
// connections (hijacked ones, upgrades, are the caller's to bound with ctx's deadline).
func (p *Proxy) Shutdown(ctx context.Context) error {
	p.hsMu.Lock()
	p.cancel() // handshakes under way end, and ServeConn refuses
	p.hsMu.Unlock()
	var rerr error
	done := make(chan struct{})
	if p.relay != nil {
		go func() {
			defer close(done)
			rerr = p.relay.Shutdown(ctx)
			p.mu.Lock()
			for _, u := range p.relayUps {
				u.Close()
			}
			p.mu.Unlock()
		}()
	} else {
		close(done)
	}
	err := p.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		err = errors.Join(err, p.srv.Close())
	}
	<-done
	if rerr != nil && err == nil {
		err = rerr
	}
	return err
}

// h1Conn is an HTTP/1.1 client connection: its TLS state (net/http gives a handler r.TLS only
// for a *tls.Conn) and the framing of what it read, for the requests net/http would let
// through although they carry both Content-Length and Transfer-Encoding.
type h1Conn struct {
	*tls.Conn
	state tls.ConnectionState

	mu      sync.Mutex // Read may run in net/http's background reader too
	framing *framing
	served  atomic.Int64 // requests handed to ServeHTTP (one after another on a connection)
}

type h1Key struct{}

func (c *h1Conn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.mu.Lock()
	c.framing.feed(b[:n])
	c.mu.Unlock()
	return n, err
}

// smuggled reports whether the request net/http hands over now is, or follows, one with both
// lengths. net/http has read its head, so framing has too.
func (c *h1Conn) smuggled() bool {
	n := c.served.Add(1)
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.framing.conflict != 0 && n >= int64(c.framing.conflict)
}

// handoff is the http.Server's listener: it accepts what the handshakes hand over.
type handoff struct{ p *Proxy }

func (h handoff) Accept() (net.Conn, error) {
	select {
	case c := <-h.p.conns:
		return c, nil
	case <-h.p.ctx.Done():
		// Shutdown may not have told the server yet; Serve returns what Accept does.
		return nil, http.ErrServerClosed
	}
}

func (h handoff) Close() error   { return nil } // Shutdown ends Accept
func (h handoff) Addr() net.Addr { return handoffAddr{} }

type handoffAddr struct{}

func (handoffAddr) Network() string { return "handoff" }
func (handoffAddr) String() string  { return "handoff" }

// ServeHTTP authenticates, rewrites the identity headers and forwards one request.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	st := p.state.Load()
	cs := r.TLS
	if h, ok := r.Context().Value(h1Key{}).(*h1Conn); ok {
		cs = &h.state
		if h.smuggled() {
			p.Refused.Smuggling.Add(1)
			p.cfg.Log.Info("Refused a request with both Content-Length and Transfer-Encoding", "remote", r.RemoteAddr)
			w.Header().Set("Connection", "close")
			writeStatus(w, http.StatusBadRequest, "BadRequest", "both Content-Length and Transfer-Encoding")
			return
		}
	}
	id, err := identity(r.Context(), cs, st.shoot.ClientCAs)
	if err != nil {
		p.Refused.BadCertificate.Add(1)
		p.cfg.Log.Info("Refused a client certificate", "remote", r.RemoteAddr, "reason", err.Error())
		writeStatus(w, http.StatusUnauthorized, "Unauthorized", "Unauthorized")
		return
	}
	if stripIdentity(r.Header) {
		p.Stripped.Add(1)
		p.cfg.Log.V(1).Info("Dropped X-Remote-* headers a client sent", "remote", r.RemoteAddr, "user", id.user)
	}
	up, ok := p.pick(st)
	if !ok {
		p.Refused.NoUpstream.Add(1)
		writeStatus(w, http.StatusServiceUnavailable, "ServiceUnavailable", "no kube-apiserver replica")
		return
	}
	up.outstanding.Add(1)
	defer up.outstanding.Add(-1)
	if r.ProtoMajor == 2 {
		p.forwardH2(w, r, st, up, id)
		return
	}
	// An HTTP/1.1 server closes a request's body once its handler writes the response, unless
	// told otherwise; a replica may answer while the body still comes (an echo, a streamed
	// request), and the body's rest would be cut (TestBodiesAndTrailers, under load).
	_ = http.NewResponseController(w).EnableFullDuplex()
	transport := st.h2
	if isUpgrade(r) {
		transport = st.h1
	}
	rp := &httputil.ReverseProxy{
		BufferPool: copyBuffers,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(&url.URL{Scheme: "https", Host: up.addr})
			pr.Out.Host = pr.In.Host
			// X-Forwarded-For from the client is replaced, not extended: kube-apiserver's audit
			// log takes the source IPs from it.
			pr.SetXForwarded()
			if id.user != "" {
				pr.Out.Header.Set(HeaderUser, id.user)
				for _, g := range id.groups {
					pr.Out.Header.Add(HeaderGroup, g)
				}
				pr.Out.Header[HeaderCredentialID] = []string{id.credential}
			}
		},
		Transport: transport,
		// No flush after every write: a response of known length goes out in as few writes
		// as it takes (a flush per write cost a system call per frame). Watches and logs -f
		// have no length, which ReverseProxy flushes as they come.
		FlushInterval: 0,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, context.Canceled) {
				return // the client went away
			}
			p.Refused.Upstream.Add(1)
			p.cfg.Log.Info("kube-apiserver replica failed", "upstream", up.addr, "error", err.Error())
			writeStatus(w, http.StatusBadGateway, "InternalError", "kube-apiserver replica failed")
		},
	}
	rp.ServeHTTP(w, r)
}

// forwardH2 forwards an HTTP/2 client's request over HTTP/2, the common case (client-go speaks
// HTTP/2), with less work than httputil.ReverseProxy does for any request: HTTP/2 carries no
// hop-by-hop headers (net/http refuses a request with them) and no upgrades, so the request's
// own header map, rewritten in place, is the one sent, and the response's is taken as it is.
// HTTP/1.1 requests, upgrades among them, go through ReverseProxy.
func (p *Proxy) forwardH2(w http.ResponseWriter, r *http.Request, st *state, up upstream, id clientID) {
	out := r.WithContext(r.Context())
	out.URL = &url.URL{Scheme: "https", Host: up.addr, Path: r.URL.Path, RawPath: r.URL.RawPath, RawQuery: r.URL.RawQuery}
	out.RequestURI = ""
	if r.ContentLength == 0 {
		out.Body = nil // nothing to wait for (the Transport would read an empty body first)
	}
	h := out.Header
	// As ReverseProxy's SetXForwarded after Rewrite dropped the client's: X-Forwarded-For is
	// the client's address alone, which kube-apiserver's audit log takes the source IPs from.
	delete(h, "Forwarded")
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		h["X-Forwarded-For"] = []string{ip}
	} else {
		delete(h, "X-Forwarded-For")
	}
	h["X-Forwarded-Host"] = []string{r.Host}
	h["X-Forwarded-Proto"] = []string{"https"}
	if id.user != "" {
		h[HeaderUser] = []string{id.user}
		h[HeaderGroup] = id.groups
		h[HeaderCredentialID] = []string{id.credential}
	}
	resp, err := st.h2.RoundTrip(out)
	if err != nil {
		if r.Context().Err() != nil {
			return // the client went away
		}
		p.Refused.Upstream.Add(1)
		p.cfg.Log.Info("kube-apiserver replica failed", "upstream", up.addr, "error", err.Error())
		writeStatus(w, http.StatusBadGateway, "InternalError", "kube-apiserver replica failed")
		return
	}
	defer resp.Body.Close()
	wh := w.Header()
	for k, v := range resp.Header {
		wh[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	// A response without a length (a watch, logs -f) goes out as it comes, its head at once: a
	// watch with nothing to report yet sends no body for a while, and client-go waits for the
	// head before it does anything else. One with a length goes in as few writes as it takes.
	stream := resp.ContentLength < 0
	flusher, _ := w.(http.Flusher)
	if stream && flusher != nil {
		flusher.Flush()
	}
	buf := copyBuffers.Get()
	defer copyBuffers.Put(buf)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return // the client went away; the deferred Close cancels the upstream stream
			}
			if stream && flusher != nil {
				flusher.Flush()
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			// Cut short: the client must see the stream reset, not a short complete body.
			panic(http.ErrAbortHandler)
		}
	}
	for k, v := range resp.Trailer {
		wh[http.TrailerPrefix+k] = v
	}
}

// connIdentity is a client connection's verified identity, computed at its first request: a
// connection's certificate does not change, and verifying its chain is most of a request's
// cost (an ECDSA signature check per certificate). It is computed again when the client CA
// changed (a rotation: Update) or the chain's earliest expiry has passed.
type connIdentity struct {
	mu    sync.Mutex
	roots *x509.CertPool
	until time.Time
	id    clientID
	err   error
}

// clientID is a verified client certificate's identity as kube-apiserver's x509 authenticator
// makes it: the user (common name), the groups (organizations) and the credential id
// (X509SHA256=<hex SHA-256 of the certificate>), which its audit log records for the request.
type clientID struct {
	user, credential string
	groups           []string
}

type identityKey struct{}

// identity is clientIdentity for the request's connection, from its cache when still valid.
func identity(ctx context.Context, cs *tls.ConnectionState, roots *x509.CertPool) (clientID, error) {
	id, ok := ctx.Value(identityKey{}).(*connIdentity)
	if !ok {
		return clientIdentity(cs, roots)
	}
	return id.of(cs, roots)
}

// of is the connection's identity, verified again when the roots changed or the chain expired.
func (id *connIdentity) of(cs *tls.ConnectionState, roots *x509.CertPool) (clientID, error) {
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return clientIdentity(cs, roots)
	}
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.roots != roots || !time.Now().Before(id.until) {
		id.id, id.err = clientIdentity(cs, roots)
		id.roots, id.until = roots, cs.PeerCertificates[0].NotAfter
		for _, c := range cs.PeerCertificates[1:] {
			if c.NotAfter.Before(id.until) {
				id.until = c.NotAfter
			}
		}
	}
	return id.id, id.err
}

// hostOf is addr's host.
func hostOf(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// copyBuffers lend ReverseProxy its response copy buffers, which it would otherwise allocate
// per request (32 KiB each, most of what a small request allocated).
var copyBuffers = &bufferPool{}

type bufferPool struct{ p sync.Pool }

// copyBufferSize is ReverseProxy's own buffer size.
const copyBufferSize = 32 << 10

func (b *bufferPool) Get() []byte {
	if buf, ok := b.p.Get().(*[]byte); ok {
		return *buf
	}
	return make([]byte, copyBufferSize)
}

func (b *bufferPool) Put(buf []byte) {
	if cap(buf) == copyBufferSize {
		buf = buf[:copyBufferSize]
		b.p.Put(&buf)
	}
}

// clientIdentity verifies the client's certificate, if it sent one, and returns its user (the
// common name) and groups (the organizations), as kube-apiserver's x509 authenticator reads
// them. No certificate: "" and no error.
func clientIdentity(cs *tls.ConnectionState, roots *x509.CertPool) (clientID, error) {
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return clientID{}, nil
	}
	certs := cs.PeerCertificates
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	if _, err := certs[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return clientID{}, err
	}
	leaf := certs[0]
	if leaf.Subject.CommonName == "" {
		return clientID{}, errors.New("the client certificate names no user (empty common name)")
	}
	sum := sha256.Sum256(leaf.Raw)
	return clientID{user: leaf.Subject.CommonName, groups: leaf.Subject.Organization, credential: wire.CredentialIDPrefix + hex.EncodeToString(sum[:])}, nil
}

// stripIdentity deletes every header under X-Remote-; it reports whether there was one.
func stripIdentity(h http.Header) bool {
	found := false
	for k := range h {
		if len(k) >= len(headerPrefix) && strings.EqualFold(k[:len(headerPrefix)], headerPrefix) {
			delete(h, k)
			found = true
		}
	}
	return found
}

// isUpgrade reports a request that asks to switch protocols (SPDY, WebSocket).
func isUpgrade(r *http.Request) bool {
	for _, v := range r.Header.Values("Connection") {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), "upgrade") {
				return r.Header.Get("Upgrade") != ""
			}
		}
	}
	return false
}

// pick is the replica with the fewest requests in flight; equals take turns.
func (p *Proxy) pick(st *state) (upstream, bool) {
	return leastOutstanding(st.upstreams, func(u upstream) int64 { return u.outstanding.Load() }, &p.next)
}

// leastOutstanding is the replica with the fewest requests in flight; equals take turns from
// next. Both the net/http path and the relay pick with it.
func leastOutstanding[U any](ups []U, outstanding func(U) int64, next *atomic.Uint64) (U, bool) {
	if len(ups) == 0 {
		var none U
		return none, false
	}
	// Two passes over a handful of counters: the least, then the k-th replica that has it.
	least, ties := int64(math.MaxInt64), 0
	for _, u := range ups {
		switch n := outstanding(u); {
		case n < least:
			least, ties = n, 1
		case n == least:
			ties++
		}
	}
	k := int(next.Add(1) % uint64(ties))
	for _, u := range ups {
		if outstanding(u) == least {
			if k == 0 {
				return u, true
			}
			k--
		}
	}
	return ups[0], true // the counts moved between the passes
}

// writeStatus answers with a Kubernetes Status object, as kube-apiserver does, so that kubectl
// shows the message.
func writeStatus(w http.ResponseWriter, code int, reason, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(statusBody(code, reason, message))
}

// statusBody is kube-apiserver's Status object for a failure, as the proxy answers it.
func statusBody(code int, reason, message string) []byte {
	return fmt.Appendf(nil, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":%q,"reason":%q,"code":%d}`+"\n", message, reason, code)
}

// statusAnswer is statusBody as the relay's answer.
func statusAnswer(code int, reason, message string) *h2relay.Answer {
	return &h2relay.Answer{Status: code, ContentType: "application/json", Body: statusBody(code, reason, message)}
}
