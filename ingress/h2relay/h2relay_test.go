package h2relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"golang.org/x/net/http2/hpack"

	"github.com/tendril-net/tendril/internal/pki/testpki"
)

// rig: Go's HTTP/2 client → the relay (TLS ended by the test's listener) → Go's HTTP/2 server.
type rig struct {
	t      testing.TB
	relay  *Relay
	client *http.Client
	up     *Upstream
	seen   chan http.Header
	// dialUp dials the rig's upstream server, as up does.
	dialUp func(ctx context.Context) (net.Conn, error)
	// route, if set, picks a request's upstream instead of up.
	route func(h *Head) *Upstream
}

// director sends every request to the rig's upstream, with x-relayed set, and answers 401 to
// the path /refuse.
type director struct{ r *rig }

func (d director) Direct(_ context.Context, h *Head) (*Upstream, *Answer) {
	if h.Path == "/refuse" {
		return nil, &Answer{Status: 401, ContentType: "application/json", Body: []byte(`{"kind":"Status"}`)}
	}
	h.Fields = append(h.Fields, hpack.HeaderField{Name: "x-relayed", Value: "yes"})
	if d.r.route != nil {
		return d.r.route(h), nil
	}
	return d.r.up, nil
}

func newRig(t testing.TB, cfg Config, handler http.Handler) *rig {
	t.Helper()
	ca, err := testpki.NewCA("h2relay test CA")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Leaf("relay.test", "upstream.test")
	if err != nil {
		t.Fatal(err)
	}
	// The upstream: Go's HTTP/2 server over TLS.
	ul, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: handler, TLSConfig: &tls.Config{Certificates: []tls.Certificate{leaf}, NextProtos: []string{"h2"}}}
	go func() { _ = srv.ServeTLS(ul, "", "") }()
	t.Cleanup(func() { srv.Close() })

	r := &rig{t: t, seen: make(chan http.Header, 100)}
	cfg.Log = testr.NewWithInterface(t, testr.Options{})
	r.relay = New(cfg)
	r.dialUp = func(ctx context.Context) (net.Conn, error) {
		d := tls.Dialer{Config: &tls.Config{RootCAs: ca.Pool, ServerName: "upstream.test", NextProtos: []string{"h2"}}}
		return d.DialContext(ctx, "tcp", ul.Addr().String())
	}
	r.up = r.relay.NewUpstream(r.dialUp)
	// The relay's side: TLS ended here, the connection handed over.
	rl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := rl.Accept()
			if err != nil {
				return
			}
			tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{leaf}, NextProtos: []string{"h2"}})
			if err := tc.HandshakeContext(ctx); err != nil {
				c.Close()
				continue
			}
			r.relay.ServeConn(ctx, tc, director{r})
		}
	})
	t.Cleanup(func() {
		rl.Close()
		cancel()
		wg.Wait()
		r.up.Close()
		r.relay.Wait()
	})
	r.client = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{RootCAs: ca.Pool, ServerName: "relay.test"},
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", rl.Addr().String())
		}}}
	t.Cleanup(r.client.CloseIdleConnections)
	return r
}

// echo answers with the request's body, its digest as a trailer, and x-relayed as x-seen.
func echo(w http.ResponseWriter, req *http.Request) {
	if req.ProtoMajor != 2 {
		http.Error(w, "want HTTP/2", http.StatusHTTPVersionNotSupported)
		return
	}
	w.Header().Set("Trailer", "X-Digest")
	w.Header().Set("X-Seen", req.Header.Get("X-Relayed"))
	h := sha256.New()
	_, _ = io.Copy(io.MultiWriter(w, h), req.Body)
	w.Header().Set("X-Digest", hex.EncodeToString(h.Sum(nil)))
}

func TestRequests(t *testing.T) {
	r := newRig(t, Config{StreamWindow: 64 << 10}, http.HandlerFunc(echo))
	// Many requests on one client connection, some at once.
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for i := range 200 {
		wg.Go(func() {
			body := strings.Repeat(fmt.Sprint(i), 10+i)
			resp, err := r.client.Post("https://relay.test/echo", "text/plain", strings.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(got) != body || resp.Header.Get("X-Seen") != "yes" || resp.ProtoMajor != 2 {
				errs <- fmt.Errorf("request %d: %s %q (%v), x-seen %q", i, resp.Proto, got, err, resp.Header.Get("X-Seen"))
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestLargeBodies: bodies of many stream windows each way, and the trailer after them.
func TestLargeBodies(t *testing.T) {
	t.Run("stream windows", func(t *testing.T) { largeBody(t, Config{StreamWindow: 64 << 10}) })
	// With two streams the connection's window is two stream windows (128 KiB): the 4 MiB go
	// through only if the relay gives the connection's window back as well.
	t.Run("connection window", func(t *testing.T) { largeBody(t, Config{StreamWindow: 64 << 10, MaxStreams: 2}) })
}

func largeBody(t *testing.T, cfg Config) {
	r := newRig(t, cfg, http.HandlerFunc(echo))
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	sum := sha256.Sum256(body)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://relay.test/echo", bytes.NewReader(body))
	resp, err := r.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("%d bytes back (%v), want %d", len(got), err, len(body))
	}
	if d := resp.Trailer.Get("X-Digest"); d != hex.EncodeToString(sum[:]) {
		t.Errorf("trailer X-Digest %q", d)
	}
}

// TestStreaming: a response without a length reaches the client as it comes (a watch).
func TestStreaming(t *testing.T) {
	release := make(chan struct{})
	r := newRig(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		fmt.Fprintln(w, `{"type":"ADDED"}`)
		w.(http.Flusher).Flush()
		<-release
	}))
	defer close(release)
	resp, err := r.client.Get("https://relay.test/watch")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 64)
	n, err := resp.Body.Read(buf)
	if err != nil || string(buf[:n]) != `{"type":"ADDED"}`+"\n" {
		t.Errorf("first event %q, %v", buf[:n], err)
	}
}

// TestAnswer: the director's own answer, and an upstream that is down (502).
func TestAnswer(t *testing.T) {
	r := newRig(t, Config{}, http.HandlerFunc(echo))
	resp, err := r.client.Get("https://relay.test/refuse")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 401 || string(b) != `{"kind":"Status"}` {
		t.Errorf("%s %q, want the director's 401", resp.Status, b)
	}
	r.up.dial = func(context.Context) (net.Conn, error) { return nil, fmt.Errorf("down") }
	r.up.Close()
	resp, err = r.client.Get("https://relay.test/echo")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 502 {
		t.Errorf("%s, want 502 with the upstream down", resp.Status)
	}
}

// TestCancel: a client that gives up a watch resets it; the upstream's handler sees its request
// end, and the stream's place on the upstream is given back.
func TestCancel(t *testing.T) {
	ended := make(chan struct{})
	r := newRig(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		fmt.Fprintln(w, `{"type":"ADDED"}`)
		w.(http.Flusher).Flush()
		<-req.Context().Done()
		close(ended)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://relay.test/watch", nil)
	resp, err := r.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	if n := r.up.Outstanding(); n != 1 {
		t.Errorf("%d outstanding on the upstream during the watch, want 1", n)
	}
	cancel()
	resp.Body.Close()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream's request did not end after the client reset it")
	}
	deadline := time.Now().Add(5 * time.Second)
	for r.up.Outstanding() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := r.up.Outstanding(); n != 0 {
		t.Errorf("%d outstanding after the reset, want 0", n)
	}
}

// TestStalledClient: one client that stops reading a large response holds only its own stream:
// the upstream connection it shares goes on serving another client's requests.
func TestStalledClient(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 8<<20)
	r := newRig(t, Config{StreamWindow: 64 << 10}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/big" {
			_, _ = w.Write(big)
			return
		}
		fmt.Fprint(w, "small")
	}))
	resp, err := r.client.Get("https://relay.test/big")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close() // never read: the client's windows close, the relay holds the rest
	other := &http.Client{Timeout: 10 * time.Second, Transport: r.client.Transport.(*http.Transport).Clone()}
	defer other.CloseIdleConnections()
	for i := range 20 {
		resp, err := other.Get("https://relay.test/small")
		if err != nil {
			t.Fatalf("request %d beside the stalled one: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "small" {
			t.Fatalf("request %d: %q", i, b)
		}
	}
	if n := len(r.up.conns); n != 1 {
		t.Errorf("%d upstream connections, want the one both clients share", n)
	}
}

// TestGarbage: a client that sends no preface, or garbage after it, is closed; the relay goes
// on serving others.
func TestGarbage(t *testing.T) {
	r := newRig(t, Config{PrefaceTimeout: time.Second}, http.HandlerFunc(echo))
	for _, junk := range []string{"GET / HTTP/1.1\r\n\r\n", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\x08\x00\x00\x00\x00\x00garbage!", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + strings.Repeat("\xff", 64)} {
		rc := r.client.Transport.(*http.Transport)
		c, err := tls.Dial("tcp", relayAddr(t, rc), &tls.Config{RootCAs: rc.TLSClientConfig.RootCAs, ServerName: "relay.test", NextProtos: []string{"h2"}})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.WriteString(c, junk)
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Errorf("%q: %v, want the relay to close the connection", junk, err)
		}
		c.Close()
	}
	resp, err := r.client.Get("https://relay.test/echo")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}

// relayAddr is the address the rig's client dials.
func relayAddr(t *testing.T, tr *http.Transport) string {
	t.Helper()
	c, err := tr.DialContext(context.Background(), "tcp", "relay.test:443")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.RemoteAddr().String()
}
