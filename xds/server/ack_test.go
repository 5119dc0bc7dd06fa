package server_test

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr/testr"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tendril-net/tendril/internal/testing/testnet"
	"github.com/tendril-net/tendril/internal/testing/testwait"
	"github.com/tendril-net/tendril/xds/ads"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/store"
)

// ackClient is a delta client that ACKs every response unless refuse returns an error for it,
// and can hold its answers back to keep the server waiting.
type ackClient struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	refuse func(*discoveryv3.DeltaDiscoveryResponse) error
	hold   bool
	held   []*discoveryv3.DeltaDiscoveryRequest
	stream discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
}

func newAckClient(t *testing.T, addr, id string) *ackClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	st, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := &ackClient{cancel: cancel, done: make(chan struct{}), stream: st}
	for _, typ := range store.Types {
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: id}, TypeUrl: typ}); err != nil {
			t.Fatal(err)
		}
	}
	go func() {
		defer close(c.done)
		defer conn.Close()
		for {
			r, err := st.Recv()
			if err != nil {
				return
			}
			ack := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}
			c.mu.Lock()
			if c.refuse != nil {
				if err := c.refuse(r); err != nil {
					ack.ErrorDetail = &status.Status{Code: 3, Message: err.Error()}
				}
			}
			if c.hold {
				c.held = append(c.held, ack)
				c.mu.Unlock()
				continue
			}
			c.mu.Unlock()
			if err := st.Send(ack); err != nil {
				return
			}
		}
	}()
	t.Cleanup(c.close)
	return c
}

// release sends the held answers and stops holding.
func (c *ackClient) release(t *testing.T) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hold = false
	for _, a := range c.held {
		if err := c.stream.Send(a); err != nil {
			t.Fatal(err)
		}
	}
	c.held = nil
}

func (c *ackClient) close() {
	c.cancel()
	<-c.done
}

// startServer serves s on a loopback listener until the test ends and returns its address.
func startServer(t testing.TB, s *server.Server) string {
	t.Helper()
	l := testnet.Listen(t)
	testwait.Run(t, "xDS server", func(ctx context.Context) error { return s.Serve(ctx, l) })
	return l.Addr().String()
}

// dialADS connects to the xDS server at addr in plaintext, with opts besides, until the test
// ends.
func dialADS(t testing.TB, addr string, opts ...grpc.DialOption) discoveryv3.AggregatedDiscoveryServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
}

// waitState polls until shoot reaches want; the server's notifications are exercised separately.
func waitState(t *testing.T, s *server.Server, shoot string, want model.State) model.ShootStatus {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := s.ShootStatus(shoot)
		if st.State == want {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: state %s (%+v), want %s", shoot, st.State, st, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestShootStatus follows one shoot through the states as two clients connect, ACK, hold back,
// NACK and disconnect, and checks that notifications name only shoots whose state changed.
func TestShootStatus(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(5)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	a := set[2].Name
	if st := s.ShootStatus(a); st.State != model.StatePending || st.Clients != 0 {
		t.Fatalf("no client connected: %+v, want pending with 0 clients", st)
	}
	if st := s.ShootStatus("shoot--p--nope"); st.State != model.StateUnknown {
		t.Fatalf("unknown shoot: %+v", st)
	}
	addr := startServer(t, s)
	c1 := newAckClient(t, addr, "ingress-1")
	st := waitState(t, s, a, model.StateProgrammed)
	if st.Clients != 1 || st.Model.Name != a {
		t.Fatalf("programmed: %+v", st)
	}
	s.TakeStatusChanges()

	// A second replica that holds its answers back: it is not synced, so it does not hold the
	// programmed shoots back either.
	c2 := newAckClient(t, addr, "ingress-2")
	c2.mu.Lock()
	c2.hold = true
	c2.mu.Unlock()
	time.Sleep(50 * time.Millisecond) // time for its initial responses; nothing may change
	if st := s.ShootStatus(a); st.State != model.StateProgrammed || st.Clients != 1 {
		t.Fatalf("while a new replica loads: %+v, want programmed by 1 client", st)
	}
	c2.release(t)
	testwait.Until(t, "second replica synced", func() bool { return s.ShootStatus(a).Clients == 2 })
	if ch := s.TakeStatusChanges(); len(ch) != 0 {
		t.Fatalf("a replica connecting changed %d statuses, want none: %+v", len(ch), ch)
	}

	// A change of shoot a, held back by c2: pending until c2 answers.
	c2.mu.Lock()
	c2.hold = true
	c2.mu.Unlock()
	set[2].APIServers = []netip.AddrPort{netip.MustParseAddrPort("10.99.0.1:443"), netip.MustParseAddrPort("10.99.0.2:443")}
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "change pending", func() bool {
		st := s.ShootStatus(a)
		return st.State == model.StatePending && len(st.Model.APIServers) == 2
	})
	select {
	case <-s.StatusChanges():
	default:
		t.Fatal("no notification after a change")
	}
	if ch := s.TakeStatusChanges(); len(ch) != 1 || ch[0].Name != a {
		t.Fatalf("changes %+v, want only %s", ch, a)
	}
	c2.release(t)
	waitState(t, s, a, model.StateProgrammed)
	if ch := s.TakeStatusChanges(); len(ch) != 1 || ch[0].Name != a || ch[0].State != model.StateProgrammed {
		t.Fatalf("changes %+v, want %s programmed", ch, a)
	}

	// c2 refuses anything about shoot a: rejected with its detail; other shoots unaffected.
	c2.mu.Lock()
	c2.refuse = func(r *discoveryv3.DeltaDiscoveryResponse) error {
		for _, res := range r.GetResources() {
			if strings.Contains(res.GetName(), a) || strings.Contains(res.GetName(), "s2.") {
				return errBad
			}
		}
		return nil
	}
	c2.mu.Unlock()
	set[2].Hosts = append(set[2].Hosts, "extra.s2.example.com")
	set[3].APIServers = []netip.AddrPort{netip.MustParseAddrPort("10.99.0.3:443")}
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	st = waitState(t, s, a, model.StateRejected)
	if !strings.Contains(st.Detail, "ingress-2") || !strings.Contains(st.Detail, errBad.Error()) {
		t.Errorf("rejected detail %q, want the node and its message", st.Detail)
	}
	waitState(t, s, set[3].Name, model.StateProgrammed)

	// The refusing replica goes away: every remaining client holds shoot a.
	c2.close()
	waitState(t, s, a, model.StateProgrammed)
	if st := s.ShootStatus(a); st.Clients != 1 {
		t.Errorf("after a replica left: %+v, want 1 client", st)
	}

	// Removal is reported once, as unknown.
	s.TakeStatusChanges()
	if _, err := s.Apply(append(append([]model.Shoot(nil), set[:2]...), set[3:]...)); err != nil {
		t.Fatal(err)
	}
	if ch := s.TakeStatusChanges(); len(ch) != 1 || ch[0].Name != a || ch[0].State != model.StateUnknown {
		t.Fatalf("changes after removal %+v, want %s unknown", ch, a)
	}
	c1.close()
}

// TestExpectedNodes: a shoot is programmed only once every expected node has a synced stream
// holding it; a connected client that is not expected still counts, and forgetting the
// expected set falls back to the connected clients.
func TestExpectedNodes(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(3)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	a := set[1].Name
	addr := startServer(t, s)
	s.SetExpectedNodes([]string{"ingress-1", "ingress-2"})
	newAckClient(t, addr, "ingress-1")
	testwait.Until(t, "ingress-1 synced", func() bool { return s.ShootStatus(a).Clients == 1 })
	st := s.ShootStatus(a)
	if st.State != model.StatePending || !slices.Equal(st.Missing, []string{"ingress-2"}) {
		t.Fatalf("one of two expected replicas synced: %+v, want pending, ingress-2 missing", st)
	}
	s.TakeStatusChanges()

	c2 := newAckClient(t, addr, "ingress-2")
	st = waitState(t, s, a, model.StateProgrammed)
	if st.Clients != 2 || len(st.Missing) != 0 {
		t.Fatalf("both synced: %+v", st)
	}
	if ch := s.TakeStatusChanges(); len(ch) != len(set) {
		t.Fatalf("the last expected replica syncing changed %d statuses, want %d", len(ch), len(set))
	}

	// ingress-2 goes away (its connection breaks, or it moves to another instance): pending
	// again while it is expected, programmed once it no longer is.
	c2.close()
	waitState(t, s, a, model.StatePending)
	s.SetExpectedNodes([]string{"ingress-1"})
	waitState(t, s, a, model.StateProgrammed)
	s.SetExpectedNodes(nil)
	if st := s.ShootStatus(a); st.State != model.StateProgrammed || st.Clients != 1 {
		t.Fatalf("no expected set: %+v, want programmed by the connected client", st)
	}
}

var errBad = badError("cluster does not parse")

type badError string

func (e badError) Error() string { return string(e) }

// TestReconnectWithKnownVersions: a client that reconnects naming the versions it holds gets
// nothing resent and still counts as holding them.
func TestReconnectWithKnownVersions(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(3)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	addr := startServer(t, s)
	c := newDeltaClientAt(t, addr)
	got := c.recvTypes(t, len(store.Types))
	known := map[string]map[string]string{}
	for typ, r := range got {
		known[typ] = map[string]string{}
		for _, res := range r.GetResources() {
			known[typ][res.GetName()] = res.GetVersion()
		}
	}
	waitState(t, s, set[1].Name, model.StateProgrammed)
	c.cancel()

	st := openDelta(t, addr, node, known)
	for range store.Types {
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(r.GetResources()) != 0 {
			t.Fatalf("%s: %d resources resent to a client that holds them", r.GetTypeUrl(), len(r.GetResources()))
		}
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, "reconnected client synced", func() bool { return s.ShootStatus(set[1].Name).Clients == 1 })
	if st := s.ShootStatus(set[1].Name); st.State != model.StateProgrammed {
		t.Fatalf("after reconnect: %+v", st)
	}
}

type cancelDeltaClient struct {
	*deltaClient
	cancel context.CancelFunc
}

func newDeltaClientAt(t *testing.T, addr string) cancelDeltaClient {
	t.Helper()
	ads := dialADS(t, addr)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return cancelDeltaClient{newDeltaClient(ctx, t, ads), cancel}
}

// TestStreamsWaitForFirstApply: a client connecting before the first route set gets nothing,
// not an empty set that would withdraw what it holds, and then the set.
func TestStreamsWaitForFirstApply(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	addr := startServer(t, s)
	c := newDeltaClientAt(t, addr)
	select {
	case r := <-c.ch:
		t.Fatalf("response before the first Apply: %s with %d resources", r.GetTypeUrl(), len(r.GetResources()))
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := s.Apply(shoots(2)); err != nil {
		t.Fatal(err)
	}
	got := c.recvTypes(t, len(store.Types))
	if n := len(got[resourcev3.ClusterType].GetResources()); n != 2*3+1 {
		t.Fatalf("first clusters: %d", n)
	}
}

// TestFirstSyncInPieces: a first sync larger than one response's budget arrives in several
// responses of bounded size, each sent once the client answered the one before, that together
// hold every resource, and listeners only after the last cluster piece; the client counts for a
// shoot's status only once it holds all of them.
func TestFirstSyncInPieces(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(8000) // 24,000 clusters of ~170 B: ~4 MiB
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	st := openDelta(t, startServer(t, s), node, nil)
	want := s.Resources(resourcev3.ClusterType)
	got := map[string]bool{}
	pieces := 0
	for len(got) < len(want) {
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if r.GetTypeUrl() == resourcev3.ListenerType {
			// Listeners make a data plane ready: they come after every cluster piece.
			t.Fatalf("listeners sent with %d of %d clusters", len(got), len(want))
		}
		if r.GetTypeUrl() == resourcev3.ClusterType {
			pieces++
			size := 0
			for _, res := range r.GetResources() {
				if got[res.GetName()] {
					t.Fatalf("%s sent twice", res.GetName())
				}
				got[res.GetName()] = true
				size += len(res.GetResource().GetValue())
			}
			// The budget is 1 MiB; a piece may exceed it by its last resource.
			if size > 1<<20+64<<10 {
				t.Fatalf("piece %d carries %d bytes of clusters", pieces, size)
			}
			// The client answered every earlier piece but not this one: it holds part of the set
			// and must not count yet.
			if pieces == 2 {
				if sst := s.ShootStatus(set[0].Name); sst.Clients != 0 {
					t.Fatalf("a client in the middle of its first sync counts: %+v", sst)
				}
			}
		}
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}); err != nil {
			t.Fatal(err)
		}
	}
	if pieces < 3 {
		t.Fatalf("the first sync came in %d pieces, want several", pieces)
	}
	if !slices.Equal(slices.Sorted(maps.Keys(got)), want) {
		t.Fatal("the pieces do not add up to the served clusters")
	}
	t.Logf("%d clusters in %d pieces", len(want), pieces)
	// The endpoints and listeners arrive too; answer them until the client counts.
	go ackAll(st)
	for _, sh := range []string{set[0].Name, set[len(set)-1].Name} {
		if sst := waitState(t, s, sh, model.StateProgrammed); sst.Clients != 1 {
			t.Fatalf("%s: %+v", sh, sst)
		}
	}
}

// openDelta opens a delta stream to addr for node, subscribed to every type and naming the
// versions in known (nil: none held), for tests that answer the responses themselves. The stream
// and its connection end with the test.
func openDelta(t testing.TB, addr string, nd *corev3.Node, known map[string]map[string]string) discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient {
	t.Helper()
	return openDeltaTypes(t, addr, nd, known, store.Types)
}

// openDeltaTypes is openDelta subscribing only types.
func openDeltaTypes(t testing.TB, addr string, nd *corev3.Node, known map[string]map[string]string, types []string) discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient {
	t.Helper()
	client := dialADS(t, addr, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(ads.MaxRecvMsgSize)))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := client.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range types {
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: nd, TypeUrl: typ, InitialResourceVersions: known[typ]}); err != nil {
			t.Fatal(err)
		}
	}
	return st
}

// ackAll answers every response on st until the stream ends.
func ackAll(st discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient) {
	ackEach(st, func(*discoveryv3.DeltaDiscoveryResponse) {})
}

// ackEach answers every response on st, as a data plane would, and then passes it to seen, until
// the stream ends.
func ackEach(st discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient, seen func(*discoveryv3.DeltaDiscoveryResponse)) {
	for {
		r, err := st.Recv()
		if err != nil {
			return
		}
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}); err != nil {
			return
		}
		seen(r)
	}
}

// TestUnsupportedTypeIgnored: a request for a type tendril does not serve is ignored; the stream
// goes on serving the others, including changes after it.
func TestUnsupportedTypeIgnored(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(2)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	st := openDelta(t, startServer(t, s), node, nil)
	if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"}); err != nil {
		t.Fatal(err)
	}
	recv := func() *discoveryv3.DeltaDiscoveryResponse {
		t.Helper()
		r, err := st.Recv()
		if err != nil {
			t.Fatalf("stream ended: %v", err)
		}
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}); err != nil {
			t.Fatal(err)
		}
		return r
	}
	got := map[string]bool{}
	for range store.Types {
		got[recv().GetTypeUrl()] = true
	}
	if len(got) != len(store.Types) {
		t.Fatalf("first responses for %v, want one per served type", got)
	}
	set[1].APIServer = netip.MustParseAddrPort("10.99.0.1:443")
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	if r := recv(); r.GetTypeUrl() != resourcev3.EndpointType || len(r.GetResources()) != 1 {
		t.Fatalf("after a change: %s with %d resources", r.GetTypeUrl(), len(r.GetResources()))
	}
}

// TestOnDemandSecrets: a client that asks only for listeners, clusters and endpoints (Envoy
// asks for secrets only once a listener names one) still syncs and has passthrough shoots
// programmed; a terminating shoot stays pending for it until it holds the shoot's secrets.
func TestOnDemandSecrets(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(2)
	tm, err := modeltest.Termination(set[1].Hosts[0])
	if err != nil {
		t.Fatal(err)
	}
	set[1].Termination = tm
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, typ := range store.Types {
		if !store.OnDemand(typ) {
			types = append(types, typ)
		}
	}
	st := openDeltaTypes(t, startServer(t, s), node, nil, types)
	go ackAll(st)
	waitState(t, s, set[0].Name, model.StateProgrammed)
	// The client's sync evaluated every shoot under one lock: the other's state is final here.
	if got := s.ShootStatus(set[1].Name); got.State != model.StatePending {
		t.Errorf("terminating shoot %s for a client without its secrets: %+v", set[1].Name, got)
	}
}

// TestRefusalIsolated: a client that refuses one shoot's resources (an older ingress that does
// not know them, during a rollout) refuses the whole responses they came in, which carry other
// shoots' resources too; the server sends those again in halves until only the refused shoot's
// are refused: it alone is Rejected, every other shoot is Programmed on that client.
func TestRefusalIsolated(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(40)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	bad := set[17].Name
	addr := startServer(t, s)
	c := newAckClient(t, addr, "ingress-old")
	var responses, refusals atomic.Int64
	c.mu.Lock()
	c.refuse = func(r *discoveryv3.DeltaDiscoveryResponse) error {
		responses.Add(1)
		for _, res := range r.GetResources() {
			if strings.Contains(res.GetName(), bad) || strings.Contains(res.GetName(), "s17.") {
				refusals.Add(1)
				return errBad
			}
		}
		return nil
	}
	c.mu.Unlock()
	st := waitState(t, s, bad, model.StateRejected)
	if !strings.Contains(st.Detail, errBad.Error()) {
		t.Errorf("rejected detail %q", st.Detail)
	}
	for _, sh := range set {
		if sh.Name != bad {
			waitState(t, s, sh.Name, model.StateProgrammed)
		}
	}
	t.Logf("%d responses, %d refused", responses.Load(), refusals.Load())
}
