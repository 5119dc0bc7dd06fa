package xdsclient

import (
	"context"
	"errors"
	"net"
	"regexp"
	"sync"
	"testing"
	"time"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/go-logr/logr/funcr"
	"github.com/go-logr/logr/testr"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// xdsServer is go-control-plane's own server over one LinearCache, recording what clients send.
type xdsServer struct {
	cache *cachev3.LinearCache
	addr  string
	reqs  chan *discoveryv3.DeltaDiscoveryRequest
	stop  func()
}

func startServer(t *testing.T, cache *cachev3.LinearCache, addr string) *xdsServer {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &xdsServer{cache: cache, addr: l.Addr().String(), reqs: make(chan *discoveryv3.DeltaDiscoveryRequest, 100)}
	ctx, cancel := context.WithCancel(context.Background())
	g := grpc.NewServer()
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, serverv3.NewServer(ctx, cache, serverv3.CallbackFuncs{
		StreamDeltaRequestFunc: func(_ int64, r *discoveryv3.DeltaDiscoveryRequest) error {
			s.reqs <- r
			return nil
		},
	}))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = g.Serve(l)
	}()
	s.stop = func() {
		g.Stop()
		cancel()
		wg.Wait()
	}
	return s
}

func (s *xdsServer) next(t *testing.T) *discoveryv3.DeltaDiscoveryRequest {
	t.Helper()
	select {
	case r := <-s.reqs:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no request from the client within 10 s")
		return nil
	}
}

func TestAckNackAndResume(t *testing.T) {
	cache := cachev3.NewLinearCache(resourcev3.ListenerType)
	if err := cache.UpdateResource("good", &listenerv3.Listener{Name: "good"}); err != nil {
		t.Fatal(err)
	}
	srv := startServer(t, cache, "127.0.0.1:0")

	applied := make(chan Update, 10)
	handler := func(u Update) error {
		for _, r := range u.Resources {
			if r.GetName() == "bad" {
				return errors.New("listener bad: not servable")
			}
		}
		applied <- u
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Address: srv.addr, NodeID: "n1", Types: []string{resourcev3.ListenerType}, Log: testr.New(t), MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}, handler)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	if r := srv.next(t); r.GetNode().GetId() != "n1" || r.GetResponseNonce() != "" {
		t.Fatalf("first request: %v", r)
	}
	if r := srv.next(t); r.GetResponseNonce() == "" || r.GetErrorDetail() != nil {
		t.Fatalf("want an ACK, got %v", r)
	}
	if u := <-applied; len(u.Resources) != 1 || u.Resources[0].GetName() != "good" || u.Version == "" {
		t.Fatalf("applied %+v", u)
	}

	if err := cache.UpdateResource("bad", &listenerv3.Listener{Name: "bad"}); err != nil {
		t.Fatal(err)
	}
	if r := srv.next(t); r.GetErrorDetail().GetMessage() != "listener bad: not servable" {
		t.Fatalf("want a NACK with the handler's error, got %v", r)
	}
	if err := cache.DeleteResource("bad"); err != nil {
		t.Fatal(err)
	}
	// The server tracks what it sent, NACKed or not, so it announces the removal; the client,
	// which never applied the resource, ACKs it.
	if r := srv.next(t); r.GetErrorDetail() != nil {
		t.Fatalf("want an ACK after the removal, got %v", r)
	}

	// Restart the server on the same address: the client reconnects and tells it the versions
	// it holds, so nothing is sent again.
	addr := srv.addr
	srv.stop()
	srv = startServer(t, cache, addr)
	defer srv.stop()
	r := srv.next(t)
	if v, ok := r.GetInitialResourceVersions()["good"]; !ok || v == "" {
		t.Fatalf("reconnect request carries versions %v, want good's", r.GetInitialResourceVersions())
	}
	if _, ok := r.GetInitialResourceVersions()["bad"]; ok {
		t.Fatal("the NACKed resource is reported as held")
	}
}

// TestReconnectsAtItsOwnPace: while the server is away (here: a port that accepts and closes
// at once, as a control-plane replica that is not leading, reached through a Service, looks),
// the client tries again at its own backoff, at most MaxBackoff apart. gRPC's connection
// backoff alone (1 s growing to 120 s) would hold a replica away from a new leader for
// minutes after a failover.
func TestReconnectsAtItsOwnPace(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	attempts := make(chan struct{}, 100)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
			select {
			case attempts <- struct{}{}:
			default:
			}
		}
	})
	defer func() {
		l.Close()
		wg.Wait()
	}()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Address: l.Addr().String(), NodeID: "n1", Types: []string{resourcev3.ListenerType}, Log: testr.New(t), MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}, func(Update) error { return nil })
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	// 12 attempts: at most 12 × 50 ms apart with the client's backoff; gRPC's own would space
	// them 1 s, 1.6 s, 2.6 s, … (about 3 minutes in all).
	deadline := time.After(60 * time.Second)
	for n := range 12 {
		select {
		case <-attempts:
		case <-deadline:
			t.Fatalf("%d connection attempts within 60 s", n)
		}
	}
}

// TestBackoffStartsOverAfterAResponse: control-plane restarts (a rollout, leader changes) find the
// client waiting MinBackoff (with jitter: at most MinBackoff) before each reconnect, because every
// stream got a response; before, the wait doubled per restart towards MaxBackoff. The waits are
// the ones the client logs, so the test does not depend on how fast the machine reconnects.
func TestBackoffStartsOverAfterAResponse(t *testing.T) {
	cache := cachev3.NewLinearCache(resourcev3.ListenerType)
	if err := cache.UpdateResource("good", &listenerv3.Listener{Name: "good"}); err != nil {
		t.Fatal(err)
	}
	srv := startServer(t, cache, "127.0.0.1:0")
	waits := make(chan time.Duration, 100)
	log := funcr.New(func(_, args string) {
		if m := afterRE.FindStringSubmatch(args); m != nil {
			if d, err := time.ParseDuration(m[1]); err == nil {
				waits <- d
			}
		}
	}, funcr.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	const minB = 50 * time.Millisecond
	go func() {
		done <- Run(ctx, Config{Address: srv.addr, NodeID: "n1", Types: []string{resourcev3.ListenerType}, Log: log,
			MinBackoff: minB, MaxBackoff: 10 * time.Second}, func(Update) error { return nil })
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	addr := srv.addr
	srv.next(t) // subscription
	srv.next(t) // the ACK: the stream got its response
	for restart := range 8 {
		srv.stop()
		srv = startServer(t, cache, addr)
		select {
		case w := <-waits:
			// Doubling would have reached 50 ms × 2^7 = 6.4 s by the last restart.
			if w > minB {
				t.Fatalf("restart %d: the client waited %v, want at most %v", restart, w, minB)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("restart %d: the client logged no reconnect", restart)
		}
		srv.next(t) // subscription on the new server
		srv.next(t) // its ACK
	}
	srv.stop()
}

// afterRE finds the wait in the client's "reconnecting" log line.
var afterRE = regexp.MustCompile(`"after"="([^"]+)"`)
