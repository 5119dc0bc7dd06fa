// Package store is the xDS server's resource store: every current resource of the types tendril
// serves, held encoded (its bytes, which every response carries as they are, and its SHA-256
// version), the state-of-the-world version of each type, and the resources each shoot owns. A
// commit replaces the resources of the shoots that changed and went: it writes only resources
// whose version changed, and tells each subscriber which names of a type changed, so what a
// change costs a subscriber is what changed, never the number of shoots.
//
// Subscribers (xds/ads: the ADS streams and the ACK ledger) keep their own state under the
// store's lock (Lock): a commit calls them with it held, so a subscriber never sees a resource
// without being told of its change. Translation and validation happen before a commit, outside
// the lock (xds/server); the store neither translates nor serves.
package store

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"

	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/model"
)

// Types are the resource types tendril serves, in the order a client should apply them (and the
// order a stream sends them in when several changed: secrets before the listeners and clusters
// that name them, clusters before their endpoints).
var Types = []string{resourcev3.SecretType, resourcev3.ClusterType, resourcev3.EndpointType, resourcev3.ListenerType}

// typeIndex is the index of each of Types.
var typeIndex = func() map[string]int {
	m := make(map[string]int, len(Types))
	for i, t := range Types {
		m[t] = i
	}
	return m
}()

// OnDemand reports whether clients may ask for type t only once something they hold names its
// resources, as Envoy asks for secrets (SDS) when a listener or cluster refers to one: a
// client that has not subscribed it still counts as synced, but not as holding a shoot's
// resources of that type.
func OnDemand(t string) bool { return t == resourcev3.SecretType }

// Served reports whether t is one of Types.
func Served(t string) bool {
	_, ok := typeIndex[t]
	return ok
}

// Hash is a resource version: the SHA-256 of its deterministic encoding. Sent as its hex
// encoding; kept as bytes, half the size of the string and without its header.
type Hash [sha256.Size]byte

// Is reports whether v is the version sent for h.
func (h Hash) Is(v string) bool {
	var b [2 * sha256.Size]byte
	hex.Encode(b[:], h[:])
	return string(b[:]) == v
}

// Hex is the version sent for h.
func (h Hash) Hex() string { return hex.EncodeToString(h[:]) }

// Resource is a current resource: its encoding, which every response carries as is, and its
// version. The store holds no generated message: translated clusters and assignments are many
// small heap objects (about 1.8 KiB for an EDS cluster against its 150 B encoding).
type Resource struct {
	Bytes   []byte
	Version Hash
}

// deterministic marshalling makes equal messages equal bytes within one binary, which is all the
// comparison with the previous commit needs.
var deterministic = proto.MarshalOptions{Deterministic: true}

// Encode encodes a translated resource.
func Encode(m proto.Message) (Resource, error) {
	b, err := deterministic.Marshal(m)
	if err != nil {
		return Resource{}, fmt.Errorf("encode xDS resource: %w", err)
	}
	return Resource{Bytes: slices.Clip(b), Version: sha256.Sum256(b)}, nil
}

// Unique is the resource served in place of one that failed to encode: empty, with a version
// that differs from any other (the time, in nanoseconds).
func Unique(nanos int64) Resource {
	var h Hash
	copy(h[:], strconv.AppendInt(nil, nanos, 10))
	return Resource{Version: h}
}

// Names are the resource names one shoot owns, per type in the order of Types. An array rather
// than a map per shoot: at 10,000 shoots the maps' overhead alone was a few MiB.
type Names [4][]string

// Add appends name of type t (one of Types).
func (n *Names) Add(t, name string) { n[typeIndex[t]] = append(n[typeIndex[t]], name) }

// Shoot is one shoot of a commit: the model its resources were translated from and their names.
type Shoot struct {
	Model model.Shoot
	Names Names
}

// Change is what one commit changes.
type Change struct {
	// Resources are the new resources per type: every resource of the shoots in Shoots, and
	// those of no shoot (constant ones). A name a shoot owned before and that is not here again
	// is removed.
	Resources map[string]map[string]Resource
	// Shoots are the shoots that are new or changed.
	Shoots []Shoot
	// Removed names the shoots that are gone.
	Removed []string
}

// NewChange returns a Change with an empty resource map per type.
func NewChange() Change {
	c := Change{Resources: make(map[string]map[string]Resource, len(Types))}
	for _, t := range Types {
		c.Resources[t] = make(map[string]Resource)
	}
	return c
}

// Subscriber is told what a commit changes, with the store's lock held, and must not block.
type Subscriber interface {
	// Replacing: the resource name of type t, as v still shows it, is about to become version
	// cur (ok false: removed).
	Replacing(v *View, t, name string, cur Hash, ok bool)
	// Changed: the resources names of type t changed (updated or removed); v shows them as
	// they are now.
	Changed(v *View, t string, names []string)
	// Committed: the commit is complete; shoots are those whose model changed or that went.
	Committed(v *View, shoots []string)
}

// Config configures a Store. The zero value works.
type Config struct {
	// VersionPrefix distinguishes this instance's state-of-the-world versions from an earlier
	// one's (View.Version).
	VersionPrefix string
	// Registry receives the store's metrics. If nil, they are not registered.
	Registry prometheus.Registerer
}

// Store holds the current resources. Its lifecycle: New, Subscribe, then commits and reads from
// any goroutine; it starts no goroutine.
type Store struct {
	resources *prometheus.GaugeVec
	// ready is closed by the first commit.
	ready chan struct{}

	mu   sync.Mutex
	v    View
	subs []Subscriber
}

// View is the store's state, read with its lock held (Store.Lock, or in a Subscriber's calls).
// The maps it returns are the store's own: read only.
type View struct {
	prefix string
	// res is every current resource per type.
	res map[string]map[string]Resource
	// generation counts the commits that changed each type: the state-of-the-world version.
	generation map[string]uint64
	// shoots is the model of each shoot, and owned its resources' names: two maps, as a map of
	// Shoot values made diffing 10,000 shoots walk a third more memory. owner is the shoot
	// owning each resource name, per type (constant resources have none).
	shoots map[string]model.Shoot
	owned  map[string]Names
	owner  map[string]map[string]string
}

// New returns a Store holding no resources.
func New(cfg Config) *Store {
	s := &Store{
		resources: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tendril_xds_resources", Help: "Resources in the cache, by type.",
		}, []string{"type"}),
		ready: make(chan struct{}),
		v: View{
			prefix:     cfg.VersionPrefix,
			res:        make(map[string]map[string]Resource, len(Types)),
			generation: make(map[string]uint64, len(Types)),
			shoots:     make(map[string]model.Shoot),
			owned:      make(map[string]Names),
			owner:      make(map[string]map[string]string, len(Types)),
		},
	}
	for _, t := range Types {
		s.v.res[t] = make(map[string]Resource)
		s.v.owner[t] = make(map[string]string)
	}
	if cfg.Registry != nil {
		cfg.Registry.MustRegister(s.resources)
	}
	return s
}

// Subscribe adds a subscriber; call it before the first commit.
func (s *Store) Subscribe(sub Subscriber) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.subs = append(s.subs, sub)
}

// Lock locks the store and returns its view, valid until Unlock.
func (s *Store) Lock() *View {
	s.mu.Lock()
	return &s.v
}

// Unlock unlocks the store.
func (s *Store) Unlock() { s.mu.Unlock() }

// Ready is closed by the first commit.
func (s *Store) Ready() <-chan struct{} { return s.ready }

// Applied is the model of each shoot. Only the committer may read it without the lock:
// commits are its only writes, and the committer makes one at a time (xds/server holds its own
// lock around both). The map is the store's: read only.
func (s *Store) Applied() map[string]model.Shoot { return s.v.shoots }

// Commit applies c and tells the subscribers. Only one commit may run at a time, by the
// committer (Applied).
func (s *Store) Commit(c Change) model.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := &s.v
	st := model.Stats{Translated: len(c.Shoots)}
	// released are the names the changed and removed shoots owned before. A released name that
	// is in c.Resources again, possibly for another shoot, is an update rather than a removal.
	released := make(map[string]map[string]bool, len(Types))
	for _, t := range Types {
		released[t] = make(map[string]bool)
	}
	release := func(shoot string) {
		for i, names := range v.owned[shoot] {
			for _, n := range names {
				released[Types[i]][n] = true
			}
		}
	}
	// touched are the shoots changed or removed: their status is evaluated afresh.
	touched := make([]string, 0, len(c.Shoots)+len(c.Removed))
	for _, sh := range c.Shoots {
		touched = append(touched, sh.Model.Name)
		release(sh.Model.Name)
		for i, n := range sh.Names {
			sh.Names[i] = slices.Clip(n)
		}
		v.shoots[sh.Model.Name] = sh.Model
		v.owned[sh.Model.Name] = sh.Names
	}
	for _, name := range c.Removed {
		touched = append(touched, name)
		release(name)
		delete(v.shoots, name)
		delete(v.owned, name)
	}

	for _, t := range Types {
		var changed []string
		for name, r := range c.Resources[t] {
			if old, ok := v.res[t][name]; ok && old.Version == r.Version {
				continue
			}
			for _, sub := range s.subs {
				sub.Replacing(v, t, name, r.Version, true)
			}
			v.res[t][name] = r
			changed = append(changed, name)
		}
		st.Updated += len(changed)
		for name := range released[t] {
			if _, ok := c.Resources[t][name]; !ok {
				for _, sub := range s.subs {
					sub.Replacing(v, t, name, Hash{}, false)
				}
				delete(v.res[t], name)
				delete(v.owner[t], name)
				changed = append(changed, name)
				st.Removed++
			}
		}
		if len(changed) == 0 {
			continue
		}
		v.generation[t]++
		for _, sub := range s.subs {
			sub.Changed(v, t, changed)
		}
		s.resources.WithLabelValues(t).Set(float64(len(v.res[t])))
	}
	for _, name := range touched {
		for i, names := range v.owned[name] {
			for _, n := range names {
				v.owner[Types[i]][n] = name
			}
		}
	}
	select {
	case <-s.ready:
	default:
		close(s.ready)
	}
	for _, sub := range s.subs {
		sub.Committed(v, touched)
	}
	return st
}

// Resource returns the current resource name of type t.
func (v *View) Resource(t, name string) (Resource, bool) {
	r, ok := v.res[t][name]
	return r, ok
}

// Resources returns every current resource of type t.
func (v *View) Resources(t string) map[string]Resource { return v.res[t] }

// Version is the state-of-the-world version of type t, and every delta response's system
// version.
func (v *View) Version(t string) string {
	return v.prefix + strconv.FormatUint(v.generation[t], 10)
}

// Shoots returns the model of each shoot.
func (v *View) Shoots() map[string]model.Shoot { return v.shoots }

// Owned returns the names of the resources of one shoot.
func (v *View) Owned(shoot string) Names { return v.owned[shoot] }

// Owner returns the shoot owning the resource name of type t.
func (v *View) Owner(t, name string) (string, bool) {
	o, ok := v.owner[t][name]
	return o, ok
}

// Names returns the names of the resources of type t, sorted.
func (v *View) Names(t string) []string { return slices.Sorted(maps.Keys(v.res[t])) }
