package h2relay

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// gatedDial dials the rig's upstream once opened, and counts its calls.
type gatedDial struct {
	r     *rig
	open  chan struct{}
	once  sync.Once
	calls atomic.Int32
}

// newGatedDial is closed at the test's end too, so that a failing test does not hang on it.
func newGatedDial(t *testing.T, r *rig) *gatedDial {
	g := &gatedDial{r: r, open: make(chan struct{})}
	t.Cleanup(g.release)
	return g
}

func (g *gatedDial) release() { g.once.Do(func() { close(g.open) }) }

func (g *gatedDial) dial(ctx context.Context) (net.Conn, error) {
	g.calls.Add(1)
	select {
	case <-g.open:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.r.dialUp(ctx)
}

// TestSlowDialHoldsOnlyItsRequests: while one replica's connection is dialed, the requests of
// the same client connection to another replica go on; the waiting request's body, sent
// meanwhile, reaches its replica whole once the dial ends.
func TestSlowDialHoldsOnlyItsRequests(t *testing.T) {
	r := newRig(t, Config{StreamWindow: 64 << 10}, http.HandlerFunc(echo))
	g := newGatedDial(t, r)
	slow := r.relay.NewUpstream(g.dial)
	defer slow.Close()
	r.route = func(h *Head) *Upstream {
		if strings.HasPrefix(h.Path, "/slow") {
			return slow
		}
		return r.up
	}
	// One client connection for both (Go's client puts every request to a host on one).
	resp, err := r.client.Get("https://relay.test/echo")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	body := bytes.Repeat([]byte("0123456789abcdef"), 3<<10) // 48 KiB: within the stream window
	type result struct {
		got []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := r.client.Post("https://relay.test/slow", "text/plain", bytes.NewReader(body))
		if err != nil {
			done <- result{err: err}
			return
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{got, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for g.calls.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if g.calls.Load() == 0 {
		t.Fatal("the slow replica was never dialed")
	}
	for i := range 20 {
		resp, err := r.client.Post("https://relay.test/echo", "text/plain", strings.NewReader("fast"))
		if err != nil {
			t.Fatalf("request %d beside the dial: %v", i, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != "fast" {
			t.Fatalf("request %d beside the dial: %q", i, got)
		}
	}
	select {
	case res := <-done:
		t.Fatalf("the request to the replica being dialed ended before its dial: %v", res.err)
	default:
	}
	if n := slow.Outstanding(); n != 1 {
		t.Errorf("the replica being dialed has %d requests outstanding, want 1 (the balancer must see it)", n)
	}
	g.release()
	res := <-done
	if res.err != nil || !bytes.Equal(res.got, body) {
		t.Fatalf("the request held for the dial: %d bytes back of %d (%v)", len(res.got), len(body), res.err)
	}
	// The relay forgets a stream just after its last frame went to the client.
	deadline = time.Now().Add(5 * time.Second)
	for slow.Outstanding() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := slow.Outstanding(); n != 0 {
		t.Errorf("%d requests outstanding after the last ended", n)
	}
}

// TestRequestsShareADial: a burst of requests to a replica without a connection makes one dial.
func TestRequestsShareADial(t *testing.T) {
	r := newRig(t, Config{}, http.HandlerFunc(echo))
	g := newGatedDial(t, r)
	up := r.relay.NewUpstream(g.dial)
	defer up.Close()
	r.route = func(*Head) *Upstream { return up }
	const n = 30
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			resp, err := r.client.Get("https://relay.test/echo")
			if err != nil {
				errs <- err
				return
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				errs <- errors.New(resp.Status)
			}
		})
	}
	deadline := time.Now().Add(10 * time.Second)
	for up.Outstanding() < n && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	g.release()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if c := g.calls.Load(); c != 1 {
		t.Errorf("%d dials for %d requests at once, want 1", c, n)
	}
}

// TestFailedDialBacksOff: a replica that cannot be dialed answers 502 and is Failing for its
// backoff; its count of requests goes back to 0; a dial that works again ends the backoff.
func TestFailedDialBacksOff(t *testing.T) {
	var failures []error
	var mu sync.Mutex
	r := newRig(t, Config{OnUpstreamFailure: func(err error) {
		mu.Lock()
		failures = append(failures, err)
		mu.Unlock()
	}}, http.HandlerFunc(echo))
	var refuse atomic.Bool
	refuse.Store(true)
	up := r.relay.NewUpstream(func(ctx context.Context) (net.Conn, error) {
		if refuse.Load() {
			return nil, errors.New("connection refused (test)")
		}
		return r.dialUp(ctx)
	})
	defer up.Close()
	r.route = func(*Head) *Upstream { return up }
	resp, err := r.client.Post("https://relay.test/echo", "text/plain", strings.NewReader("a body the replica never gets"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("a replica that cannot be dialed: %s, want 502", resp.Status)
	}
	mu.Lock()
	nf := len(failures)
	mu.Unlock()
	if nf != 1 {
		t.Errorf("%d failures reported, want 1", nf)
	}
	if !up.Failing() {
		t.Error("the replica is not Failing after a failed dial")
	}
	if n := up.Outstanding(); n != 0 {
		t.Errorf("%d requests outstanding after the 502", n)
	}
	refuse.Store(false)
	resp, err = r.client.Get("https://relay.test/echo")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || up.Failing() {
		t.Errorf("after a dial that works: %s, failing %v", resp.Status, up.Failing())
	}
}

// TestRetire: a retired replica's idle connection closes at once, a busy one once its last
// stream ends; the stream itself runs to its end.
func TestRetire(t *testing.T) {
	release := make(chan struct{})
	r := newRig(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/watch" {
			w.WriteHeader(200)
			w.(http.Flusher).Flush()
			<-release
			_, _ = io.WriteString(w, "the end\n")
			return
		}
		echo(w, req)
	}))
	var conns atomic.Int32
	dial := func(ctx context.Context) (net.Conn, error) {
		conns.Add(1)
		return r.dialUp(ctx)
	}
	idle, busy := r.relay.NewUpstream(dial), r.relay.NewUpstream(dial)
	r.route = func(h *Head) *Upstream {
		if h.Path == "/watch" {
			return busy
		}
		return idle
	}
	resp, err := r.client.Get("https://relay.test/echo")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	watch, err := r.client.Get("https://relay.test/watch")
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Body.Close()
	idle.Retire()
	busy.Retire()
	if n := connCount(idle); n != 0 {
		t.Errorf("the retired idle replica keeps %d connections", n)
	}
	if n := connCount(busy); n != 1 {
		t.Errorf("the retired busy replica has %d connections while its stream runs, want 1", n)
	}
	close(release)
	got, err := io.ReadAll(watch.Body)
	if err != nil || string(got) != "the end\n" {
		t.Fatalf("the stream on the retired replica: %q %v", got, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for connCount(busy) != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := connCount(busy); n != 0 {
		t.Errorf("the retired replica keeps %d connections after its last stream", n)
	}
}

func connCount(u *Upstream) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.conns)
}
