package vethnet

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestVeth(t *testing.T) {
	got := Veth("", "a0", netip.MustParsePrefix("10.1.2.1/30"), "ns", "b0", netip.MustParsePrefix("10.1.2.2/30"))
	want := []string{
		"link add a0 type veth peer name b0",
		"link set b0 netns ns",
		"addr add 10.1.2.1/30 dev a0",
		"link set a0 up",
		"-n ns addr add 10.1.2.2/30 dev b0",
		"-n ns link set b0 up",
	}
	var lines []string
	for _, st := range got {
		lines = append(lines, strings.Join(st, " "))
	}
	if !slices.Equal(lines, want) {
		t.Errorf("Veth:\n%s\nwant:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
	if st := Veth("x", "a", netip.Prefix{}, "y", "b", netip.Prefix{})[0]; st[0] != "-n" || st[1] != "x" {
		t.Errorf("Veth in namespace x starts %q", st)
	}
}

func TestRunNames(t *testing.T) {
	r := Run{Prefix: "tbx-", PID: 1234, N: 1234%250 + 1}
	if got := r.NS("shoot"); got != "tbx-1234-shoot" {
		t.Errorf("NS: %s", got)
	}
	if got := r.Addr(231, 2); got != netip.MustParseAddr("10.231.235.2") {
		t.Errorf("Addr: %s", got)
	}
	if r.ID() != "1234" {
		t.Errorf("ID: %s", r.ID())
	}
}
