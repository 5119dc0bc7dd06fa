package model_test

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/tendril-net/tendril/xds/model"
)

// TestClaimsAdmit: a shoot is admitted only with every claim free or its own; a refused shoot
// records nothing, and Release frees only what the shoot itself holds.
func TestClaimsAdmit(t *testing.T) {
	adv := netip.MustParseAddr("240.0.0.1")
	a := model.Shoot{Name: "a", Hosts: []string{"x.example", "y.example"}, AdvertisedAddress: adv}
	b := model.Shoot{Name: "b", Hosts: []string{"z.example", "y.example"}, AdvertisedAddress: adv}
	c := model.Shoot{Name: "c", Hosts: []string{"z.example"}}
	var claims model.Claims
	if err := claims.Admit(a); err != nil {
		t.Fatal(err)
	}
	if err := claims.Admit(a); err != nil {
		t.Errorf("admitting a shoot again: %v", err)
	}
	err := claims.Admit(b)
	var conflicts []*model.Conflict
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		var c *model.Conflict
		if !errors.As(e, &c) {
			t.Fatalf("%v is no *model.Conflict", e)
		}
		conflicts = append(conflicts, c)
	}
	want := []model.Conflict{{Shoot: "b", Holder: "a", Host: "y.example"}, {Shoot: "b", Holder: "a", Advertised: adv}}
	if len(conflicts) != len(want) || *conflicts[0] != want[0] || *conflicts[1] != want[1] {
		t.Fatalf("conflicts %+v, want %+v", conflicts, want)
	}
	if got := err.Error(); got != `host "y.example" claimed by both a and b`+"\n"+`advertised address 240.0.0.1 claimed by both a and b` {
		t.Errorf("error %q", got)
	}
	// b was refused: z.example stays free.
	if err := claims.Admit(c); err != nil {
		t.Errorf("a name of a refused shoot was recorded: %v", err)
	}
	// Releasing b (which holds nothing) keeps a's and c's claims.
	claims.Release(b)
	if err := claims.Admit(model.Shoot{Name: "d", Hosts: []string{"y.example"}}); err == nil {
		t.Error("releasing another shoot freed a's claim")
	}
	claims.Release(a)
	if err := claims.Admit(b); err == nil {
		t.Error("b admitted though c holds z.example")
	}
	claims.Release(c)
	if err := claims.Admit(b); err != nil {
		t.Errorf("after a and c released: %v", err)
	}
}
