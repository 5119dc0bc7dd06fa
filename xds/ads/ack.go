package ads

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/store"
)

// acks is what each delta stream holds, guarded by the store's lock.
type acks struct {
	streams map[int64]*streamAcks
	// states is the last evaluated state per shoot; changed names the shoots whose state or
	// model changed since TakeStatusChanges last ran, and notify is signalled when it grows.
	states  map[string]model.State
	changed map[string]bool
	notify  chan struct{}
	// expected are the node IDs that must hold a shoot for it to be programmed, besides every
	// synced client (SetExpectedNodes); empty: the synced clients only.
	expected map[string]bool
}

func newAcks() acks {
	return acks{
		streams: make(map[int64]*streamAcks),
		states:  make(map[string]model.State),
		changed: make(map[string]bool),
		notify:  make(chan struct{}, 1),
	}
}

type streamAcks struct {
	node   string
	synced bool
	// subscribed are the types the client asked for.
	subscribed map[string]bool
	// sent holds the responses not yet answered, per type and nonce.
	sent map[string]map[string]sentResponse
	// stale is, per type, where what the client holds differs from what is current: resource
	// name → the version the client holds ("" for none). A name that is not there is held at its
	// current version, or neither held nor current. Kept as the difference rather than as
	// everything each client holds: once clients are synced it is nearly empty, where a full map
	// per client and type cost ~10 MiB at 10,000 shoots and 3 clients. A commit keeps it in step with
	// the current versions (replacing).
	stale map[string]*staleSet
	// refused are the versions the client NACKed, per type and name, with its detail.
	refused map[string]map[string]refusal
}

// staleSet is a stream's stale names of one type. Go maps keep their size when entries are
// deleted, so the map is replaced once it has shrunk to a quarter of its largest size (a new
// client starts with every current name stale).
type staleSet struct {
	m    map[string]string
	high int
}

func (st *staleSet) set(name, held string) {
	st.m[name] = held
	st.high = max(st.high, len(st.m))
}

func (st *staleSet) del(name string) {
	delete(st.m, name)
	if st.high > 1024 && len(st.m) < st.high/4 {
		// Copied into a map sized for what is left: maps.Clone keeps the original's capacity.
		m := make(map[string]string, len(st.m))
		maps.Copy(m, st.m)
		st.m = m
		st.high = len(st.m)
	}
}

// same reports whether a held version ("" for none) is the current one (ok: there is one).
func same(held string, cur store.Hash, ok bool) bool {
	if !ok {
		return held == ""
	}
	return cur.Is(held)
}

// setHeld records that the stream now holds version v ("" for none) of a resource.
func (s *Server) setHeld(c *streamAcks, t, name, v string) {
	cur, ok := s.v.Resources(t)[name]
	if same(v, cur.Version, ok) {
		c.stale[t].del(name)
	} else {
		c.stale[t].set(name, v)
	}
}

// replacing keeps every stream's stale set in step with a resource whose current version
// becomes cur (ok: present; otherwise removed). The store calls it with its lock held, before
// the resource changes (store.Subscriber).
func (s *Server) replacing(v *store.View, t, name string, cur store.Hash, ok bool) {
	r, had := v.Resource(t, name)
	old := r.Version
	for _, c := range s.acks.streams {
		st := c.stale[t]
		if st == nil {
			continue
		}
		held, stale := st.m[name]
		if !stale && had {
			held = old.Hex() // held at the version current until now
		}
		if same(held, cur, ok) {
			st.del(name)
		} else {
			st.set(name, held)
		}
	}
}

type sentResponse struct {
	resources map[string]string // name → version
	removed   []string
}

type refusal struct{ version, detail string }

// StatusChanges is signalled (coalesced, capacity one) when at least one shoot's status may have
// changed; TakeStatusChanges then says which. There is one consumer.
func (s *Server) StatusChanges() <-chan struct{} { return s.acks.notify }

// TakeStatusChanges returns the current status of every shoot whose state or model changed since
// the last call, sorted by name, and forgets them. A removed shoot is reported once with
// model.StateUnknown.
func (s *Server) TakeStatusChanges() []model.ShootStatus {
	s.st.Lock()
	defer s.st.Unlock()
	out := make([]model.ShootStatus, 0, len(s.acks.changed))
	for _, name := range slices.Sorted(maps.Keys(s.acks.changed)) {
		out = append(out, s.status(name))
	}
	clear(s.acks.changed)
	return out
}

// SetExpectedNodes names the data planes that serve traffic (their xDS node IDs): a shoot is
// programmed only once each of them has a synced stream holding its current resources, besides
// every other synced client. Without it, a replica that is reconnecting, or connected to
// another control-plane instance, would simply not be counted, and a shoot could be reported
// programmed that it does not hold. nil or empty: only the connected clients count.
func (s *Server) SetExpectedNodes(nodes []string) {
	s.st.Lock()
	defer s.st.Unlock()
	want := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		want[n] = true
	}
	if maps.Equal(want, s.acks.expected) {
		return
	}
	s.acks.expected = want
	s.evaluateAll()
}

// ShootStatus returns the current status of one shoot.
func (s *Server) ShootStatus(name string) model.ShootStatus {
	s.st.Lock()
	defer s.st.Unlock()
	return s.status(name)
}

// status evaluates one shoot against every synced delta client. Called with the store locked.
func (s *Server) status(name string) model.ShootStatus {
	sh, ok := s.v.Shoots()[name]
	if !ok {
		return model.ShootStatus{Name: name, State: model.StateUnknown}
	}
	st := model.ShootStatus{Name: name, Model: sh}
	pending := false
	// synced are the nodes with a synced stream, collected only when some are expected.
	var synced map[string]bool
	if len(s.acks.expected) > 0 {
		synced = make(map[string]bool, len(s.acks.expected))
	}
	// Streams in a fixed order, so that the detail of a shoot two clients refused is stable.
	for _, id := range slices.Sorted(maps.Keys(s.acks.streams)) {
		c := s.acks.streams[id]
		if !c.synced {
			continue
		}
		st.Clients++
		if synced != nil {
			synced[c.node] = true
		}
		for i, names := range s.v.Owned(name) {
			t := store.Types[i]
			for _, n := range names {
				v := s.v.Resources(t)[n].Version
				if c.stale[t] == nil {
					// An on-demand type the client has not asked for yet (Envoy's SDS): it
					// does not hold the shoot's resources of it.
					pending = true
					continue
				}
				if _, stale := c.stale[t].m[n]; !stale {
					continue
				}
				if r, ok := c.refused[t][n]; ok && v.Is(r.version) {
					if st.Detail == "" {
						st.Detail = fmt.Sprintf("%s refused %s: %s", cmp.Or(c.node, "a client"), n, r.detail)
					}
					continue
				}
				pending = true
			}
		}
	}
	for n := range s.acks.expected {
		if !synced[n] {
			st.Missing = append(st.Missing, n)
		}
	}
	slices.Sort(st.Missing)
	switch {
	case st.Detail != "":
		st.State = model.StateRejected
	case pending || st.Clients == 0 || len(st.Missing) > 0:
		st.State = model.StatePending
	default:
		st.State = model.StateProgrammed
	}
	return st
}

// evaluateAll re-evaluates every shoot, after a client came or went. Called with the store locked.
func (s *Server) evaluateAll() {
	names := slices.Collect(maps.Keys(s.v.Shoots()))
	for n := range s.acks.states {
		if _, ok := s.v.Shoots()[n]; !ok {
			names = append(names, n)
		}
	}
	s.evaluate(names, false)
}

// committed re-evaluates the shoots a commit changed or removed (store.Subscriber).
func (s *Server) committed(_ *store.View, shoots []string) { s.evaluate(shoots, true) }

// evaluate re-evaluates the named shoots and records those whose state changed, or all of them
// when force is set (their model changed). Called with the store locked.
func (s *Server) evaluate(names []string, force bool) {
	grew := false
	for _, n := range names {
		st := s.status(n).State
		old, known := s.acks.states[n]
		if st == model.StateUnknown {
			delete(s.acks.states, n)
		} else {
			s.acks.states[n] = st
		}
		if force || old != st || !known && st != model.StateUnknown {
			if !s.acks.changed[n] {
				s.acks.changed[n] = true
				grew = true
			}
		}
	}
	if grew {
		select {
		case s.acks.notify <- struct{}{}:
		default:
		}
	}
}

// deltaRequest records a delta client's subscription and its answer to an earlier response.
// Called with the store locked.
func (s *Server) deltaRequest(id int64, req *discoveryv3.DeltaDiscoveryRequest) {
	c := s.acks.streams[id]
	if c == nil {
		c = &streamAcks{
			subscribed: make(map[string]bool),
			sent:       make(map[string]map[string]sentResponse),
			stale:      make(map[string]*staleSet),
			refused:    make(map[string]map[string]refusal),
		}
		s.acks.streams[id] = c
	}
	if n := req.GetNode().GetId(); n != "" {
		c.node = n
	}
	t := req.GetTypeUrl()
	if !c.subscribed[t] {
		// A reconnecting client names what it already holds; the server sends only the rest,
		// so what it names counts as acknowledged.
		c.subscribed[t] = true
		iv := req.GetInitialResourceVersions()
		st := &staleSet{m: make(map[string]string, len(s.v.Resources(t)))}
		for n, cur := range s.v.Resources(t) {
			if v := iv[n]; !cur.Version.Is(v) {
				st.m[n] = v
			}
		}
		for n, v := range iv {
			if _, ok := s.v.Resources(t)[n]; !ok && v != "" {
				st.m[n] = v
			}
		}
		st.high = len(st.m)
		c.stale[t] = st
		c.sent[t] = make(map[string]sentResponse)
		c.refused[t] = make(map[string]refusal)
	}
	nonce := req.GetResponseNonce()
	resp, ok := c.sent[t][nonce]
	if nonce == "" || !ok {
		return
	}
	// Clients answer responses in order; anything older than this nonce was answered or is
	// lost, and must not pile up.
	for n := range c.sent[t] {
		if nonceBefore(n, nonce) {
			delete(c.sent[t], n)
		}
	}
	delete(c.sent[t], nonce)
	if d := req.GetErrorDetail(); d != nil {
		names := slices.AppendSeq(slices.Clone(resp.removed), maps.Keys(resp.resources))
		if ds := s.delta[id]; len(names) > 1 && ds != nil && ds.subs[t] != nil {
			// Not a refusal of any one of them yet: isolate sends them again in halves.
			ds.subs[t].isolate(names)
			s.metrics.isolated.WithLabelValues(t).Inc()
		} else {
			for n, v := range resp.resources {
				c.refused[t][n] = refusal{version: v, detail: d.GetMessage()}
			}
		}
	} else {
		for n, v := range resp.resources {
			s.setHeld(c, t, n, v)
			delete(c.refused[t], n)
		}
		for _, n := range resp.removed {
			s.setHeld(c, t, n, "")
			delete(c.refused[t], n)
		}
	}
	if !c.synced {
		if c.synced = s.syncedLocked(id, c); c.synced {
			s.metrics.clients.Inc()
			s.evaluateAll()
		}
		return
	}
	// Only the owners of what the response carried can have changed state (a removal's owner
	// is gone and was reported by the commit).
	owners := make(map[string]bool)
	for n := range resp.resources {
		if o, ok := s.v.Owner(t, n); ok {
			owners[o] = true
		}
	}
	s.evaluate(slices.Collect(maps.Keys(owners)), false)
}

// syncedLocked: the client subscribed every type (but those it asks for only on demand), was
// sent all of it (a first sync spans several responses, see maxResponseBytes) and answered every
// response.
func (s *Server) syncedLocked(id int64, c *streamAcks) bool {
	d := s.delta[id]
	for _, t := range store.Types {
		if !c.subscribed[t] && store.OnDemand(t) {
			continue
		}
		if !c.subscribed[t] || len(c.sent[t]) > 0 || d != nil && d.subs[t] != nil && len(d.subs[t].dirty) > 0 {
			return false
		}
	}
	return true
}

// deltaResponse records what a response carries, to credit it when the client answers. Called
// with the store locked, before the response is sent.
func (s *Server) deltaResponse(id int64, resp *discoveryv3.DeltaDiscoveryResponse) {
	c := s.acks.streams[id]
	t := resp.GetTypeUrl()
	if c == nil || c.sent[t] == nil {
		return
	}
	r := sentResponse{resources: make(map[string]string, len(resp.GetResources())), removed: resp.GetRemovedResources()}
	for _, res := range resp.GetResources() {
		r.resources[res.GetName()] = res.GetVersion()
	}
	c.sent[t][resp.GetNonce()] = r
}

// deltaClosed forgets a stream; shoots it held back may now be programmed. Called with the store locked.
func (s *Server) deltaClosed(id int64) {
	c, ok := s.acks.streams[id]
	if !ok {
		return
	}
	delete(s.acks.streams, id)
	if c.synced {
		s.metrics.clients.Dec()
		s.evaluateAll()
	}
}

// nonceBefore compares the decimal stream nonces (ads.go).
func nonceBefore(a, b string) bool {
	x, err1 := strconv.ParseUint(a, 10, 64)
	y, err2 := strconv.ParseUint(b, 10, 64)
	return err1 == nil && err2 == nil && x < y
}
