// Package server is tendril's xDS control plane, assembled: Apply validates a route set, admits
// the server names and advertised addresses of the shoots that changed (model.Claims), translates
// and encodes their resources (xds/translate) and commits them to the resource store
// (xds/store); Serve serves the store over ADS and reports per shoot what the data planes
// acknowledged (xds/ads). It updates a resource only when its content changed, so a rebuild with
// no change pushes nothing and one shoot's change sends only that shoot's resources.
// Translation runs outside the store's lock, which the streams' ACK handling takes: only the
// commit of its result holds it. It does not watch sources (xds/source and xds/kubesource do).
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/tendril-net/tendril/xds/ads"
	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/store"
	"github.com/tendril-net/tendril/xds/translate"
)

// NodeOfCertificate admits a node whose ID is the common name of the client's certificate, or
// starts with it and a dash; it is a Config.Authorize (ads.NodeOfCertificate).
func NodeOfCertificate(ctx context.Context, node *corev3.Node) error {
	return ads.NodeOfCertificate(ctx, node)
}

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
	// TLS and Authorize are the ADS server's (ads.Config): nil serves plaintext and admits
	// every stream.
	TLS       *tls.Config
	Authorize func(ctx context.Context, node *corev3.Node) error
}

// Server holds the current resources and serves them over ADS. Its lifecycle: New, then Apply
// from any goroutine (one at a time: each waits for the one before) and Serve until its context
// ends.
type Server struct {
	ads     *ads.Server
	log     logr.Logger
	opts    translate.Options
	metrics *metrics
	store   *store.Store

	// mu orders Applies; it guards the fields below, which only Apply uses. The ADS streams
	// never take it.
	mu sync.Mutex
	// claims are the server names and advertised addresses of the applied shoots.
	claims      model.Claims
	constantSet bool
}

// New returns a Server holding no resources.
func New(cfg Config) *Server {
	prefix := cfg.VersionPrefix
	if prefix == "" {
		prefix = fmt.Sprintf("%x-", time.Now().UnixNano())
	}
	st := store.New(store.Config{VersionPrefix: prefix, Registry: cfg.Registry})
	return &Server{
		ads:     ads.New(st, ads.Config{Log: cfg.Log, Registry: cfg.Registry, TLS: cfg.TLS, Authorize: cfg.Authorize}),
		log:     cfg.Log,
		opts:    cfg.Options,
		metrics: newMetrics(cfg.Registry),
		store:   st,
	}
}

// Apply makes shoots the complete route set. Shoots whose model is unchanged are not validated
// or translated again; of the rest, only resources whose content changed are updated, and only
// the streams subscribed to them are told. The set must pass model.ValidateSet; Apply refuses
// it otherwise and keeps what it had. Its cost beyond the changed shoots is one map lookup and
// comparison per shoot: at 10,000 shoots, validating and comparing the whole set by reflection
// on every change dominated its cost (docs/performance.md, "xDS at scale"). Validating and
// translating hold only s.mu; the store is locked for the commit alone.
func (s *Server) Apply(shoots []model.Shoot) (model.Stats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	start := time.Now()
	changed, removed, err := s.diff(shoots)
	if err != nil {
		return model.Stats{}, fmt.Errorf("apply routes: %w", err)
	}

	// Resources are encoded as they are collected, so that a full build never holds every
	// shoot's translated messages at once.
	c := store.NewChange()
	if !s.constantSet {
		s.collect(translate.Constant(s.opts), c.Resources)
	}
	for _, sh := range changed {
		c.Shoots = append(c.Shoots, store.Shoot{Model: sh, Names: s.collect(translate.Shoot(sh), c.Resources)})
	}
	c.Removed = removed
	st := s.store.Commit(c)
	s.constantSet = true
	s.metrics.shoots.Set(float64(len(s.store.Applied())))
	s.metrics.applyDuration.Observe(time.Since(start).Seconds())
	s.metrics.changes.Add(float64(st.Updated + st.Removed))
	return st, nil
}

// diff compares a route set with the one applied: the shoots that are new or changed, and the
// names of those that are gone. It validates what it returns as model.ValidateSet would the whole
// set: the unchanged shoots passed when they were applied, so only the changed ones are checked,
// and their server names and advertised addresses against the claims of the shoots that stay.
// Called with s.mu held: Apply is the store's one committer, so it reads store.Applied unlocked.
func (s *Server) diff(shoots []model.Shoot) (changed []model.Shoot, removed []string, err error) {
	applied := s.store.Applied()
	seen := make(map[string]struct{}, len(shoots))
	var errs []error
	for _, sh := range shoots {
		if _, dup := seen[sh.Name]; dup {
			errs = append(errs, fmt.Errorf("shoot %s listed twice", sh.Name))
			continue
		}
		seen[sh.Name] = struct{}{}
		if old, ok := applied[sh.Name]; ok && old.Equal(sh) {
			continue
		}
		if err := sh.Validate(); err != nil {
			errs = append(errs, err)
			continue
		}
		changed = append(changed, sh)
	}
	for name := range applied {
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
		s.claims.Release(applied[name])
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
			if old, ok := applied[name]; ok {
				// Held before, by one shoot each, and released above: cannot conflict.
				_ = s.claims.Admit(old)
			}
		}
		return nil, nil, err
	}
	return changed, removed, nil
}

// collect encodes r's resources into desired and returns their names per type.
func (s *Server) collect(r translate.Resources, desired map[string]map[string]store.Resource) store.Names {
	var names store.Names
	add := func(t string, name string, res proto.Message) {
		desired[t][name] = s.encode(name, res)
		names.Add(t, name)
	}
	for _, c := range r.Secrets {
		add(resourcev3.SecretType, c.GetName(), c)
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
	return names
}

// encode encodes a translated resource. A generated resource always marshals; should one fail,
// it is served empty with a version that differs from any other, and the failure logged.
func (s *Server) encode(name string, m proto.Message) store.Resource {
	r, err := store.Encode(m)
	if err != nil {
		s.log.Error(err, "Encoding an xDS resource failed", "name", name)
		return store.Unique(time.Now().UnixNano())
	}
	return r
}

// Resources returns the names of the resources of type t currently served, sorted.
func (s *Server) Resources(t string) []string {
	v := s.store.Lock()
	defer s.store.Unlock()
	return v.Names(t)
}

// Serve serves ADS on l until ctx ends (ads.Server.Serve).
func (s *Server) Serve(ctx context.Context, l net.Listener) error { return s.ads.Serve(ctx, l) }

// TLS reports whether the server serves over TLS.
func (s *Server) TLS() bool { return s.ads.TLS() }

// ShootStatus returns the current status of one shoot (ads.Server.ShootStatus).
func (s *Server) ShootStatus(name string) model.ShootStatus { return s.ads.ShootStatus(name) }

// StatusChanges is signalled when at least one shoot's status may have changed
// (ads.Server.StatusChanges).
func (s *Server) StatusChanges() <-chan struct{} { return s.ads.StatusChanges() }

// TakeStatusChanges returns the status of every shoot whose state or model changed since the
// last call (ads.Server.TakeStatusChanges).
func (s *Server) TakeStatusChanges() []model.ShootStatus { return s.ads.TakeStatusChanges() }

// SetExpectedNodes names the data planes that serve traffic (ads.Server.SetExpectedNodes).
func (s *Server) SetExpectedNodes(nodes []string) { s.ads.SetExpectedNodes(nodes) }
