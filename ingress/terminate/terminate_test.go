package terminate

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

const shootHost = "api.alpha.terminate.test"

// seen is what a replica reports of a request it got.
type seen struct {
	Replica       int
	Proto         string
	Path          string
	Headers       map[string][]string // the X-Remote-* ones
	Authorization string
	ForwardedFor  string
	FrontProxy    string // the client certificate's common name
}

// rig is a Proxy in front of fake kube-apiserver replicas: each requires the front-proxy
// certificate, answers with what it saw, holds /slow until released, and echoes after an
// upgrade. Real kube-apiservers are in e2e (TestTerminatingAPIServers).
type rig struct {
	t                *testing.T
	shootCA, proxyCA *testpki.CA
	kubeCA           *testpki.CA
	proxy            *Proxy
	addr             string
	replicas         []*httptest.Server
	served           []atomic.Int64
	conns            []atomic.Int64 // each replica's open connections
	release          chan struct{}
	slowIn           chan int
	shoot            Shoot
	client           tls.Certificate
	serving          tls.Certificate
	clientDials      atomic.Int64
}

func newRig(t *testing.T, replicas int, cfg Config) *rig {
	t.Helper()
	r := &rig{t: t, release: make(chan struct{}), slowIn: make(chan int, 16), served: make([]atomic.Int64, replicas), conns: make([]atomic.Int64, replicas)}
	var err error
	for _, ca := range []**testpki.CA{&r.shootCA, &r.proxyCA, &r.kubeCA} {
		if *ca, err = testpki.NewCA("terminate test CA"); err != nil {
			t.Fatal(err)
		}
	}
	kubeServing := must(r.kubeCA.Leaf("kube-apiserver", "127.0.0.1"))
	for i := range replicas {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) { r.serve(i, w, req) }))
		srv.TLS = &tls.Config{Certificates: []tls.Certificate{kubeServing}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: r.proxyCA.Pool}
		srv.EnableHTTP2 = true
		srv.Config.ConnState = func(_ net.Conn, cs http.ConnState) {
			switch cs {
			case http.StateNew:
				r.conns[i].Add(1)
			case http.StateClosed, http.StateHijacked:
				r.conns[i].Add(-1)
			}
		}
		srv.StartTLS()
		t.Cleanup(srv.Close)
		r.replicas = append(r.replicas, srv)
	}
	r.serving = must(r.shootCA.Leaf(shootHost))
	r.client = must(r.shootCA.Client("alice", []string{"devs", "ops"}, time.Time{}, time.Time{}))
	r.shoot = Shoot{
		Serving: r.serving, ClientCAs: r.shootCA.Pool,
		FrontProxy: must(r.proxyCA.Client("front-proxy-client", nil, time.Time{}, time.Time{})), UpstreamCAs: r.kubeCA.Pool, UpstreamName: "kube-apiserver",
	}
	for _, s := range r.replicas {
		r.shoot.Upstreams = append(r.shoot.Upstreams, strings.TrimPrefix(s.URL, "https://"))
	}
	cfg.Log = testr.New(t)
	if r.proxy, err = New(cfg, r.shoot); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.addr = ln.Addr().String()
	done := make(chan error, 1)
	go func() { done <- r.proxy.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := r.proxy.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	t.Cleanup(func() { close(r.release) }) // before the replicas close: the slow requests end
	return r
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func (r *rig) serve(i int, w http.ResponseWriter, req *http.Request) {
	r.served[i].Add(1)
	if req.URL.Path == "/slow" {
		r.slowIn <- i
		<-r.release
	}
	if req.URL.Path == "/quiet-watch" {
		// A watch with nothing to report yet: its head, and no body until released.
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_ = http.NewResponseController(w).Flush()
		<-r.release
		return
	}
	if req.URL.Path == "/watch" {
		// An event, flushed, then nothing until released: as a watch that waits for the next.
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"type":"ADDED"}`)
		_ = http.NewResponseController(w).Flush()
		<-r.release
		return
	}
	if req.URL.Path == "/echo" {
		// The body back, its digest in a trailer, and what the proxy said of the request.
		w.Header().Set("Trailer", "X-Digest")
		w.Header().Set("X-Seen-Forwarded", req.Header.Get("X-Forwarded-Host")+" "+req.Header.Get("X-Forwarded-Proto"))
		h := sha256.New()
		_, _ = io.Copy(io.MultiWriter(w, h), req.Body)
		w.Header().Set("X-Digest", hex.EncodeToString(h.Sum(nil)))
		return
	}
	if req.Header.Get("Upgrade") != "" {
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			r.t.Error(err)
			return
		}
		defer c.Close()
		fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\nX-Replica-Proto: %s\r\nX-Replica-User: %s\r\n\r\n",
			req.Header.Get("Upgrade"), req.Proto, req.Header.Get(HeaderUser))
		brw.Flush()
		_, _ = io.Copy(c, brw) // echo until the client closes
		return
	}
	s := seen{Replica: i, Proto: req.Proto, Path: req.URL.Path, Headers: map[string][]string{},
		Authorization: req.Header.Get("Authorization"), ForwardedFor: req.Header.Get("X-Forwarded-For")}
	for k, v := range req.Header {
		if strings.HasPrefix(k, "X-Remote-") {
			s.Headers[k] = v
		}
	}
	if len(req.TLS.PeerCertificates) > 0 {
		s.FrontProxy = req.TLS.PeerCertificates[0].Subject.CommonName
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(s)
}

// httpClient is a client of the Proxy with cert (none when empty), counting its connections.
func (r *rig) httpClient(cert *tls.Certificate) *http.Client {
	cfg := &tls.Config{RootCAs: r.shootCA.Pool, ServerName: shootHost}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	d := &net.Dialer{}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			r.clientDials.Add(1)
			return d.DialContext(ctx, network, r.addr)
		}}}
}

// get sends one request and decodes what the replica saw; the status is returned too.
func (r *rig) get(c *http.Client, path string, header http.Header) (seen, int) {
	r.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "https://"+shootHost+path, nil)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := c.Do(req)
	if err != nil {
		r.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	var s seen
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(b, &s); err != nil {
			r.t.Fatalf("GET %s: %v: %s", path, err, b)
		}
	} else if !strings.Contains(string(b), `"kind":"Status"`) {
		r.t.Errorf("GET %s: %s without a Status body: %s", path, resp.Status, b)
	}
	return s, resp.StatusCode
}

func (r *rig) total() int64 {
	var n int64
	for i := range r.served {
		n += r.served[i].Load()
	}
	return n
}

// TestIdentityHeaders: a client certificate's user and groups reach kube-apiserver in the
// authenticating-proxy headers, over HTTP/2 with the front-proxy certificate; whatever X-Remote-*
// headers the client sent (any case, the extra prefix too) are gone; a bearer token passes
// untouched and gets no identity headers; X-Forwarded-For is the client's address, not its claim.
func TestIdentityHeaders(t *testing.T) {
	r := newRig(t, 1, Config{})
	forged := http.Header{"X-Remote-User": {"admin"}, "X-Remote-Group": {"system:masters"}, "X-Remote-Extra-Scopes": {"all"},
		"x-remote-user": {"root"}, "X-Forwarded-For": {"10.0.0.1"}}
	s, code := r.get(r.httpClient(&r.client), "/api", forged)
	if code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	// The certificate's organizations in the order DER gives them (a SET sorts), as kube-apiserver
	// would read them from the certificate itself.
	// The credential id is kube-apiserver's own for the certificate: its SHA-256 (checked
	// against a real kube-apiserver's in e2e's TestTerminatingAPIServers).
	sum := sha256.Sum256(r.client.Leaf.Raw)
	want := map[string][]string{HeaderUser: {"alice"}, HeaderGroup: r.client.Leaf.Subject.Organization,
		http.CanonicalHeaderKey(HeaderCredentialID): {"X509SHA256=" + hex.EncodeToString(sum[:])}}
	if fmt.Sprint(s.Headers) != fmt.Sprint(want) || len(s.Headers[HeaderGroup]) != 2 {
		t.Errorf("identity headers %v, want %v", s.Headers, want)
	}
	if s.Proto != "HTTP/2.0" || s.FrontProxy != "front-proxy-client" {
		t.Errorf("upstream %s with %q, want HTTP/2.0 with the front-proxy certificate", s.Proto, s.FrontProxy)
	}
	if s.ForwardedFor != "127.0.0.1" {
		t.Errorf("X-Forwarded-For %q, want the client's address only", s.ForwardedFor)
	}
	token := http.Header{"Authorization": {"Bearer abc.def"}, "X-Remote-User": {"admin"}}
	s, _ = r.get(r.httpClient(nil), "/api", token)
	if s.Authorization != "Bearer abc.def" || len(s.Headers) != 0 {
		t.Errorf("token request: authorization %q, identity headers %v; want the token and none", s.Authorization, s.Headers)
	}
	if n := r.proxy.Stripped.Load(); n != 2 {
		t.Errorf("stripped %d requests, want 2", n)
	}
}

// TestBadClientCertificates: a certificate of another CA, an expired one and one without a user
// get 401 with a Status body; none reaches a replica.
func TestBadClientCertificates(t *testing.T) {
	r := newRig(t, 1, Config{})
	other := must(testpki.NewCA("another shoot's CA"))
	for name, cert := range map[string]tls.Certificate{
		"other CA": must(other.Client("alice", nil, time.Time{}, time.Time{})),
		"expired":  must(r.shootCA.Client("alice", nil, time.Now().Add(-2*time.Hour), time.Now().Add(-time.Hour))),
		"no user":  must(r.shootCA.Client("", []string{"devs"}, time.Time{}, time.Time{})),
	} {
		if _, code := r.get(r.httpClient(&cert), "/api", nil); code != http.StatusUnauthorized {
			t.Errorf("%s: status %d, want 401", name, code)
		}
	}
	if n := r.total(); n != 0 {
		t.Errorf("%d requests reached a replica", n)
	}
	if n := r.proxy.Refused.BadCertificate.Load(); n != 3 {
		t.Errorf("refused %d, want 3", n)
	}
}

// TestSpreadsOneConnection: 1,200 requests on one client connection spread evenly over three
// replicas (requests one after another: every replica has none in flight, so they take turns).
func TestSpreadsOneConnection(t *testing.T) {
	r := newRig(t, 3, Config{})
	c := r.httpClient(&r.client)
	const n = 1200
	for range n {
		r.get(c, "/api/v1/namespaces/default", nil)
	}
	if d := r.clientDials.Load(); d != 1 {
		t.Errorf("the client opened %d connections, want 1", d)
	}
	for i := range r.served {
		if got := r.served[i].Load(); got < n/3*9/10 || got > n/3*11/10 {
			t.Errorf("replica %d served %d of %d, want %d ± 10 %%", i, got, n, n/3)
		}
	}
}

// TestLeastOutstanding: while a request (a watch, say) is in flight on a replica, new requests go
// to the others.
func TestLeastOutstanding(t *testing.T) {
	r := newRig(t, 3, Config{})
	c := r.httpClient(&r.client)
	slow := make(chan struct{})
	go func() {
		defer close(slow)
		resp, err := c.Get("https://" + shootHost + "/slow")
		if err == nil {
			resp.Body.Close()
		}
	}()
	busy := <-r.slowIn
	before := r.served[busy].Load()
	for range 300 {
		r.get(c, "/api", nil)
	}
	if got := r.served[busy].Load() - before; got != 0 {
		t.Errorf("the replica with a request in flight got %d of 300 new ones, want 0", got)
	}
	// The two others share the rest, not in strict turns: a finished request's replica may
	// still count it when the next one is picked (the relay releases it after the client has
	// the response), and then the other gets that one too (139 of 300 seen beside a make test).
	for i := range r.served {
		if i != busy && r.served[i].Load() < 120 {
			t.Errorf("replica %d served %d, want about 150", i, r.served[i].Load())
		}
	}
}

// TestUpgrade: a request to switch protocols (kubectl exec over WebSocket or SPDY) reaches the
// replica over HTTP/1.1 with the identity headers, and the upgraded stream carries bytes both
// ways.
func TestUpgrade(t *testing.T) {
	r := newRig(t, 1, Config{})
	conn, err := tls.Dial("tcp", r.addr, &tls.Config{RootCAs: r.shootCA.Pool, ServerName: shootHost, Certificates: []tls.Certificate{r.client}, NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /api/v1/namespaces/default/pods/p/exec HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Remote-User: admin\r\n\r\n", shootHost)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("X-Replica-Proto") != "HTTP/1.1" || resp.Header.Get("X-Replica-User") != "alice" {
		t.Fatalf("%s, replica saw %s as %q; want 101 over HTTP/1.1 as alice", resp.Status, resp.Header.Get("X-Replica-Proto"), resp.Header.Get("X-Replica-User"))
	}
	for _, msg := range []string{"ping\n", "pong\n"} {
		if _, err := io.WriteString(conn, msg); err != nil {
			t.Fatal(err)
		}
		got, err := br.ReadString('\n')
		if err != nil || got != msg {
			t.Fatalf("echo %q, %v; want %q", got, err, msg)
		}
	}
}

// TestRotation: after Update with a new serving certificate, a new connection gets it and one
// already open goes on with its requests.
func TestRotation(t *testing.T) {
	r := newRig(t, 1, Config{})
	old := r.httpClient(&r.client)
	r.get(old, "/api", nil)
	next := r.shoot
	next.Serving = must(r.shootCA.Leaf(shootHost))
	if err := r.proxy.Update(next); err != nil {
		t.Fatal(err)
	}
	if _, code := r.get(old, "/api", nil); code != http.StatusOK || r.clientDials.Load() != 1 {
		t.Errorf("the open connection after the rotation: status %d, %d dials; want 200 on the one connection", code, r.clientDials.Load())
	}
	conn, err := tls.Dial("tcp", r.addr, &tls.Config{RootCAs: r.shootCA.Pool, ServerName: shootHost})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if got := conn.ConnectionState().PeerCertificates[0].SerialNumber; got.Cmp(next.Serving.Leaf.SerialNumber) != 0 {
		t.Errorf("a new connection got serial %v, want the rotated certificate's %v", got, next.Serving.Leaf.SerialNumber)
	}
}

// TestBadRequests: request smuggling (Content-Length with Transfer-Encoding) gets 400, an
// oversized header block 431; neither reaches a replica. No replica: 503; a replica that is
// gone: 502.
func TestBadRequests(t *testing.T) {
	r := newRig(t, 1, Config{MaxHeaderBytes: 4 << 10})
	raw := func(req string) int {
		t.Helper()
		conn, err := tls.Dial("tcp", r.addr, &tls.Config{RootCAs: r.shootCA.Pool, ServerName: shootHost, NextProtos: []string{"http/1.1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(conn, req); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	smuggle := "POST /api HTTP/1.1\r\nHost: " + shootHost + "\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\n"
	if code := raw(smuggle); code != http.StatusBadRequest {
		t.Errorf("Content-Length with Transfer-Encoding: %d, want 400", code)
	}
	big := "GET /api HTTP/1.1\r\nHost: " + shootHost + "\r\nX-Big: " + strings.Repeat("a", 16<<10) + "\r\n\r\n"
	if code := raw(big); code != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("16 KiB header: %d, want 431", code)
	}
	if n := r.total(); n != 0 {
		t.Errorf("%d bad requests reached a replica", n)
	}

	none := r.shoot
	none.Upstreams = nil
	if err := r.proxy.Update(none); err != nil {
		t.Fatal(err)
	}
	if _, code := r.get(r.httpClient(&r.client), "/api", nil); code != http.StatusServiceUnavailable {
		t.Errorf("no replica: %d, want 503", code)
	}
	gone := r.shoot
	r.replicas[0].Close()
	if err := r.proxy.Update(gone); err != nil {
		t.Fatal(err)
	}
	if _, code := r.get(r.httpClient(&r.client), "/api", nil); code != http.StatusBadGateway {
		t.Errorf("replica gone: %d, want 502", code)
	}
	if r.proxy.Refused.NoUpstream.Load() != 1 || r.proxy.Refused.Upstream.Load() != 1 {
		t.Errorf("refusals: no upstream %d, upstream %d; want 1 and 1", r.proxy.Refused.NoUpstream.Load(), r.proxy.Refused.Upstream.Load())
	}
}

// TestShutdownWithConnections: Shutdown returns with client connections open and ServeConn
// refuses afterwards.
func TestShutdownWithConnections(t *testing.T) {
	r := newRig(t, 1, Config{})
	r.get(r.httpClient(&r.client), "/api", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.proxy.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	defer b.Close()
	if err := r.proxy.ServeConn(a, nil); !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("ServeConn after Shutdown: %v", err)
	}
}

// TestIdentityCachedPerConnection: a connection's certificate is verified once, not per
// request, but again once the client CA changed: a CA rotation that drops the client's issuer
// refuses the next request on the open connection.
func TestIdentityCachedPerConnection(t *testing.T) {
	r := newRig(t, 1, Config{})
	c := r.httpClient(&r.client)
	if s, code := r.get(c, "/api", nil); code != http.StatusOK || s.Headers["X-Remote-User"][0] != "alice" {
		t.Fatalf("status %d, saw %+v", code, s)
	}
	otherCA, err := testpki.NewCA("another client CA")
	if err != nil {
		t.Fatal(err)
	}
	next := r.shoot
	next.ClientCAs = otherCA.Pool
	if err := r.proxy.Update(next); err != nil {
		t.Fatal(err)
	}
	if _, code := r.get(c, "/api", nil); code != http.StatusUnauthorized || r.clientDials.Load() != 1 {
		t.Errorf("after the client CA changed, the open connection: %d on %d connections; want 401 on the one", code, r.clientDials.Load())
	}
}

// TestWatchStreams: an event a replica flushed reaches the client while the response goes on
// (a watch's response has no length, which the proxy flushes as it comes).
func TestWatchStreams(t *testing.T) {
	r := newRig(t, 1, Config{})
	// A watch that has nothing to report yet: its head reaches the client all the same (client-go
	// waits for it before it creates the object it watches for).
	qreq, _ := http.NewRequest(http.MethodGet, "https://"+shootHost+"/quiet-watch", nil)
	qresp, err := r.httpClient(&r.client).Do(qreq)
	if err != nil {
		t.Fatalf("a watch without events yet: %v", err)
	}
	qresp.Body.Close()
	req, _ := http.NewRequest(http.MethodGet, "https://"+shootHost+"/watch", nil)
	resp, err := r.httpClient(&r.client).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != `{"type":"ADDED"}`+"\n" {
		t.Errorf("first event %q, %v", line, err)
	}
}

// TestBodiesAndTrailers: a request body of several flow-control windows goes up whole and comes
// back whole, with the replica's trailer, over HTTP/2 (the proxy's own path) and HTTP/1.1
// (ReverseProxy's); the replica sees X-Forwarded-Host and -Proto as the client's.
func TestBodiesAndTrailers(t *testing.T) {
	r := newRig(t, 1, Config{})
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	sum := sha256.Sum256(body)
	for _, h2 := range []bool{true, false} {
		c := r.httpClient(&r.client)
		if !h2 {
			tr := c.Transport.(*http.Transport)
			tr.ForceAttemptHTTP2 = false
			tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
		}
		resp, err := c.Post("https://"+shootHost+"/echo", "application/octet-stream", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := map[bool]int{true: 2, false: 1}[h2]; resp.ProtoMajor != want {
			t.Errorf("HTTP/2 %v: the client spoke %s", h2, resp.Proto)
		}
		if err != nil || !bytes.Equal(got, body) {
			t.Fatalf("HTTP/2 %v: %d bytes back (%v), want the %d sent", h2, len(got), err, len(body))
		}
		if d := resp.Trailer.Get("X-Digest"); d != hex.EncodeToString(sum[:]) {
			t.Errorf("HTTP/2 %v: trailer X-Digest %q, want the body's digest", h2, d)
		}
		if f := resp.Header.Get("X-Seen-Forwarded"); f != shootHost+" https" {
			t.Errorf("HTTP/2 %v: the replica saw X-Forwarded-Host and -Proto %q", h2, f)
		}
	}
}

// TestDownReplicaAvoided: a replica that refuses connections costs at most the one request that
// found it down; the others go to the replicas that answer (it has none in flight, and least
// outstanding alone would send it every request).
func TestDownReplicaAvoided(t *testing.T) {
	r := newRig(t, 3, Config{})
	r.replicas[0].Close()
	c := r.httpClient(&r.client)
	failed, start := 0, time.Now()
	for range 300 {
		if _, code := r.get(c, "/api", nil); code != http.StatusOK {
			failed++
		}
	}
	// The down replica is tried again when its backoff ends: after 1 s, then 2 s more, 4 s…
	allowed := 1
	for k := 1; time.Duration(1<<k-1)*time.Second <= time.Since(start); k++ {
		allowed++
	}
	if failed > allowed || r.proxy.Refused.Upstream.Load() != uint64(failed) {
		t.Errorf("%d of 300 requests failed (%d counted) with one replica down in %v, want at most %d", failed, r.proxy.Refused.Upstream.Load(), time.Since(start), allowed)
	}
	if got := r.served[1].Load() + r.served[2].Load(); got != int64(300-failed) {
		t.Errorf("the replicas that answer served %d of 300 with %d failed", got, failed)
	}
}

// TestFrontProxyRotation: after Update with a new front-proxy certificate, the next request on
// the same client connection reaches kube-apiserver with it (no connection made with the old one
// carries new requests), and a request in flight on an old connection ends as it would have.
func TestFrontProxyRotation(t *testing.T) {
	r := newRig(t, 1, Config{})
	c := r.httpClient(&r.client)
	if s, _ := r.get(c, "/api", nil); s.FrontProxy != "front-proxy-client" {
		t.Fatalf("before the rotation: front proxy %q", s.FrontProxy)
	}
	slow := make(chan int, 1)
	go func() {
		resp, err := c.Get("https://" + shootHost + "/slow")
		if err != nil {
			slow <- 0
			return
		}
		resp.Body.Close()
		slow <- resp.StatusCode
	}()
	<-r.slowIn
	next := r.shoot
	next.FrontProxy = must(r.proxyCA.Client("front-proxy-client-2", nil, time.Time{}, time.Time{}))
	if err := r.proxy.Update(next); err != nil {
		t.Fatal(err)
	}
	if s, code := r.get(c, "/api", nil); code != http.StatusOK || s.FrontProxy != "front-proxy-client-2" {
		t.Errorf("after the rotation: %d with front proxy %q, want 200 with front-proxy-client-2", code, s.FrontProxy)
	}
	r.release <- struct{}{}
	if code := <-slow; code != http.StatusOK {
		t.Errorf("the request in flight across the rotation: %d, want 200", code)
	}
	if d := r.clientDials.Load(); d != 1 {
		t.Errorf("the client dialed %d times, want 1", d)
	}
	// The connection with the old certificate closes once its last request ended.
	deadline := time.Now().Add(5 * time.Second)
	for r.conns[0].Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := r.conns[0].Load(); n != 1 {
		t.Errorf("kube-apiserver has %d connections from the proxy after the rotation, want 1 (the new one)", n)
	}
}
