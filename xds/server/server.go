// Package server is tendril's xDS control plane: it keeps the translated resources, encoded, and
// serves them over ADS, both delta and state-of-the-world. It updates a resource only when its
// content changed, so a rebuild with no change pushes nothing and one shoot's change sends only
// that shoot's resources. Each stream keeps the names that changed since its last response, so
// the cost of a change is proportional to what changed times the connected streams, never to
// the number of shoots. It tracks which resource versions each delta client has ACKed or NACKed
// and reports per shoot whether every connected client holds its current resources (ShootStatus,
// StatusChanges), which is what a Route's Programmed condition reports. It does not watch sources
// (xds/source and xds/kubesource do) or translate (xds/translate).
package server

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/translate"
)

// MaxRecvMsgSize is the largest request the server accepts. A reconnecting Envoy at 10,000
// shoots sends back every cluster name and version it holds: ~20,000 names × ~230 B ≈ 4.5 MiB,
// over grpc-go's 4 MiB default. 64 MiB leaves room for 100,000 shoots.
const MaxRecvMsgSize = 64 << 20

// Types are the resource types tendril serves, in the order a client should apply them (and the
// order a stream sends them in when several changed: clusters before their endpoints).
var Types = []string{resourcev3.ClusterType, resourcev3.EndpointType, resourcev3.ListenerType}

// Config configures a Server. The zero value works.
type Config struct {
	// Log receives the server's logs. The zero value discards them.
	Log logr.Logger
	// Registry receives the server's metrics. If nil, they are not registered.
	Registry prometheus.Registerer
	// VersionPrefix distinguishes this instance's state-of-the-world versions from an earlier
	// one's, so a client reconnecting after a restart is not told it is up to date. If empty, the
	// start time is used.
	VersionPrefix string
	// Options shape the constant resources (translate.Options).
	Options translate.Options
	// TLS, when set, serves ADS over TLS with it; tlsreload.ServerConfig makes it mutual (auth.go).
	// Nil: plaintext.
	TLS *tls.Config
	// Authorize, when set, admits each stream by the node its requests name (its first request
	// must name one); a refusal ends the stream with PermissionDenied. NodeOfCertificate binds
	// the node ID to the client certificate.
	Authorize func(ctx context.Context, node *corev3.Node) error
}

// Server holds the current resources and serves them over ADS.
type Server struct {
	log     logr.Logger
	opts    translate.Options
	prefix  string
	metrics *metrics
	// tls and authorize are Config's (auth.go).
	tls       *tls.Config
	authorize func(context.Context, *corev3.Node) error

	mu sync.Mutex
	// shoots is the model last applied per shoot, to skip translating unchanged shoots.
	shoots map[string]model.Shoot
	// claims are the server names and advertised addresses of the shoots.
	claims model.Claims
	// owned lists the resource names of each shoot per type, to find removals.
	owned map[string]ownedNames
	// res is every current resource per type: its encoding and version.
	res map[string]map[string]resource
	// generation counts the Applies that changed each type: the state-of-the-world version.
	generation  map[string]uint64
	constantSet bool
	// owner is the shoot owning each resource name, per type (constant resources have none).
	owner map[string]map[string]string
	// acks tracks what each delta client holds, for ShootStatus (ack.go).
	acks acks
	// delta and sotw are the open streams (ads.go); nextID numbers them.
	delta  map[int64]*deltaStream
	sotw   map[int64]*sotwStream
	nextID int64
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
		log:        cfg.Log,
		opts:       cfg.Options,
		prefix:     prefix,
		shoots:     make(map[string]model.Shoot),
		owned:      make(map[string]ownedNames),
		res:        make(map[string]map[string]resource, len(Types)),
		generation: make(map[string]uint64, len(Types)),
		owner:      make(map[string]map[string]string, len(Types)),
		metrics:    newMetrics(cfg.Registry),
		acks:       newAcks(),
		delta:      make(map[int64]*deltaStream),
		sotw:       make(map[int64]*sotwStream),
		applied:    make(chan struct{}),
		tls:        cfg.TLS,
		authorize:  cfg.Authorize,
	}
	for _, t := range Types {
		s.res[t] = make(map[string]resource)
		s.owner[t] = make(map[string]string)
	}
	return s
}

// Stats says what one Apply changed.
type Stats struct {
	// Translated counts the shoots whose model changed and were translated again.
	Translated int
	// Updated and Removed count resources written and deleted.
	Updated, Removed int
}

// Apply makes shoots the complete route set. Shoots whose model is unchanged are not validated
// or translated again; of the rest, only resources whose content changed are updated, and only
// the streams subscribed to them are told. The set must pass model.ValidateSet; Apply refuses it
// otherwise and keeps what it had. Its cost beyond the changed shoots is one map lookup and
// comparison per shoot: at 10,000 shoots, validating and comparing the whole set by reflection
// on every change took 45 ms.
func (s *Server) Apply(shoots []model.Shoot) (Stats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	start := time.Now()
	changed, removed, err := s.diff(shoots)
	if err != nil {
		return Stats{}, fmt.Errorf("apply routes: %w", err)
	}

	var st Stats
	// desired collects the new resources of the shoots that changed; released the names those
	// shoots (and the removed ones) owned before. A released name that is desired again, possibly
	// by another shoot, is an update rather than a removal. Resources are encoded as they are
	// collected, so that a full build never holds every shoot's translated messages at once.
	desired := make(map[string]map[string]resource, len(Types))
	released := make(map[string]map[string]bool, len(Types))
	for _, t := range Types {
		desired[t] = make(map[string]resource)
		released[t] = make(map[string]bool)
	}
	if !s.constantSet {
		s.collect(translate.Constant(s.opts), desired)
	}
	// touched are the shoots translated again or removed: their status is evaluated afresh.
	touched := make([]string, 0, len(changed)+len(removed))
	for _, sh := range changed {
		st.Translated++
		touched = append(touched, sh.Name)
		s.release(sh.Name, released)
		s.owned[sh.Name] = s.collect(translate.Shoot(sh), desired)
		s.shoots[sh.Name] = sh
	}
	for _, name := range removed {
		touched = append(touched, name)
		s.release(name, released)
		delete(s.owned, name)
		delete(s.shoots, name)
	}

	for _, t := range Types {
		var changed []string
		for name, r := range desired[t] {
			if old, ok := s.res[t][name]; ok && old.version == r.version {
				continue
			}
			s.setCurrent(t, name, r.version, true)
			s.res[t][name] = r
			changed = append(changed, name)
		}
		st.Updated += len(changed)
		for name := range released[t] {
			if _, ok := desired[t][name]; !ok {
				s.setCurrent(t, name, hash{}, false)
				delete(s.res[t], name)
				delete(s.owner[t], name)
				changed = append(changed, name)
				st.Removed++
			}
		}
		if len(changed) == 0 {
			continue
		}
		s.generation[t]++
		s.changed(t, changed)
		s.metrics.resources.WithLabelValues(t).Set(float64(len(s.res[t])))
	}
	if !s.constantSet {
		close(s.applied)
	}
	s.constantSet = true
	for _, name := range touched {
		for i, names := range s.owned[name] {
			for _, n := range names {
				s.owner[Types[i]][n] = name
			}
		}
	}
	s.evaluate(touched, true)
	s.metrics.shoots.Set(float64(len(s.shoots)))
	s.metrics.applyDuration.Observe(time.Since(start).Seconds())
	s.metrics.changes.Add(float64(st.Updated + st.Removed))
	return st, nil
}

// diff compares a route set with the one applied: the shoots that are new or changed, and the
// names of those that are gone. It validates what it returns as model.ValidateSet would the whole
// set: the unchanged shoots passed when they were applied, so only the changed ones are checked,
// and their server names and advertised addresses against the claims of the shoots that stay.
// Called with s.mu held.
func (s *Server) diff(shoots []model.Shoot) (changed []model.Shoot, removed []string, err error) {
	seen := make(map[string]struct{}, len(shoots))
	var errs []error
	for _, sh := range shoots {
		if _, dup := seen[sh.Name]; dup {
			errs = append(errs, fmt.Errorf("shoot %s listed twice", sh.Name))
			continue
		}
		seen[sh.Name] = struct{}{}
		if old, ok := s.shoots[sh.Name]; ok && old.Equal(sh) {
			continue
		}
		if err := sh.Validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		changed = append(changed, sh)
	}
	for name := range s.shoots {
		if _, ok := seen[name]; !ok {
			removed = append(removed, name)
		}
	}
	slices.Sort(removed)

	// A claim held by a shoot that changes or goes is released; the changed shoots claim anew
	// (model.Claims.Admit). Refused, the claims are put back as they were.
	leaving := make([]string, 0, len(changed)+len(removed))
	for _, sh := range changed {
		leaving = append(leaving, sh.Name)
	}
	leaving = append(leaving, removed...)
	for _, name := range leaving {
		s.claims.Release(s.shoots[name])
	}
	admitted := make([]model.Shoot, 0, len(changed))
	for _, sh := range changed {
		if err := s.claims.Admit(sh); err != nil {
			errs = append(errs, err)
			continue
		}
		admitted = append(admitted, sh)
	}
	if err := errors.Join(errs...); err != nil {
		for _, sh := range admitted {
			s.claims.Release(sh)
		}
		for _, name := range leaving {
			if old, ok := s.shoots[name]; ok {
				// Held before, by one shoot each, and released above: cannot conflict.
				_ = s.claims.Admit(old)
			}
		}
		return nil, nil, err
	}
	return changed, removed, nil
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
func (s *Server) collect(r translate.Resources, desired map[string]map[string]resource) ownedNames {
	var names ownedNames
	add := func(t string, name string, res proto.Message) {
		desired[t][name] = s.encode(name, res)
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
	return slices.Sorted(maps.Keys(s.res[t]))
}

// hash is a resource version: the SHA-256 of its deterministic encoding. Sent as its hex
// encoding; kept as bytes, half the size of the string and without its header.
type hash [sha256.Size]byte

// is reports whether v is the version sent for h.
func (h hash) is(v string) bool {
	var b [2 * sha256.Size]byte
	hex.Encode(b[:], h[:])
	return string(b[:]) == v
}

// hex is the version sent for h.
func (h hash) hex() string { return hex.EncodeToString(h[:]) }

// resource is a current resource: its encoding, which every response carries as is, and its
// version. The server holds no generated message: translated clusters and assignments are many
// small heap objects (about 1.8 KiB for an EDS cluster against its 150 B encoding).
type resource struct {
	b       []byte
	version hash
}

// deterministic marshalling makes equal messages equal bytes within one binary, which is all the
// comparison with the previous Apply needs.
var deterministic = proto.MarshalOptions{Deterministic: true}

// encode encodes a translated resource. A generated resource always marshals; should one fail,
// it is served empty with a version that differs from any other, and the failure logged.
func (s *Server) encode(name string, r proto.Message) resource {
	b, err := deterministic.Marshal(r)
	if err != nil {
		s.log.Error(err, "Encoding an xDS resource failed", "name", name)
		var h hash
		copy(h[:], strconv.AppendInt(nil, time.Now().UnixNano(), 10))
		return resource{version: h}
	}
	return resource{b: slices.Clip(b), version: sha256.Sum256(b)}
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
