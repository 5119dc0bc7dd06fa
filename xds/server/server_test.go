package server_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr/testr"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/model/modeltest"
	"github.com/tendril-net/tendril/xds/server"
	"github.com/tendril-net/tendril/xds/store"
	"github.com/tendril-net/tendril/xds/translate"
)

func shoot(i int, hosts int) model.Shoot {
	s := model.Shoot{
		Name:      fmt.Sprintf("shoot--p--s%d", i),
		APIServer: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 1}), 443),
	}
	for h := range hosts {
		s.Hosts = append(s.Hosts, fmt.Sprintf("api%d.s%d.example.com", h, i))
	}
	return s
}

func shoots(n int) []model.Shoot {
	out := make([]model.Shoot, n)
	for i := range out {
		out[i] = shoot(i, 2)
	}
	return out
}

func TestApplySkipsUnchanged(t *testing.T) {
	s := server.New(server.Config{Log: testr.New(t)})
	set := shoots(20)
	st, err := s.Apply(set)
	if err != nil {
		t.Fatal(err)
	}
	// 20 shoots × (2 SNI clusters + 1 CONNECT cluster + 1 assignment) + 3 listeners + the
	// blackhole cluster.
	if st.Updated != 20*4+4 || st.Removed != 0 {
		t.Fatalf("first apply: %+v", st)
	}
	if st, _ = s.Apply(shoots(20)); st != (model.Stats{}) {
		t.Fatalf("no-op apply changed something: %+v", st)
	}
	// Moving a host from one shoot to another is an update of its cluster, never a removal.
	set = shoots(20)
	set[3].Hosts = set[3].Hosts[:1]
	set[4].Hosts = append(set[4].Hosts, "api1.s3.example.com")
	if st, err = s.Apply(set); err != nil {
		t.Fatal(err)
	}
	if st.Translated != 2 || st.Updated != 1 || st.Removed != 0 {
		t.Fatalf("host move: %+v, want 2 translated, 1 updated (the moved cluster's service), 0 removed", st)
	}
	if st, _ = s.Apply(set[1:]); st.Removed != 4 || st.Updated != 0 {
		t.Fatalf("removing a shoot: %+v, want its 3 clusters and 1 assignment removed", st)
	}
	bad := append(set[1:], set[1]) // duplicate name
	if _, err := s.Apply(bad); err == nil {
		t.Fatal("a set with a duplicate shoot was accepted")
	}
	if want := 19*3 + 1; len(s.Resources(resourcev3.ClusterType)) != want {
		t.Errorf("%d clusters after a refused apply, want the last good set's %d", len(s.Resources(resourcev3.ClusterType)), want)
	}
}

// TestApplyValidatesLikeValidateSet applies a random walk of route sets in which shoots swap,
// move, duplicate and drop server names and advertised addresses. Apply checks only what changed
// against what stays; it must accept exactly the sets model.ValidateSet accepts, and after each
// one serve what a fresh server serves for that set.
func TestApplyValidatesLikeValidateSet(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const shootsN, hostsN, addrsN = 12, 30, 8
	host := func() string { return fmt.Sprintf("h%d.example.com", rng.IntN(hostsN)) }
	addr := func() netip.Addr { return netip.AddrFrom4([4]byte{240, 0, 0, byte(rng.IntN(addrsN))}) }
	// random makes one to three changes to the last accepted set, as sources do.
	var last []model.Shoot
	random := func() []model.Shoot {
		set := slices.Clone(last)
		for range 1 + rng.IntN(3) {
			i := -1
			if len(set) > 0 {
				i = rng.IntN(len(set))
			}
			switch op := rng.IntN(8); {
			case op == 0 || i < 0: // add a shoot
				sh := shoot(rng.IntN(shootsN), 0)
				sh.Hosts = []string{host()}
				set = append(set, sh)
			case op == 1: // remove one
				set = slices.Delete(set, i, i+1)
			case op == 2: // list one twice
				set = append(set, set[i])
			case op == 3: // swap the server names of two
				j := rng.IntN(len(set))
				set[i].Hosts, set[j].Hosts = set[j].Hosts, set[i].Hosts
			case op == 4: // move a server name from one to another
				j := rng.IntN(len(set))
				if len(set[i].Hosts) > 1 {
					h := set[i].Hosts[len(set[i].Hosts)-1]
					set[i].Hosts = slices.Clone(set[i].Hosts[:len(set[i].Hosts)-1])
					set[j].Hosts = append(slices.Clone(set[j].Hosts), h)
				}
			case op == 5: // a new server name
				set[i].Hosts = append(slices.Clone(set[i].Hosts), host())
			case op == 6: // swap the advertised addresses of two
				j := rng.IntN(len(set))
				set[i].AdvertisedAddress, set[j].AdvertisedAddress = set[j].AdvertisedAddress, set[i].AdvertisedAddress
			default: // a new advertised address, or none
				set[i].AdvertisedAddress = netip.Addr{}
				if rng.IntN(2) == 0 {
					set[i].AdvertisedAddress = addr()
				}
			}
		}
		return set
	}
	s := server.New(server.Config{})
	accepted, refused := 0, 0
	for i := range 2000 {
		set := random()
		want := model.ValidateSet(set)
		_, err := s.Apply(set)
		if (err == nil) != (want == nil) {
			t.Fatalf("set %d: Apply: %v; ValidateSet: %v", i, err, want)
		}
		if err != nil {
			refused++
			continue
		}
		accepted++
		last = set
		fresh := server.New(server.Config{})
		if _, err := fresh.Apply(set); err != nil {
			t.Fatal(err)
		}
		for _, typ := range store.Types {
			if got, want := s.Resources(typ), fresh.Resources(typ); !slices.Equal(got, want) {
				t.Fatalf("set %d: %s %v, a fresh server serves %v", i, typ, got, want)
			}
		}
	}
	// The walk must exercise both outcomes, or it proves nothing.
	if accepted < 100 || refused < 100 {
		t.Fatalf("%d sets accepted, %d refused: the walk is lopsided", accepted, refused)
	}
	t.Logf("%d sets accepted, %d refused", accepted, refused)
}

// TestADSBothProtocols drives the real gRPC server with a delta and a state-of-the-world client
// at once and checks what each shoot change sends.
func TestADSBothProtocols(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := server.New(server.Config{Log: testr.NewWithOptions(t, testr.Options{Verbosity: 0})})
	set := shoots(50)
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	ads := dialADS(t, startServer(t, s))

	delta := newDeltaClient(ctx, t, ads)
	sotw := newSotwClient(ctx, t, ads)

	// Initial state: every resource once on each protocol.
	got := delta.recvTypes(t, len(store.Types))
	if n := len(got[resourcev3.ClusterType].GetResources()); n != 50*3+1 {
		t.Fatalf("delta initial clusters: %d", n)
	}
	if n := len(got[resourcev3.EndpointType].GetResources()); n != 50 {
		t.Fatalf("delta initial endpoints: %d", n)
	}
	sgot := sotw.recvTypes(t, len(store.Types))
	listenerVersion := sgot[resourcev3.ListenerType].GetVersionInfo()

	// A no-op apply followed by a real change: the first response on each stream must be the
	// change, so the no-op sent nothing.
	if st, _ := s.Apply(shoots(50)); st.Updated+st.Removed != 0 {
		t.Fatalf("no-op apply: %+v", st)
	}
	set[7].APIServer = netip.MustParseAddrPort("10.99.0.7:6443")
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	r := delta.recv(t)
	if r.GetTypeUrl() != resourcev3.EndpointType || len(r.GetResources()) != 1 || r.GetResources()[0].GetName() != translate.APIServerService(set[7].Name) {
		t.Fatalf("delta after no-op + endpoint change: %s with %d resources, want only %s's assignment", r.GetTypeUrl(), len(r.GetResources()), set[7].Name)
	}
	sr := sotw.recv(t)
	if sr.GetTypeUrl() != resourcev3.EndpointType || !containsEndpoint(t, sr, "10.99.0.7") {
		t.Fatalf("sotw after no-op + endpoint change: %s, want the endpoints with the new address", sr.GetTypeUrl())
	}

	// 100 shoot changes (add a host, remove it again, add a shoot, remove it): the listener is
	// never sent again, and each change sends only the changed shoot's resources.
	for i := range 100 {
		next := append([]model.Shoot(nil), set...)
		var wantType string
		var wantUpdated, wantRemoved int
		switch i % 4 {
		case 0:
			next[i%50].Hosts = append(append([]string(nil), next[i%50].Hosts...), fmt.Sprintf("extra%d.example.com", i))
			wantType, wantUpdated = resourcev3.ClusterType, 1
		case 1: // back to set: the extra host's cluster goes
			wantType, wantRemoved = resourcev3.ClusterType, 1
		case 2:
			next = append(next, shoot(1000+i, 2))
			wantType, wantUpdated = resourcev3.ClusterType, 3
		case 3: // back to set: the added shoot's clusters and assignment go
			wantType, wantRemoved = resourcev3.ClusterType, 3
		}
		if i%2 == 0 {
			if _, err := s.Apply(next); err != nil {
				t.Fatal(err)
			}
		} else if _, err := s.Apply(set); err != nil {
			t.Fatal(err)
		}
		// Types are answered on their own watches, so their order within one change is free.
		n := 1
		if i%4 >= 2 { // a shoot added or removed also adds or removes its assignment
			n = 2
		}
		got := delta.recvTypes(t, n)
		if r := got[wantType]; len(r.GetResources()) != wantUpdated || len(r.GetRemovedResources()) != wantRemoved || len(got) != n {
			t.Fatalf("change %d: delta sent %d types, %s +%d -%d, want %s +%d -%d", i, len(got), wantType, len(r.GetResources()), len(r.GetRemovedResources()), wantType, wantUpdated, wantRemoved)
		}
		if n == 2 {
			if r := got[resourcev3.EndpointType]; len(r.GetResources())+len(r.GetRemovedResources()) != 1 {
				t.Fatalf("change %d: delta sent %d assignments, want one", i, len(r.GetResources())+len(r.GetRemovedResources()))
			}
		}
		// The sotw stream re-sends the full cluster list (the protocol's cost, which is why the
		// data planes use delta) but never the listener. Endpoints are not full-state in sotw, so
		// a removed assignment is not announced there; an added one is.
		sr := sotw.recv(t)
		if sr.GetTypeUrl() == resourcev3.ListenerType {
			t.Fatalf("change %d re-sent the listener on sotw", i)
		}
		if i%4 == 2 {
			if sr := sotw.recv(t); sr.GetTypeUrl() == resourcev3.ListenerType {
				t.Fatalf("change %d re-sent the listener on sotw", i)
			}
		}
	}
	// Nothing further is pending: a final endpoint change is the very next response on both.
	set[9].APIServer = netip.MustParseAddrPort("10.99.0.9:6443")
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	if r := delta.recv(t); r.GetTypeUrl() != resourcev3.EndpointType || len(r.GetResources()) != 1 {
		t.Fatalf("final change: delta sent %s with %d resources", r.GetTypeUrl(), len(r.GetResources()))
	}
	if sr := sotw.recv(t); sr.GetTypeUrl() != resourcev3.EndpointType {
		t.Fatalf("final change: sotw sent %s", sr.GetTypeUrl())
	}
	if v := sotw.versions[resourcev3.ListenerType]; v != listenerVersion {
		t.Errorf("listener version changed from %s to %s", listenerVersion, v)
	}
}

func containsEndpoint(t *testing.T, r *discoveryv3.DiscoveryResponse, ip string) bool {
	t.Helper()
	for _, a := range r.GetResources() {
		if bytes.Contains(a.GetValue(), []byte(ip)) {
			return true
		}
	}
	return false
}

var node = &corev3.Node{Id: "test"}

type deltaClient struct {
	stream discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	ch     chan *discoveryv3.DeltaDiscoveryResponse
}

func newDeltaClient(ctx context.Context, t testing.TB, ads discoveryv3.AggregatedDiscoveryServiceClient) *deltaClient {
	st, err := ads.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range store.Types {
		if err := st.Send(&discoveryv3.DeltaDiscoveryRequest{Node: node, TypeUrl: typ}); err != nil {
			t.Fatal(err)
		}
	}
	c := &deltaClient{stream: st, ch: make(chan *discoveryv3.DeltaDiscoveryResponse, 1000)}
	go func() {
		defer close(c.ch)
		ackEach(st, func(r *discoveryv3.DeltaDiscoveryResponse) { c.ch <- r })
	}()
	return c
}

func (c *deltaClient) recv(t testing.TB) *discoveryv3.DeltaDiscoveryResponse {
	t.Helper()
	select {
	case r, ok := <-c.ch:
		if !ok {
			t.Fatal("delta stream ended")
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no delta response within 10 s")
		return nil
	}
}

func (c *deltaClient) recvTypes(t testing.TB, n int) map[string]*discoveryv3.DeltaDiscoveryResponse {
	t.Helper()
	return byType(n, func() *discoveryv3.DeltaDiscoveryResponse { return c.recv(t) })
}

// byType receives n responses with recv and returns them by type URL.
func byType[Resp interface{ GetTypeUrl() string }](n int, recv func() Resp) map[string]Resp {
	out := map[string]Resp{}
	for range n {
		r := recv()
		out[r.GetTypeUrl()] = r
	}
	return out
}

// recvAll receives responses until the client holds every resource s serves: a first sync that
// spans several responses.
func (c *deltaClient) recvAll(t testing.TB, s *server.Server) {
	t.Helper()
	held := map[string]map[string]bool{}
	complete := func() bool {
		for _, typ := range store.Types {
			if len(held[typ]) != len(s.Resources(typ)) {
				return false
			}
		}
		return true
	}
	for !complete() {
		r := c.recv(t)
		if held[r.GetTypeUrl()] == nil {
			held[r.GetTypeUrl()] = map[string]bool{}
		}
		for _, res := range r.GetResources() {
			held[r.GetTypeUrl()][res.GetName()] = true
		}
	}
}

type sotwClient struct {
	ch       chan *discoveryv3.DiscoveryResponse
	versions map[string]string // owned by the test goroutine, updated in recv
}

func newSotwClient(ctx context.Context, t *testing.T, ads discoveryv3.AggregatedDiscoveryServiceClient) *sotwClient {
	st, err := ads.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range store.Types {
		if err := st.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: typ}); err != nil {
			t.Fatal(err)
		}
	}
	c := &sotwClient{ch: make(chan *discoveryv3.DiscoveryResponse, 1000), versions: map[string]string{}}
	go func() {
		defer close(c.ch)
		for {
			r, err := st.Recv()
			if err != nil {
				return
			}
			if err := st.Send(&discoveryv3.DiscoveryRequest{TypeUrl: r.GetTypeUrl(), VersionInfo: r.GetVersionInfo(), ResponseNonce: r.GetNonce()}); err != nil {
				return
			}
			c.ch <- r
		}
	}()
	return c
}

func (c *sotwClient) recv(t *testing.T) *discoveryv3.DiscoveryResponse {
	t.Helper()
	select {
	case r, ok := <-c.ch:
		if !ok {
			t.Fatal("sotw stream ended")
		}
		c.versions[r.GetTypeUrl()] = r.GetVersionInfo()
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no sotw response within 10 s")
		return nil
	}
}

func (c *sotwClient) recvTypes(t *testing.T, n int) map[string]*discoveryv3.DiscoveryResponse {
	t.Helper()
	return byType(n, func() *discoveryv3.DiscoveryResponse { return c.recv(t) })
}

// TestResourcesOnTheWire checks that what both protocols send is exactly the deterministic
// encoding of the translated resources under their own type URL, and that delta versions are
// go-control-plane's hash of it (HashResource), the versions tendril sent while it served from
// go-control-plane's caches: a data plane reconnecting across that upgrade is not resent all.
func TestResourcesOnTheWire(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := server.New(server.Config{Log: testr.New(t)})
	set := []model.Shoot{modeltest.Shoot(1), modeltest.Shoot(2)}
	if _, err := s.Apply(set); err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string][]byte{} // type → name → encoding
	res := translate.All(translate.Options{}, set)
	add := func(typ, name string, m proto.Message) {
		b, err := cachev3.MarshalResource(m)
		if err != nil {
			t.Fatal(err)
		}
		if want[typ] == nil {
			want[typ] = map[string][]byte{}
		}
		want[typ][name] = b
	}
	for _, c := range res.Clusters {
		add(resourcev3.ClusterType, c.GetName(), c)
	}
	for _, e := range res.Endpoints {
		add(resourcev3.EndpointType, e.GetClusterName(), e)
	}
	for _, l := range res.Listeners {
		add(resourcev3.ListenerType, l.GetName(), l)
	}

	ads := dialADS(t, startServer(t, s))

	delta := newDeltaClient(ctx, t, ads)
	for typ, r := range delta.recvTypes(t, len(store.Types)) {
		if len(r.GetResources()) != len(want[typ]) {
			t.Errorf("delta %s: %d resources, want %d", typ, len(r.GetResources()), len(want[typ]))
		}
		for _, x := range r.GetResources() {
			b, ok := want[typ][x.GetName()]
			switch {
			case !ok:
				t.Errorf("delta %s: unexpected %s", typ, x.GetName())
			case x.GetResource().GetTypeUrl() != typ || !bytes.Equal(x.GetResource().GetValue(), b):
				t.Errorf("delta %s %s: %s %x, want %x", typ, x.GetName(), x.GetResource().GetTypeUrl(), x.GetResource().GetValue(), b)
			case x.GetVersion() != cachev3.HashResource(b):
				t.Errorf("delta %s %s: version %s, want %s", typ, x.GetName(), x.GetVersion(), cachev3.HashResource(b))
			}
			if _, err := x.GetResource().UnmarshalNew(); err != nil {
				t.Errorf("delta %s %s: %v", typ, x.GetName(), err)
			}
		}
	}

	st, err := ads.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range store.Types {
		if err := st.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: typ}); err != nil {
			t.Fatal(err)
		}
	}
	for range store.Types {
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		typ := r.GetTypeUrl()
		var got [][]byte
		for _, a := range r.GetResources() {
			if a.GetTypeUrl() != typ {
				t.Errorf("sotw %s: resource of type %s", typ, a.GetTypeUrl())
			}
			got = append(got, a.GetValue())
		}
		var exp [][]byte
		for _, b := range want[typ] {
			exp = append(exp, b)
		}
		cmpBytes := func(a, b []byte) int { return bytes.Compare(a, b) }
		slices.SortFunc(got, cmpBytes)
		slices.SortFunc(exp, cmpBytes)
		if !slices.EqualFunc(got, exp, bytes.Equal) {
			t.Errorf("sotw %s: %d resources differ from the %d translated ones", typ, len(got), len(exp))
		}
	}
}
