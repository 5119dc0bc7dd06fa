package sysctl

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func TestEnsure(t *testing.T) {
	root = t.TempDir()
	p := filepath.Join(root, "net", "ipv4", "ip_forward")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Ensure("net.ipv4.ip_forward", "1"); err != nil {
		t.Fatal(err)
	}
	if v, err := Get("net.ipv4.ip_forward"); err != nil || v != "1" {
		t.Fatalf("got %q, %v; want 1", v, err)
	}
	// Already set: no write (a container's /proc/sys is read-only).
	before, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond) // a write would move the modification time
	if err := Ensure("net.ipv4.ip_forward", "1"); err != nil {
		t.Fatal(err)
	}
	if after, err := os.Stat(p); err != nil || !after.ModTime().Equal(before.ModTime()) {
		t.Fatalf("Ensure wrote a value that was set already (%v)", err)
	}
	// Missing parameter: an error that names it.
	if err := Ensure("net.ipv6.conf.all.forwarding", "1"); err == nil {
		t.Fatal("set a parameter that does not exist")
	}
	for _, bad := range []string{"", "net/ipv4", "net..x", "../etc/passwd"} {
		if err := Ensure(bad, "1"); err == nil {
			t.Errorf("Ensure(%q) accepted the name", bad)
		}
	}
}

func TestForwarding(t *testing.T) {
	v4, v6 := netip.MustParsePrefix("10.250.0.0/16"), netip.MustParsePrefix("fd00:10::/64")
	for _, tc := range []struct {
		prefixes []netip.Prefix
		want     []string
	}{
		{nil, nil},
		{[]netip.Prefix{v4}, []string{"net.ipv4.ip_forward"}},
		{[]netip.Prefix{v6}, []string{"net.ipv6.conf.all.forwarding"}},
		{[]netip.Prefix{v6, v4}, []string{"net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"}},
	} {
		if got := Forwarding(tc.prefixes); !slices.Equal(got, tc.want) {
			t.Errorf("Forwarding(%v) = %v, want %v", tc.prefixes, got, tc.want)
		}
	}
}
