package seedserver

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tendril-net/tendril/tunnel/wg"
)

func TestCheckAgentPrefixes(t *testing.T) {
	key := func() wg.Key {
		k, err := wg.GenerateKey()
		if err != nil {
			t.Fatal(err)
		}
		return k.PublicKey()
	}
	pfx := netip.MustParsePrefix
	shoot := []netip.Prefix{pfx("10.0.0.0/8")}
	for _, tc := range []struct {
		name  string
		peers [][]netip.Prefix
		want  string // error substring; "" for none
		own   [][]netip.Prefix
	}{
		{"one agent listing the CIDRs", [][]netip.Prefix{{pfx("fd8f::2/128"), pfx("10.0.0.0/8")}}, "",
			[][]netip.Prefix{{pfx("fd8f::2/128"), pfx("10.0.0.0/8")}}},
		{"two agents", [][]netip.Prefix{{pfx("fd8f::2/128")}, {pfx("fd8f::3/128")}}, "",
			[][]netip.Prefix{{pfx("fd8f::2/128")}, {pfx("fd8f::3/128")}}},
		{"two agents listing the CIDRs", [][]netip.Prefix{{pfx("fd8f::2/128"), pfx("10.0.0.0/8")}, {pfx("fd8f::3/128"), pfx("10.0.0.0/8")}}, "",
			[][]netip.Prefix{{pfx("fd8f::2/128")}, {pfx("fd8f::3/128")}}},
		{"an agent address inside the shoot", [][]netip.Prefix{{pfx("10.1.0.2/32")}, {pfx("fd8f::3/128")}}, "overlaps the shoot's network", nil},
		{"two agents, one address", [][]netip.Prefix{{pfx("fd8f::2/128")}, {pfx("fd8f::2/128")}}, "overlap", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{ShootCIDRs: shoot}
			for _, p := range tc.peers {
				cfg.Tunnel.Peers = append(cfg.Tunnel.Peers, wg.Peer{PublicKey: key(), AllowedIPs: p})
			}
			err := checkAgentPrefixes(&cfg)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("got %v, want an error with %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, p := range cfg.Tunnel.Peers {
				if got, want := p.AllowedIPs, tc.own[i]; !slices.Equal(got, want) {
					t.Fatalf("peer %d: %v, want %v", i, got, want)
				}
			}
		})
	}
}

func TestFailoverDue(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	for _, tc := range []struct {
		name                   string
		deadSince, closedSince time.Time
		silentFirst            bool
		want                   time.Time
	}{
		{"stream closed", t0, t0, false, at(closedStreamGrace)},
		{"silent, stream attached", t0, time.Time{}, true, at(failoverGrace)},
		// The agent gives up on the silent path 0.2 s later and closes its stream: the silent
		// grace still holds.
		{"silent, then closed early", t0, at(200 * time.Millisecond), true, at(failoverGrace)},
		// Closed late in the silent grace: the closed stream's grace runs from the close.
		{"silent, then closed late", t0, at(900 * time.Millisecond), true, at(900*time.Millisecond + closedStreamGrace)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := failoverDue(tc.deadSince, tc.closedSince, tc.silentFirst); !got.Equal(tc.want) {
				t.Errorf("due %v after the death, want %v", got.Sub(t0), tc.want.Sub(t0))
			}
		})
	}
}
