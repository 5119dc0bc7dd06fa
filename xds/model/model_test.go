package model

import (
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestEndpoints(t *testing.T) {
	a, b, c := netip.MustParseAddrPort("10.0.0.2:443"), netip.MustParseAddrPort("10.0.0.1:443"), netip.MustParseAddrPort("[::ffff:10.0.0.3]:443")
	s := Shoot{Name: "shoot--a--b", Hosts: []string{"a.b"}, APIServers: []netip.AddrPort{a, b, a, c}, APIServer: b}
	want := []netip.AddrPort{b, a, netip.MustParseAddrPort("10.0.0.3:443")}
	if got := s.APIServerEndpoints(); !slices.Equal(got, want) {
		t.Errorf("APIServerEndpoints = %v, want %v (sorted, unmapped, no duplicates, shorthand merged)", got, want)
	}
	if err := s.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	if got := (Shoot{}).VPNServerEndpoints(); len(got) != 0 {
		t.Errorf("no vpn server: %v", got)
	}
	// No kube-apiserver endpoint is valid: the shoot is routed, its connections refused.
	if err := (Shoot{Name: "shoot--a--b", Hosts: []string{"a.b"}}).Validate(); err != nil {
		t.Errorf("shoot without endpoints: %v", err)
	}
	for _, bad := range []Shoot{
		{Name: "shoot--a--b", Hosts: []string{"a.b"}, APIServers: []netip.AddrPort{{}}},
		{Name: "shoot--a--b", Hosts: []string{"a.b"}, APIServers: []netip.AddrPort{netip.MustParseAddrPort("10.0.0.1:0")}},
		{Name: "shoot--a--b", Hosts: []string{"a.b"}, VPNServer: netip.MustParseAddrPort("10.0.0.1:0")},
	} {
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "non-zero port") {
			t.Errorf("Validate(%+v) = %v, want a port error", bad, err)
		}
	}
}

// TestEqualCoversEveryField changes each field of a route in turn: Equal must notice, as
// reflect.DeepEqual does, so that a field added later cannot be forgotten in Equal.
func TestEqualCoversEveryField(t *testing.T) {
	base := Shoot{
		Name: "shoot--a--b", Hosts: []string{"a.b", "c.d"},
		APIServers:        []netip.AddrPort{netip.MustParseAddrPort("10.0.0.1:443")},
		AdvertisedAddress: netip.MustParseAddr("240.0.0.1"),
		VPNServers:        []netip.AddrPort{netip.MustParseAddrPort("10.0.1.1:1194")},
		APIServer:         netip.MustParseAddrPort("10.0.0.2:443"),
		VPNServer:         netip.MustParseAddrPort("10.0.1.2:1194"),
		VPNReplicas:       []VPNReplica{{Hostname: "tendril-server-0", Endpoint: netip.MustParseAddrPort("10.0.1.1:1194")}},
		Termination:       &Termination{APIServerName: "kube-apiserver"},
	}
	// A copy with fresh slices: equal content in other memory.
	same := base
	same.Hosts = slices.Clone(base.Hosts)
	same.APIServers = slices.Clone(base.APIServers)
	same.VPNServers = slices.Clone(base.VPNServers)
	same.VPNReplicas = slices.Clone(base.VPNReplicas)
	same.Termination = &Termination{APIServerName: "kube-apiserver"}
	if !base.Equal(same) {
		t.Fatal("a copy is not Equal")
	}
	changes := map[string]func(*Shoot){
		"Name":              func(s *Shoot) { s.Name = "shoot--a--c" },
		"Hosts":             func(s *Shoot) { s.Hosts = []string{"c.d", "a.b"} },
		"APIServers":        func(s *Shoot) { s.APIServers = append(slices.Clone(s.APIServers), s.APIServer) },
		"AdvertisedAddress": func(s *Shoot) { s.AdvertisedAddress = netip.Addr{} },
		"VPNServers":        func(s *Shoot) { s.VPNServers = nil },
		"APIServer":         func(s *Shoot) { s.APIServer = netip.MustParseAddrPort("10.0.0.2:6443") },
		"VPNServer":         func(s *Shoot) { s.VPNServer = netip.AddrPort{} },
		"Termination":       func(s *Shoot) { s.Termination = nil },
		"VPNReplicas": func(s *Shoot) {
			s.VPNReplicas = []VPNReplica{{Hostname: "tendril-server-1", Endpoint: s.VPNReplicas[0].Endpoint}}
		},
	}
	typ := reflect.TypeFor[Shoot]()
	for i := range typ.NumField() {
		name := typ.Field(i).Name
		change, ok := changes[name]
		if !ok {
			t.Errorf("field %s: no change in this test; add one and compare it in Equal", name)
			continue
		}
		other := same
		change(&other)
		if reflect.DeepEqual(base, other) {
			t.Fatalf("field %s: the test's change changes nothing", name)
		}
		if base.Equal(other) || other.Equal(base) {
			t.Errorf("field %s changed, but Equal reports the routes equal", name)
		}
	}
}

// TestValidateReplicas: an HA server's replicas are DNS labels with one endpoint each, each
// named once.
func TestValidateReplicas(t *testing.T) {
	ep := netip.MustParseAddrPort("10.0.1.1:1194")
	ok := Shoot{Name: "shoot--a--b", Hosts: []string{"a.b"}, VPNReplicas: []VPNReplica{{"tendril-server-0", ep}, {"tendril-server-1", ep}}}
	if err := ok.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	for _, tc := range []struct {
		replicas []VPNReplica
		want     string
	}{
		{[]VPNReplica{{"tendril-server-0", ep}, {"tendril-server-0", ep}}, "listed twice"},
		{[]VPNReplica{{"", ep}}, "empty"},
		{[]VPNReplica{{"Tendril", ep}}, "hostname"},
		{[]VPNReplica{{"tendril-server-0", netip.AddrPort{}}}, "non-zero port"},
		{[]VPNReplica{{"tendril-server-0", netip.MustParseAddrPort("10.0.1.1:0")}}, "non-zero port"},
	} {
		s := ok
		s.VPNReplicas = tc.replicas
		if err := s.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("replicas %v: %v, want an error with %q", tc.replicas, err, tc.want)
		}
	}
	list := []VPNReplica{{"tendril-server-1", ep}, {"tendril-server-0", ep}}
	SortReplicas(list)
	if list[0].Hostname != "tendril-server-0" {
		t.Errorf("sorted: %v", list)
	}
}
