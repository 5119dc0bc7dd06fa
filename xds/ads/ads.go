// Package ads serves tendril's xDS resources over ADS, both delta and state-of-the-world, and
// keeps the ACK ledger: which resource versions each delta client has ACKed or NACKed, and per
// shoot whether every connected client holds its current resources (ShootStatus,
// StatusChanges), which is what a Route's Programmed condition reports. It reads the resources
// from xds/store and is one of its subscribers: a commit tells it which names changed, so each
// stream keeps only the names that changed since its last response. It does not translate or
// hold resources (xds/store, xds/server) and decides nothing about routes (xds/model).
package ads

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tendril-net/tendril/xds/store"
)

// MaxRecvMsgSize is the largest request the server accepts. A reconnecting Envoy at 10,000
// shoots sends back every cluster name and version it holds: ~20,000 names × ~230 B ≈ 4.5 MiB,
// over grpc-go's 4 MiB default. 64 MiB leaves room for 100,000 shoots.
const MaxRecvMsgSize = 64 << 20

// Config configures a Server. The zero value works.
type Config struct {
	// Log receives the server's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the server's metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// TLS, when set, serves ADS over TLS with it; tlsreload.ServerConfig makes it mutual (auth.go).
	// Nil: plaintext.
	TLS *tls.Config
	// Authorize, when set, admits each stream by the node its requests name (its first request
	// must name one); a refusal ends the stream with PermissionDenied. NodeOfCertificate binds
	// the node ID to the client certificate.
	Authorize func(ctx context.Context, node *corev3.Node) error
}

// Server serves the resources of one store over ADS and keeps the ACK ledger. Its lifecycle:
// New (which subscribes it to the store), then Serve until its context ends; the status methods
// work from New on.
type Server struct {
	log     logr.Logger
	metrics *metrics
	// tls and authorize are Config's (auth.go).
	tls       *tls.Config
	authorize func(context.Context, *corev3.Node) error

	st *store.Store
	// v is st's view. It, and every field below, is read and written with st locked: a commit
	// calls the Server (store.Subscriber) with the lock held.
	v *store.View
	// acks tracks what each delta client holds, for ShootStatus (ack.go).
	acks acks
	// delta and sotw are the open streams; nextID numbers them.
	delta  map[int64]*deltaStream
	sotw   map[int64]*sotwStream
	nextID int64
}

// New returns a Server of st's resources, subscribed to st.
func New(st *store.Store, cfg Config) *Server {
	v := st.Lock()
	st.Unlock()
	s := &Server{
		log:       cfg.Log,
		metrics:   newMetrics(cfg.Registry),
		tls:       cfg.TLS,
		authorize: cfg.Authorize,
		st:        st,
		v:         v,
		acks:      newAcks(),
		delta:     make(map[int64]*deltaStream),
		sotw:      make(map[int64]*sotwStream),
	}
	st.Subscribe((*subscriber)(s))
	return s
}

// subscriber is a Server as the store's subscriber, so that the Subscriber methods are not
// the Server's API.
type subscriber Server

func (s *subscriber) Replacing(v *store.View, t, name string, cur store.Hash, ok bool) {
	(*Server)(s).replacing(v, t, name, cur, ok)
}

func (s *subscriber) Changed(v *store.View, t string, names []string) {
	(*Server)(s).changed(v, t, names)
}

func (s *subscriber) Committed(v *store.View, shoots []string) { (*Server)(s).committed(v, shoots) }

// The ADS service. Each stream keeps, per type, what it subscribed and the names that changed
// since its last response (dirty). A commit (store.Subscriber) adds the names it changed to the dirty sets of the
// streams subscribed to them and wakes them; a stream sends one response per type and waits for
// its answer (ACK or NACK) before it sends the next, so changes that arrive meanwhile go out
// together. Nothing walks every resource except a client's first subscription: go-control-plane's
// LinearCache walked every resource of a type per watch on every update and every ACK, which at
// 10,000 shoots was most of the control plane's CPU, and its delta server kept a full version map
// per stream.
//
// Responses carry the stored encodings as they are (an Any's value), so sending copies nothing
// but into gRPC's buffers. A commit never blocks on a stream: a client that reads slowly delays only
// its own responses, and holds at most one unanswered response per type.

// maxResponseBytes bounds the resources one delta response carries. A client's first sync at
// 10,000 shoots is ~18 MiB; sent as one response to each replica at once, that response, its
// Any wrappers and gRPC's encoding of it were most of the control plane's peak memory. In 1 MiB
// pieces a stream holds at most one piece at a time (the next goes once the client answered),
// at the cost of a round trip per piece.
const maxResponseBytes = 1 << 20

// wildcard is the explicit wildcard subscription name (xDS "*").
const wildcard = "*"

// subscription is what a stream asked for of one type.
type subscription struct {
	wildcard bool
	names    map[string]bool
	// inflight is the nonce of the response not yet answered ("" for none).
	inflight string
}

func (sub *subscription) wants(name string) bool { return sub.wildcard || sub.names[name] }

// stream is one ADS stream with its subscriptions of type S (deltaSub or sotwSub). Its fields
// are guarded by the store's lock, except wake.
type stream[S any] struct {
	id   int64
	wake chan struct{} // capacity one: a pending wake-up
	subs map[string]*S
	// nonce numbers the responses; decimal, so that nonceBefore orders them.
	nonce uint64
}

type (
	deltaStream = stream[deltaSub]
	sotwStream  = stream[sotwSub]
)

// openStream registers a new stream in streams (s.delta or s.sotw).
func openStream[S any](s *Server, streams map[int64]*stream[S]) *stream[S] {
	s.st.Lock()
	defer s.st.Unlock()
	s.nextID++
	c := &stream[S]{id: s.nextID, wake: make(chan struct{}, 1), subs: make(map[string]*S)}
	streams[c.id] = c
	return c
}

type deltaSub struct {
	subscription
	// dirty are the names to send, or to send as removed, in the next response.
	dirty map[string]bool
	// answer: the client subscribed and waits for a first response even if it holds everything
	// (Envoy's initialisation waits for one of every type).
	answer bool
	// synced: the first sync has been sent entirely (its last piece may await its answer).
	synced bool
	// groups are the names of refused responses, halved: each is sent as a response of its
	// own before anything else, until a refusal names one resource (isolate).
	groups [][]string
}

// nextGroup is the next group of isolate's still to send (its names still dirty), nil if none.
func (sub *deltaSub) nextGroup() []string {
	for len(sub.groups) > 0 {
		g := sub.groups[0]
		sub.groups = sub.groups[1:]
		var names []string
		for _, n := range g {
			if sub.dirty[n] {
				names = append(names, n)
			}
		}
		if names != nil {
			return names
		}
	}
	return nil
}

// isolate takes a refused response of several resources apart. tendril-ingress refuses a
// response whole and a NACK names no resource, so one resource a client cannot take (a kind an
// older ingress does not know, during a rollout) would take every shoot in the same response down
// with it: the names are sent again in two halves, each halved again if refused, so that only the
// resources the client refuses on their own stay refused: 2·log2(n) more responses per resource
// it refuses.
func (sub *deltaSub) isolate(names []string) {
	slices.Sort(names)
	h := len(names) / 2
	sub.groups = append([][]string{names[:h], names[h:]}, sub.groups...)
	for _, n := range names {
		if sub.wants(n) {
			sub.dirty[n] = true
		}
	}
}

type sotwSub struct {
	subscription
	// dirty: the client's state differs from the current generation, or its names changed.
	dirty bool
}

func wakeUp(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// changed tells the streams subscribed to names of type t that these changed. The store calls
// it with its lock held (store.Subscriber).
func (s *Server) changed(_ *store.View, t string, names []string) {
	for _, c := range s.delta {
		sub := c.subs[t]
		if sub == nil {
			continue
		}
		n := len(sub.dirty)
		for _, name := range names {
			if sub.wants(name) {
				sub.dirty[name] = true
			}
		}
		if len(sub.dirty) > n && sub.inflight == "" {
			wakeUp(c.wake)
		}
	}
	// State of the world is not full-state for endpoints: a response without an assignment does
	// not remove it, so a removed one is not worth a response of all the others.
	sotwWants := func(sub *sotwSub) func(string) bool {
		return func(name string) bool {
			_, present := s.v.Resources(t)[name]
			return sub.wants(name) && (present || t != resourcev3.EndpointType)
		}
	}
	for _, c := range s.sotw {
		sub := c.subs[t]
		if sub == nil || !slices.ContainsFunc(names, sotwWants(sub)) {
			continue
		}
		sub.dirty = true
		if sub.inflight == "" {
			wakeUp(c.wake)
		}
	}
}

// Serve serves ADS on l until ctx ends, then stops the gRPC server (Stop, not GracefulStop:
// xDS streams never end by themselves, and clients reconnect to a replica). Streams opened before
// the store's first commit wait for it: a data plane reconnecting to a restarted control plane names what
// it holds, and answering it from empty state would withdraw every shoot.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	g := grpc.NewServer(append(s.serverOptions(),
		grpc.MaxRecvMsgSize(MaxRecvMsgSize),
		// grpc-go limits concurrent streams per connection to 100 by default; every ingress holds
		// one ADS stream per connection, but Envoy with separate xDS streams may open several.
		grpc.MaxConcurrentStreams(1<<20),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 5 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 15 * time.Second, PermitWithoutStream: true}),
		// Stop returns once every stream handler has, so that Serve can wait for their readers.
		grpc.WaitForHandlers(true),
	)...)
	a := &ads{s: s}
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, a)

	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		g.Stop()
	}()
	err := g.Serve(l)
	if err != nil {
		// Serve failed on its own: stop what it started so that the handlers end.
		g.Stop()
	}
	wg.Wait()
	a.readers.Wait()
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) && ctx.Err() == nil {
		return fmt.Errorf("serve xDS on %s: %w", l.Addr(), err)
	}
	return nil
}

// ads implements the ADS gRPC service on a Server.
type ads struct {
	discoveryv3.UnimplementedAggregatedDiscoveryServiceServer
	s *Server
	// readers are the streams' request readers. A reader ends when its stream's context does,
	// which is only after the handler returned, so the handler cannot wait for it; Serve does.
	readers sync.WaitGroup
}

// waitApplied holds a new stream until the store's first commit.
func (s *Server) waitApplied(ctx context.Context) error {
	select {
	case <-s.st.Ready():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// serveStream runs one stream: a reader goroutine hands every request to handle (which updates
// the stream's state with the store locked and wakes it), and this goroutine sends what next builds whenever
// the stream is woken.
func serveStream[Req, Resp any](ctx context.Context, a *ads, wake <-chan struct{}, recv func() (Req, error), handle func(Req) error, next func() []Resp, send func(Resp) error) error {
	if err := a.s.waitApplied(ctx); err != nil {
		return err
	}
	done := make(chan error, 1)
	a.readers.Add(1)
	go func() {
		defer a.readers.Done()
		for {
			req, err := recv()
			if err == nil {
				err = handle(req)
			}
			if err != nil {
				done <- err
				return
			}
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-done:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-wake:
		}
		for _, resp := range next() {
			if err := send(resp); err != nil {
				return err
			}
		}
	}
}

// DeltaAggregatedResources serves one incremental ADS stream.
func (a *ads) DeltaAggregatedResources(st discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	s := a.s
	c := openStream(s, s.delta)
	defer s.closeDelta(c)
	auth := s.newAuthorizer(st.Context())
	return serveStream(st.Context(), a, c.wake, st.Recv,
		func(req *discoveryv3.DeltaDiscoveryRequest) error {
			if err := auth.check(req.GetNode()); err != nil {
				return err
			}
			return s.deltaRequested(c, req)
		},
		func() []*discoveryv3.DeltaDiscoveryResponse { return s.nextDelta(c) },
		st.Send)
}

// received counts a request of either protocol and reports whether its type is one tendril
// serves. Another type is ignored, logged and counted: ending the stream instead would take the
// client's listeners and clusters down with it on every reconnect, and a client whose
// configuration asks for a type it cannot get still runs on the others (Envoy gives up waiting
// for it after its initial fetch timeout).
func (s *Server) received(t, nonce string, detail *rpcstatus.Status, node string) bool {
	if !store.Served(t) {
		s.metrics.unsupported.Inc()
		s.log.Info("xDS client asked for a resource type tendril does not serve; ignored", "node", node, "type", t, "served", store.Types)
		return false
	}
	s.observeRequest(t, nonce, detail.GetMessage(), detail != nil, node)
	return true
}

// errStreamClosed ends a stream's reader that delivered a request after the stream closed.
var errStreamClosed = errors.New("xds stream closed")

// closeDelta forgets a delta stream and its ACK state.
func (s *Server) closeDelta(c *deltaStream) {
	s.st.Lock()
	defer s.st.Unlock()
	delete(s.delta, c.id)
	s.deltaClosed(c.id)
}

// deltaRequested applies one request to the stream: its answer to a response, and changes to
// its subscription.
func (s *Server) deltaRequested(c *deltaStream, req *discoveryv3.DeltaDiscoveryRequest) error {
	t := req.GetTypeUrl()
	if !s.received(t, req.GetResponseNonce(), req.GetErrorDetail(), req.GetNode().GetId()) {
		return nil
	}
	s.st.Lock()
	defer s.st.Unlock()
	if s.delta[c.id] != c {
		// The stream's handler has returned; its reader delivered one last request. Its ACK
		// state is gone and must not come back as a client that never leaves.
		return errStreamClosed
	}
	s.deltaRequest(c.id, req)
	sub := c.subs[t]
	held := map[string]string(nil)
	if sub == nil {
		// The first request of a type subscribes. No names is the legacy wildcard. A client
		// reconnecting names what it holds: only what differs is sent.
		sub = &deltaSub{subscription: subscription{names: make(map[string]bool)}, dirty: make(map[string]bool), answer: true}
		sub.wildcard = len(req.GetResourceNamesSubscribe()) == 0
		c.subs[t] = sub
		held = req.GetInitialResourceVersions()
		if sub.wildcard {
			for name, r := range s.v.Resources(t) {
				if !r.Version.Is(held[name]) {
					sub.dirty[name] = true
				}
			}
		}
		for name := range held {
			if _, ok := s.v.Resources(t)[name]; !ok {
				sub.dirty[name] = true // held but gone: removed
			}
		}
	} else if req.GetResponseNonce() == sub.inflight {
		sub.inflight = ""
	}
	for _, name := range req.GetResourceNamesSubscribe() {
		if name == wildcard {
			if !sub.wildcard {
				sub.wildcard = true
				for n := range s.v.Resources(t) {
					sub.dirty[n] = true
				}
			}
			continue
		}
		if sub.names[name] {
			continue
		}
		sub.names[name] = true
		// A new subscription asks for the current version, unless the client named it as held
		// when it subscribed; an unknown name is answered as removed, so the client stops waiting.
		if v, ok := held[name]; !ok || !s.v.Resources(t)[name].Version.Is(v) {
			sub.dirty[name] = true
		}
	}
	for _, name := range req.GetResourceNamesUnsubscribe() {
		if name == wildcard {
			sub.wildcard = false
		} else {
			delete(sub.names, name)
		}
	}
	if len(req.GetResourceNamesUnsubscribe()) > 0 {
		maps.DeleteFunc(sub.dirty, func(n string, _ bool) bool { return !sub.wants(n) })
	}
	if sub.inflight == "" && (len(sub.dirty) > 0 || sub.answer) {
		wakeUp(c.wake)
	}
	return nil
}

// nextDelta builds the responses of every type that has changes to send and no unanswered
// response, and records them for the ACK tracking.
func (s *Server) nextDelta(c *deltaStream) []*discoveryv3.DeltaDiscoveryResponse {
	s.st.Lock()
	defer s.st.Unlock()
	var out []*discoveryv3.DeltaDiscoveryResponse
	// held: an earlier type's first sync has pieces left to send. A later type waits for it, so
	// that a client gets its listeners only once it holds every cluster and assignment (store.Types is
	// in that order): tendril-ingress reports ready, and Envoy activates listeners, once listeners
	// arrive, and must not then refuse shoots whose clusters are still on their way.
	held := false
	for _, t := range store.Types {
		sub := c.subs[t]
		if sub == nil || held {
			continue
		}
		if sub.inflight != "" {
			held = !sub.synced
			continue
		}
		if len(sub.dirty) == 0 && !sub.answer {
			sub.synced = true // nothing left to send (the rest may have been unsubscribed)
			continue
		}
		sub.answer = false
		c.nonce++
		resp := &discoveryv3.DeltaDiscoveryResponse{
			TypeUrl:           t,
			SystemVersionInfo: s.v.Version(t),
			Nonce:             strconv.FormatUint(c.nonce, 10),
		}
		// At most maxResponseBytes of resources; the rest stays dirty for the next response.
		// Sorted, so that a response is the same for the same changes.
		names := sub.nextGroup()
		if names == nil {
			size := 0
			for name := range sub.dirty {
				if size >= maxResponseBytes {
					break
				}
				names = append(names, name)
				size += len(name) + len(s.v.Resources(t)[name].Bytes)
			}
		}
		slices.Sort(names)
		for _, name := range names {
			delete(sub.dirty, name)
			if r, ok := s.v.Resources(t)[name]; ok {
				resp.Resources = append(resp.Resources, &discoveryv3.Resource{
					Name:     name,
					Version:  r.Version.Hex(),
					Resource: &anypb.Any{TypeUrl: t, Value: r.Bytes},
				})
			} else {
				resp.RemovedResources = append(resp.RemovedResources, name)
			}
		}
		sub.inflight = resp.Nonce
		if !sub.synced && len(sub.dirty) == 0 {
			sub.synced = true
			// A map keeps its size when emptied, and the first sync had every name in it.
			sub.dirty = make(map[string]bool)
		}
		held = !sub.synced
		s.deltaResponse(c.id, resp)
		s.metrics.responses.WithLabelValues("delta", t).Inc()
		s.metrics.sent.WithLabelValues("delta", t).Add(float64(len(resp.Resources)))
		out = append(out, resp)
	}
	return out
}

// StreamAggregatedResources serves one state-of-the-world ADS stream. It exists for clients that
// only speak it: every change of a type re-sends all of that type's subscribed resources.
func (a *ads) StreamAggregatedResources(st discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	s := a.s
	c := openStream(s, s.sotw)
	defer func() {
		s.st.Lock()
		defer s.st.Unlock()
		delete(s.sotw, c.id)
	}()
	auth := s.newAuthorizer(st.Context())
	return serveStream(st.Context(), a, c.wake, st.Recv,
		func(req *discoveryv3.DiscoveryRequest) error {
			if err := auth.check(req.GetNode()); err != nil {
				return err
			}
			return s.sotwRequested(c, req)
		},
		func() []*discoveryv3.DiscoveryResponse { return s.nextSotw(c) },
		st.Send)
}

func (s *Server) sotwRequested(c *sotwStream, req *discoveryv3.DiscoveryRequest) error {
	t := req.GetTypeUrl()
	if !s.received(t, req.GetResponseNonce(), req.GetErrorDetail(), req.GetNode().GetId()) {
		return nil
	}
	s.st.Lock()
	defer s.st.Unlock()
	names := make(map[string]bool, len(req.GetResourceNames()))
	for _, n := range req.GetResourceNames() {
		names[n] = true
	}
	// No names is the legacy wildcard.
	all := len(names) == 0 || names[wildcard]
	delete(names, wildcard)
	sub := c.subs[t]
	switch {
	case sub == nil:
		// A client reconnecting to this instance may already be current.
		sub = &sotwSub{dirty: req.GetVersionInfo() != s.v.Version(t)}
		c.subs[t] = sub
	case req.GetResponseNonce() != "" && req.GetResponseNonce() != sub.inflight:
		// An answer to an older response: its subscription is stale too.
		return nil
	default:
		sub.inflight = ""
		if all != sub.wildcard || !maps.Equal(names, sub.names) {
			sub.dirty = true
		}
	}
	sub.wildcard, sub.names = all, names
	if sub.dirty && sub.inflight == "" {
		wakeUp(c.wake)
	}
	return nil
}

func (s *Server) nextSotw(c *sotwStream) []*discoveryv3.DiscoveryResponse {
	s.st.Lock()
	defer s.st.Unlock()
	var out []*discoveryv3.DiscoveryResponse
	for _, t := range store.Types {
		sub := c.subs[t]
		if sub == nil || sub.inflight != "" || !sub.dirty {
			continue
		}
		c.nonce++
		resp := &discoveryv3.DiscoveryResponse{TypeUrl: t, VersionInfo: s.v.Version(t), Nonce: strconv.FormatUint(c.nonce, 10)}
		names := maps.Keys(sub.names)
		if sub.wildcard {
			names = maps.Keys(s.v.Resources(t))
		}
		for _, name := range slices.Sorted(names) {
			if r, ok := s.v.Resources(t)[name]; ok {
				resp.Resources = append(resp.Resources, &anypb.Any{TypeUrl: t, Value: r.Bytes})
			}
		}
		sub.dirty = false
		sub.inflight = resp.Nonce
		s.metrics.responses.WithLabelValues("sotw", t).Inc()
		s.metrics.sent.WithLabelValues("sotw", t).Add(float64(len(resp.Resources)))
		out = append(out, resp)
	}
	return out
}
