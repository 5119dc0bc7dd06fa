package tundev

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/nftables"

	"github.com/tendril-net/tendril/internal/host/netns"
)

func TestConfigErrors(t *testing.T) {
	addr := []netip.Addr{netip.MustParseAddr("fd8f:6d53:b97a:1::2")}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no name", Config{Addresses: addr}, "device name"},
		{"name too long", Config{Name: "tendril-0123456789", Addresses: addr}, "device name"},
		{"no address", Config{Name: "tendril0"}, "no inner address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := New(tc.cfg)
			if err == nil {
				s.Close()
				t.Fatal("New accepted it")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
		})
	}
}

// TestStaleTableReplaced: a table of the device's name that a killed process left (here with a
// chain of its own) is replaced by an empty one of the Stack's, and Close removes it.
func TestStaleTableReplaced(t *testing.T) {
	if err := netns.Check(); err != nil {
		t.Skip(err)
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skip(err)
	}
	ns := "ttd" + strconv.Itoa(os.Getpid())
	if err := netns.IP(t.Context(), "netns", "add", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = netns.IP(context.Background(), "netns", "del", ns) })
	chains := func(cc *nftables.Conn) (names []string) {
		cs, err := cc.ListChainsOfTableFamily(nftables.TableFamilyINet)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if c.Table.Name == "tendril-tendril0" {
				names = append(names, c.Name)
			}
		}
		slices.Sort(names)
		return names
	}
	err := netns.In(ns, func() error {
		cc, err := nftables.New()
		if err != nil {
			return err
		}
		stale := cc.AddTable(&nftables.Table{Name: "tendril-tendril0", Family: nftables.TableFamilyINet})
		cc.AddChain(&nftables.Chain{Name: "stale", Table: stale})
		if err := cc.Flush(); err != nil {
			return err
		}
		s, err := New(Config{Name: "tendril0", Addresses: []netip.Addr{netip.MustParseAddr("fd8f:6d53:b97a:1::1")}})
		if err != nil {
			return err
		}
		if got := chains(cc); !slices.Equal(got, []string{"forward", "input"}) {
			s.Close()
			return fmt.Errorf("chains %v after New, want forward and input", got)
		}
		if err := s.Close(); err != nil {
			return err
		}
		if got := chains(cc); len(got) != 0 {
			return fmt.Errorf("chains %v after Close, want none", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
