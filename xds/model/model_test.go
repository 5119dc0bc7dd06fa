package model

import (
	"net/netip"
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
