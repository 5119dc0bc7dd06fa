package store_test

import (
	"maps"
	"slices"
	"testing"

	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tendril-net/tendril/xds/model"
	"github.com/tendril-net/tendril/xds/store"
)

// recorder is a Subscriber that records what it is told.
type recorder struct {
	replaced  []string // type/name → "+" (updated) or "-" (removed)
	changed   map[string][]string
	committed [][]string
}

func (r *recorder) Replacing(_ *store.View, t, name string, _ store.Hash, ok bool) {
	op := "-"
	if ok {
		op = "+"
	}
	r.replaced = append(r.replaced, op+t+"/"+name)
}

func (r *recorder) Changed(_ *store.View, t string, names []string) {
	r.changed[t] = append(r.changed[t], names...)
}

func (r *recorder) Committed(_ *store.View, shoots []string) {
	r.committed = append(r.committed, slices.Clone(shoots))
}

func encode(t *testing.T, s string) store.Resource {
	t.Helper()
	r, err := store.Encode(wrapperspb.String(s))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestCommit: a commit writes only resources whose version changed, removes the names a shoot
// no longer has, moves a name between shoots as an update, and tells the subscribers exactly
// that; the state-of-the-world version counts the commits that changed a type.
func TestCommit(t *testing.T) {
	cl := store.Types[0]
	s := store.New(store.Config{VersionPrefix: "p-"})
	rec := &recorder{changed: map[string][]string{}}
	s.Subscribe(rec)
	select {
	case <-s.Ready():
		t.Fatal("ready before the first commit")
	default:
	}
	commit := func(shoots map[string][]string, removed ...string) (int, int) {
		t.Helper()
		c := store.NewChange()
		for _, name := range slices.Sorted(maps.Keys(shoots)) {
			var names store.Names
			for _, r := range shoots[name] {
				c.Resources[cl][r] = encode(t, name+":"+r)
				names.Add(cl, r)
			}
			c.Shoots = append(c.Shoots, store.Shoot{Model: model.Shoot{Name: name}, Names: names})
		}
		c.Removed = removed
		rec.replaced, rec.changed, rec.committed = nil, map[string][]string{}, nil
		st := s.Commit(c)
		if st.Translated != len(shoots) {
			t.Errorf("%d shoots committed, %d counted", len(shoots), st.Translated)
		}
		return st.Updated, st.Removed
	}

	if u, r := commit(map[string][]string{"a": {"x", "y"}}); u != 2 || r != 0 {
		t.Fatalf("first commit: %d updated, %d removed", u, r)
	}
	<-s.Ready()
	if got := slices.Sorted(slices.Values(rec.changed[cl])); !slices.Equal(got, []string{"x", "y"}) {
		t.Errorf("changed %v", got)
	}
	// The same content again: nothing written, nobody told of a change.
	if u, r := commit(map[string][]string{"a": {"x", "y"}}); u != 0 || r != 0 || len(rec.replaced) != 0 || len(rec.changed) != 0 {
		t.Errorf("unchanged commit: %d updated, %d removed, replaced %v, changed %v", u, r, rec.replaced, rec.changed)
	}
	if len(rec.committed) != 1 || !slices.Equal(rec.committed[0], []string{"a"}) {
		t.Errorf("committed %v", rec.committed)
	}
	// a drops y; b takes y (new content, so an update, not a removal).
	if u, r := commit(map[string][]string{"a": {"x"}, "b": {"y"}}); u != 1 || r != 0 {
		t.Errorf("move: %d updated, %d removed", u, r)
	}
	if !slices.Equal(rec.replaced, []string{"+" + cl + "/y"}) {
		t.Errorf("move replaced %v", rec.replaced)
	}
	v := s.Lock()
	if o, _ := v.Owner(cl, "y"); o != "b" {
		t.Errorf("y owned by %q", o)
	}
	if got := v.Version(cl); got != "p-2" {
		t.Errorf("version %q, want p-2 (two commits changed clusters)", got)
	}
	s.Unlock()
	// b goes: y is removed.
	if u, r := commit(nil, "b"); u != 0 || r != 1 || !slices.Equal(rec.replaced, []string{"-" + cl + "/y"}) {
		t.Errorf("removal: %d updated, %d removed, replaced %v", u, r, rec.replaced)
	}
	v = s.Lock()
	defer s.Unlock()
	if got := v.Names(cl); !slices.Equal(got, []string{"x"}) {
		t.Errorf("names %v", got)
	}
	if _, ok := v.Owner(cl, "y"); ok {
		t.Error("a removed name kept its owner")
	}
	if _, ok := v.Shoots()["b"]; ok {
		t.Error("a removed shoot is still held")
	}
}
