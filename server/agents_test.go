package server

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

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
