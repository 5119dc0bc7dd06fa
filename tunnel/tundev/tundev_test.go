package tundev

import (
	"net/netip"
	"strings"
	"testing"
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
