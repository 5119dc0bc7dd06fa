// Package server is tendril's xDS control plane: it keeps the translated resources in one
// go-control-plane LinearCache per type behind a MuxCache and serves them over ADS, both
// state-of-the-world and delta. It updates the caches per resource and only for resources whose
// content changed, so a rebuild with no change pushes nothing and one shoot's change sends only
// that shoot's resources. It tracks which resource versions each delta client has ACKed or NACKed
// and reports per shoot whether every connected client holds its current resources (ShootStatus,
// StatusChanges), which is what a Route's Programmed condition reports. It does not watch sources
// (xds/source and xds/kubesource do) or translate (xds/translate).
package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"reflect"
	"slices"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoiface"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// MaxRecvMsgSize is the largest request the server accepts. A reconnecting Envoy at 10,000
// shoots sends back every cluster name and version it holds: ~20,000 names × ~230 B ≈ 4.5 MiB,
// over grpc-go's 4 MiB default. 64 MiB leaves room for 100,000 shoots.
const MaxRecvMsgSize = 64 << 20

// Types are the resource types tendril serves, in the order a client should apply them.
var Types = []string{resourcev3.ClusterType, resourcev3.EndpointType, resourcev3.ListenerType}

// Config configures a Server. The zero value works.
type Config struct {
	// Log receives the server's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the server's metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// VersionPrefix distinguishes this cache instance's state-of-the-world versions from an earlier
	// one's, so a client reconnecting after a restart is not told it is up to date. If empty, the
	// start time is used.
	VersionPrefix string
	// Options shape the constant resources (translate.Options).
	Options translate.Options
}

// Server holds the current resources and serves them over ADS.
type Server struct {
	log     logr.Logger
	opts    translate.Options
	caches  map[string]*cachev3.LinearCache
	mux     *cachev3.MuxCache
	metrics *metrics

	mu sync.Mutex
	// shoots is the model last applied per shoot, to skip translating unchanged shoots.
	shoots map[string]model.Shoot
	// owned lists the resource names of each shoot per type, to find removals.
	owned map[string]ownedNames
	// versions is the version of every resource in the caches, per type: the hash of its
	// content, computed as go-control-plane computes the delta versions it sends (which are its
	// hex encoding), so that what a client ACKs compares with what is current.
	versions    map[string]map[string]hash
	constantSet bool
	// owner is the shoot owning each resource name, per type (constant resources have none).
	owner map[string]map[string]string
	// acks tracks what each delta client holds, for ShootStatus (ack.go).
	acks acks
	// applied is closed by the first Apply; streams wait for it.
	applied chan struct{}
}

// New returns a Server holding no resources.
func New(cfg Config) *Server {
	prefix := cfg.VersionPrefix
	if prefix == "" {
		prefix = fmt.Sprintf("%x-", time.Now().UnixNano())
	}
	s := &Server{
		log:      cfg.Log,
		opts:     cfg.Options,
		caches:   make(map[string]*cachev3.LinearCache, len(Types)),
		shoots:   make(map[string]model.Shoot),
		owned:    make(map[string]ownedNames),
		versions: make(map[string]map[string]hash, len(Types)),
		owner:    make(map[string]map[string]string, len(Types)),
		metrics:  newMetrics(cfg.Registry),
		acks:     newAcks(),
		applied:  make(chan struct{}),
	}
	for _, t := range Types {
		s.caches[t] = cachev3.NewLinearCache(t, cachev3.WithVersionPrefix(prefix), cachev3.WithLogger(logAdapter(cfg.Log.WithName("cache"))))
		s.versions[t] = make(map[string]hash)
		s.owner[t] = make(map[string]string)
	}
	caches := make(map[string]cachev3.Cache, len(s.caches))
	for t, c := range s.caches {
		caches[t] = c
	}
	s.mux = &cachev3.MuxCache{
		Classify:      func(r *cachev3.Request) string { return r.GetTypeUrl() },
		ClassifyDelta: func(r *cachev3.DeltaRequest) string { return r.GetTypeUrl() },
		Caches:        caches,
	}
	return s
}

// Cache is the server's resource cache, for tests and embedding in another gRPC server. Its
// responses are what the translated resources encode to; the resources it holds are only that
// encoding (see encode), not the translated messages.
func (s *Server) Cache() cachev3.Cache { return s.mux }

// Stats says what one Apply changed.
type Stats struct {
	// Translated counts the shoots whose model changed and were translated again.
	Translated int
	// Updated and Removed count resources written to and deleted from the caches.
	Updated, Removed int
}

// Apply makes shoots the complete route set. Shoots whose model is unchanged are not translated
// again; of the rest, only resources whose content changed are written to the caches. The set must
// pass model.ValidateSet; Apply refuses it otherwise and keeps what it had.
func (s *Server) Apply(shoots []model.Shoot) (Stats, error) {
	if err := model.ValidateSet(shoots); err != nil {
		return Stats{}, fmt.Errorf("apply routes: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	start := time.Now()

	var st Stats
	next := make(map[string]model.Shoot, len(shoots))
	// desired collects the new resources of the shoots that changed; released the names those
	// shoots (and the removed ones) owned before. A released name that is desired again, possibly
	// by another shoot, is an update rather than a removal. Resources are encoded as they are
	// collected, so that a full build never holds every shoot's translated messages at once.
	desired := make(map[string]map[string]encoded, len(Types))
	released := make(map[string]map[string]bool, len(Types))
	for _, t := range Types {
		desired[t] = make(map[string]encoded)
		released[t] = make(map[string]bool)
	}
	if !s.constantSet {
		s.collect(translate.Constant(s.opts), desired)
	}
	var touched []string // shoots translated again or removed: their status is evaluated afresh
	for _, sh := range shoots {
		next[sh.Name] = sh
		if old, ok := s.shoots[sh.Name]; ok && equalShoot(old, sh) {
			continue
		}
		st.Translated++
		touched = append(touched, sh.Name)
		s.release(sh.Name, released)
		s.owned[sh.Name] = s.collect(translate.Shoot(sh), desired)
	}
	for name := range s.shoots {
		if _, ok := next[name]; !ok {
			touched = append(touched, name)
			s.release(name, released)
			delete(s.owned, name)
		}
	}

	for _, t := range Types {
		update := make(map[string]types.Resource)
		for name, r := range desired[t] {
			if old, ok := s.versions[t][name]; ok && old == r.version {
				continue
			}
			s.setCurrent(t, name, r.version, true)
			update[name] = r.resource
		}
		var remove []string
		for name := range released[t] {
			if _, ok := desired[t][name]; !ok {
				remove = append(remove, name)
				s.setCurrent(t, name, hash{}, false)
				delete(s.owner[t], name)
			}
		}
		if len(update) == 0 && len(remove) == 0 {
			continue
		}
		slices.Sort(remove)
		if err := s.caches[t].UpdateResources(update, remove); err != nil {
			// The cache has taken the resources; only notifying a watch failed, which the
			// library retries on the watch's next request.
			s.log.Error(err, "Notifying xDS watches failed", "type", t)
		}
		st.Updated += len(update)
		st.Removed += len(remove)
		s.metrics.resources.WithLabelValues(t).Set(float64(len(s.versions[t])))
	}
	if !s.constantSet {
		close(s.applied)
	}
	s.constantSet = true
	s.shoots = next
	for _, name := range touched {
		for i, names := range s.owned[name] {
			for _, n := range names {
				s.owner[Types[i]][n] = name
			}
		}
	}
	s.evaluate(touched, true)
	s.metrics.shoots.Set(float64(len(next)))
	s.metrics.applyDuration.Observe(time.Since(start).Seconds())
	s.metrics.changes.Add(float64(st.Updated + st.Removed))
	return st, nil
}

// ownedNames are the resource names one shoot owns, per type in the order of Types. An array
// rather than a map per shoot: at 10,000 shoots the maps' overhead alone was a few MiB.
type ownedNames [3][]string

// typeIndex is the index of each of Types.
var typeIndex = func() map[string]int {
	m := make(map[string]int, len(Types))
	for i, t := range Types {
		m[t] = i
	}
	return m
}()

// collect adds r's resources to desired and returns their names per type.
func (s *Server) collect(r translate.Resources, desired map[string]map[string]encoded) ownedNames {
	var names ownedNames
	add := func(t string, name string, res types.Resource) {
		desired[t][name] = encode(res)
		names[typeIndex[t]] = append(names[typeIndex[t]], name)
	}
	for _, c := range r.Clusters {
		add(resourcev3.ClusterType, c.GetName(), c)
	}
	for _, e := range r.Endpoints {
		add(resourcev3.EndpointType, e.GetClusterName(), e)
	}
	for _, l := range r.Listeners {
		add(resourcev3.ListenerType, l.GetName(), l)
	}
	for i, n := range names {
		names[i] = slices.Clip(n)
	}
	return names
}

func (s *Server) release(shoot string, released map[string]map[string]bool) {
	for i, names := range s.owned[shoot] {
		for _, n := range names {
			released[Types[i]][n] = true
		}
	}
}

// Resources returns the names of the resources of type t currently served, sorted.
func (s *Server) Resources(t string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.versions[t]))
}

func equalShoot(a, b model.Shoot) bool { return reflect.DeepEqual(a, b) }

// hash is a resource version: the SHA-256 of its deterministic encoding, of which
// go-control-plane's delta versions (cachev3.HashResource) are the hex encoding. Kept as bytes, half
// the size of the string and without its header.
type hash [sha256.Size]byte

// is reports whether v is the version go-control-plane sends for h.
func (h hash) is(v string) bool {
	var b [2 * sha256.Size]byte
	hex.Encode(b[:], h[:])
	return string(b[:]) == v
}

// hex is the version go-control-plane sends for h.
func (h hash) hex() string { return hex.EncodeToString(h[:]) }

// encoded is a resource in the form the caches hold, with its version.
type encoded struct {
	resource types.Resource
	version  hash
}

// encode encodes a resource as go-control-plane would (deterministic marshalling makes equal
// messages equal bytes within one binary, which is all the comparison with the previous Apply
// needs) and returns it in the form the caches hold, with its version.
//
// The caches hold no generated message: a LinearCache keeps the message it is given for as long
// as it serves it and, once it has sent it, also its encoding. Translated clusters and
// assignments are many small heap objects (about 1.8 KiB for an EDS cluster against its 150 B
// encoding), which made them most of the control plane's memory at 10,000 shoots. What the
// caches get instead is the encoding itself (raw), whose marshalling returns it without a copy;
// go-control-plane builds every response, delta and state of the world, from the encoding and the
// request's type URL, never from the message.
func encode(r types.Resource) encoded {
	b, err := cachev3.MarshalResource(r)
	if err != nil {
		// A generated resource always marshals; make a failure count as a change, and let the
		// cache report it when it marshals the message itself.
		return encoded{resource: r}
	}
	return encoded{resource: &raw{b: slices.Clip(b)}, version: sha256.Sum256(b)}
}

// raw is an encoded resource. As a message it has the descriptor of google.protobuf.Empty, no
// fields, and a fast-path marshal that returns the encoding (to be appended to a buffer, it is
// copied). It supports nothing else: it exists to be marshalled by the caches. The encoding is
// never modified, and clipped so that appending to it copies.
type raw struct{ b []byte }

func (r *raw) ProtoReflect() protoreflect.Message { return rawMessage{Message: emptyMessage, r: r} }

// emptyMessage is the reflection of a nil google.protobuf.Empty: read-only, no fields.
var emptyMessage = (*emptypb.Empty)(nil).ProtoReflect()

type rawMessage struct {
	protoreflect.Message
	r *raw
}

func (m rawMessage) Interface() protoreflect.ProtoMessage { return m.r }
func (m rawMessage) ProtoMethods() *protoiface.Methods    { return rawMethods }

// rawMethods has no Size: proto.Marshal would allocate a buffer of that size for nothing (the
// size then comes from Marshal).
var rawMethods = &protoiface.Methods{
	Flags: protoiface.SupportMarshalDeterministic,
	Marshal: func(in protoiface.MarshalInput) (protoiface.MarshalOutput, error) {
		b := in.Message.(rawMessage).r.b
		if len(in.Buf) == 0 {
			return protoiface.MarshalOutput{Buf: b}, nil
		}
		return protoiface.MarshalOutput{Buf: append(in.Buf, b...)}, nil
	},
	CheckInitialized: func(protoiface.CheckInitializedInput) (protoiface.CheckInitializedOutput, error) {
		return protoiface.CheckInitializedOutput{}, nil
	},
}

// Serve serves ADS on l until ctx ends, then stops the gRPC server (Stop, not GracefulStop:
// xDS streams never end by themselves, and clients reconnect to a replica). Streams opened before
// the first Apply wait for it: a data plane reconnecting to a restarted control plane names what
// it holds, and answering it from empty caches would withdraw every shoot.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	g := grpc.NewServer(
		grpc.MaxRecvMsgSize(MaxRecvMsgSize),
		// grpc-go limits concurrent streams per connection to 100 by default; every ingress holds
		// one ADS stream per connection, but Envoy with separate xDS streams may open several.
		grpc.MaxConcurrentStreams(1<<20),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 5 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 15 * time.Second, PermitWithoutStream: true}),
	)
	xs := serverv3.NewServer(ctx, s.mux, s.callbacks())
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, xs)

	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		g.Stop()
	}()
	err := g.Serve(l)
	wg.Wait()
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) && ctx.Err() == nil {
		return fmt.Errorf("serve xDS on %s: %w", l.Addr(), err)
	}
	return nil
}

// waitApplied holds a new stream until the first Apply.
func (s *Server) waitApplied(ctx context.Context, _ int64, _ string) error {
	select {
	case <-s.applied:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *Server) callbacks() serverv3.CallbackFuncs {
	return serverv3.CallbackFuncs{
		StreamOpenFunc:      s.waitApplied,
		DeltaStreamOpenFunc: s.waitApplied,
		StreamDeltaRequestFunc: func(id int64, req *discoveryv3.DeltaDiscoveryRequest) error {
			s.observeRequest(req.GetTypeUrl(), req.GetResponseNonce(), req.GetErrorDetail().GetMessage(), req.GetErrorDetail() != nil, req.GetNode().GetId())
			s.deltaRequest(id, req)
			return nil
		},
		StreamDeltaResponseFunc: func(id int64, req *discoveryv3.DeltaDiscoveryRequest, resp *discoveryv3.DeltaDiscoveryResponse) {
			s.metrics.responses.WithLabelValues("delta", resp.GetTypeUrl()).Inc()
			s.metrics.sent.WithLabelValues("delta", resp.GetTypeUrl()).Add(float64(len(resp.GetResources())))
			s.deltaResponse(id, resp)
		},
		DeltaStreamClosedFunc: func(id int64, _ *corev3.Node) { s.deltaClosed(id) },
		StreamRequestFunc: func(id int64, req *discoveryv3.DiscoveryRequest) error {
			s.observeRequest(req.GetTypeUrl(), req.GetResponseNonce(), req.GetErrorDetail().GetMessage(), req.GetErrorDetail() != nil, req.GetNode().GetId())
			return nil
		},
		StreamResponseFunc: func(_ context.Context, id int64, req *discoveryv3.DiscoveryRequest, resp *discoveryv3.DiscoveryResponse) {
			s.metrics.responses.WithLabelValues("sotw", resp.GetTypeUrl()).Inc()
			s.metrics.sent.WithLabelValues("sotw", resp.GetTypeUrl()).Add(float64(len(resp.GetResources())))
		},
	}
}

// observeRequest counts ACKs and NACKs. A NACK is logged: it means a data plane rejected what
// tendril generated and keeps serving its previous configuration.
func (s *Server) observeRequest(typeURL, nonce, detail string, nack bool, node string) {
	switch {
	case nonce == "":
		return // a subscription, not an answer
	case nack:
		s.metrics.acks.WithLabelValues(typeURL, "nack").Inc()
		s.log.Info("xDS client rejected a configuration", "node", node, "type", typeURL, "nonce", nonce, "detail", detail)
	default:
		s.metrics.acks.WithLabelValues(typeURL, "ack").Inc()
	}
}
