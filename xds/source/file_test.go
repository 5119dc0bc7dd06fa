package source

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/tendril-net/tendril/xds/model"
)

type fakeResolver map[string][]netip.Addr

func (f fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := f[host]; ok {
		return a, nil
	}
	return nil, &os.PathError{Op: "lookup", Path: host, Err: os.ErrNotExist}
}

func TestParseRoutes(t *testing.T) {
	res := fakeResolver{"kube-apiserver.shoot--a--b": {netip.MustParseAddr("10.0.0.9"), netip.MustParseAddr("10.0.0.3")}}
	good := `
shoots:
- name: shoot--a--b
  hosts: [api.b.a.example.com]
  apiserver: kube-apiserver.shoot--a--b:443
  advertisedAddress: 240.0.0.1
  vpnServer: 10.0.0.4:1194
`
	shoots, err := ParseRoutes(context.Background(), []byte(good), res)
	if err != nil {
		t.Fatal(err)
	}
	want := model.Shoot{
		Name: "shoot--a--b", Hosts: []string{"api.b.a.example.com"},
		// Every address of a name, sorted, so a reload never reorders them.
		APIServers:        []netip.AddrPort{netip.MustParseAddrPort("10.0.0.3:443"), netip.MustParseAddrPort("10.0.0.9:443")},
		AdvertisedAddress: netip.MustParseAddr("240.0.0.1"),
		VPNServers:        []netip.AddrPort{netip.MustParseAddrPort("10.0.0.4:1194")},
	}
	if len(shoots) != 1 || !equal(shoots[0], want) {
		t.Fatalf("got %+v, want %+v", shoots, want)
	}

	// A list of upstream addresses (several replicas): names and IPs mixed, duplicates merged.
	list := `
shoots:
- name: shoot--a--b
  hosts: [api.b.a.example.com]
  apiserver: [10.0.0.20:443, kube-apiserver.shoot--a--b:443, 10.0.0.3:443]
  vpnServer: ["[fd00::1]:1194", 10.0.0.4:1194]
`
	if shoots, err = ParseRoutes(context.Background(), []byte(list), res); err != nil {
		t.Fatal(err)
	}
	want = model.Shoot{
		Name: "shoot--a--b", Hosts: []string{"api.b.a.example.com"},
		APIServers: []netip.AddrPort{netip.MustParseAddrPort("10.0.0.3:443"), netip.MustParseAddrPort("10.0.0.9:443"), netip.MustParseAddrPort("10.0.0.20:443")},
		VPNServers: []netip.AddrPort{netip.MustParseAddrPort("10.0.0.4:1194"), netip.MustParseAddrPort("[fd00::1]:1194")},
	}
	if len(shoots) != 1 || !equal(shoots[0], want) {
		t.Fatalf("list: got %+v, want %+v", shoots, want)
	}

	for name, tc := range map[string]struct{ yaml, err string }{
		"unknown field":    {"shoots:\n- name: shoot--a--b\n  hostz: [a.b]\n  apiserver: 10.0.0.1:443\n", "unknown field"},
		"upper-case host":  {"shoots:\n- name: shoot--a--b\n  hosts: [API.b]\n  apiserver: 10.0.0.1:443\n", "lower-case"},
		"no port":          {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1\n", "apiserver"},
		"empty list":       {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: []\n", "apiserver is required"},
		"bad list item":    {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: [10.0.0.1:443, 10.0.0.2]\n", "apiserver"},
		"not a list":       {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: {a: 1}\n", "host:port"},
		"port 0":           {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1:0\n", "invalid port"},
		"unresolvable":     {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: nowhere:443\n", "resolve nowhere"},
		"duplicate host":   {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1:443\n- name: shoot--a--c\n  hosts: [a.b]\n  apiserver: 10.0.0.2:443\n", "claimed by both"},
		"duplicate shoot":  {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1:443\n- name: shoot--a--b\n  hosts: [a.c]\n  apiserver: 10.0.0.2:443\n", "listed twice"},
		"bad name":         {"shoots:\n- name: Shoot_A\n  hosts: [a.b]\n  apiserver: 10.0.0.1:443\n", "invalid character"},
		"no hosts":         {"shoots:\n- name: shoot--a--b\n  apiserver: 10.0.0.1:443\n", "at least one host"},
		"advertised name":  {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1:443\n  advertisedAddress: api.local\n", "advertisedAddress"},
		"not yaml":         {"shoots: [", "decode routes"},
		"shared advertise": {"shoots:\n- name: shoot--a--b\n  hosts: [a.b]\n  apiserver: 10.0.0.1:443\n  advertisedAddress: 240.0.0.1\n- name: shoot--a--c\n  hosts: [a.c]\n  apiserver: 10.0.0.2:443\n  advertisedAddress: 240.0.0.1\n", "claimed by both"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseRoutes(context.Background(), []byte(tc.yaml), res)
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("error %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func equal(a, b model.Shoot) bool {
	return a.Name == b.Name && slices.Equal(a.Hosts, b.Hosts) &&
		slices.Equal(a.APIServerEndpoints(), b.APIServerEndpoints()) && a.AdvertisedAddress == b.AdvertisedAddress &&
		slices.Equal(a.VPNServerEndpoints(), b.VPNServerEndpoints())
}

func routeYAML(names ...string) string {
	var b strings.Builder
	b.WriteString("shoots:\n")
	for i, n := range names {
		b.WriteString("- name: " + n + "\n  hosts: [api." + n + ".example.com]\n  apiserver: 10.0.0." + string(rune('1'+i)) + ":443\n")
	}
	return b.String()
}

// TestFileReload drives the watcher with real file writes: in place, by rename (as editors and
// ConfigMap volumes do), and a bad version, which is refused while the last good set stays.
func TestFileReload(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "routes.yaml")
	write := func(content string) {
		t.Helper()
		tmp := filepath.Join(dir, ".tmp")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write(routeYAML("shoot--a--one"))

	got := make(chan []model.Shoot, 10)
	ctx, cancel := context.WithCancel(context.Background())
	f := &File{Path: path, Log: testr.New(t), Settle: 20 * time.Millisecond}
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, func(s []model.Shoot) error { got <- s; return nil }) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	next := func() []model.Shoot {
		t.Helper()
		select {
		case s := <-got:
			return s
		case <-time.After(10 * time.Second):
			t.Fatal("no route set published within 10 s")
			return nil
		}
	}
	if s := next(); len(s) != 1 || s[0].Name != "shoot--a--one" {
		t.Fatalf("initial load: %+v", s)
	}
	write(routeYAML("shoot--a--one", "shoot--a--two"))
	if s := next(); len(s) != 2 {
		t.Fatalf("after rename: %d shoots", len(s))
	}
	// A bad version publishes nothing; the next good one is published. The good write after the
	// bad one proves the bad one was seen and skipped rather than still pending.
	write("shoots:\n- name: BAD\n")
	time.Sleep(100 * time.Millisecond) // past the settle time, so the bad version is read on its own
	if err := os.WriteFile(path, []byte(routeYAML("shoot--a--three")), 0o644); err != nil {
		t.Fatal(err)
	}
	if s := next(); len(s) != 1 || s[0].Name != "shoot--a--three" {
		t.Fatalf("after bad then good write: %+v", s)
	}
	// Another file in the directory changing is not a reload.
	if err := os.WriteFile(filepath.Join(dir, "other.log"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // a reload it caused would publish "three" again, first
	write(routeYAML("shoot--a--four"))
	if s := next(); len(s) != 1 || s[0].Name != "shoot--a--four" {
		t.Fatalf("after unrelated write and a good one: %+v", s)
	}
}

func TestFileFirstLoadMustSucceed(t *testing.T) {
	path := filepath.Join(t.TempDir(), "routes.yaml")
	if err := os.WriteFile(path, []byte("shoots: [{name: x}]"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := &File{Path: path}
	err := f.Run(context.Background(), func([]model.Shoot) error { t.Fatal("published a bad file"); return nil })
	if err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("error %v, want one naming the file", err)
	}
}
