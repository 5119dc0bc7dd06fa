package netflag

import (
	"flag"
	"testing"
)

func TestFlags(t *testing.T) {
	var p Prefixes
	var a Addrs
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.Var(&p, "cidrs", "")
	fs.Var(&a, "addrs", "")
	if err := fs.Parse([]string{"-cidrs", "10.0.0.0/8, 100.64.0.0/10,,fd00::/8", "-addrs", "fd8f:6d53:b97a:1::1,198.18.0.1"}); err != nil {
		t.Fatal(err)
	}
	if p.String() != "10.0.0.0/8,100.64.0.0/10,fd00::/8" || a.String() != "fd8f:6d53:b97a:1::1,198.18.0.1" {
		t.Fatalf("parsed %s and %s", p.String(), a.String())
	}
	for _, bad := range [][]string{{"-cidrs", "10.0.0.0"}, {"-addrs", "10.0.0.0/8"}, {"-addrs", "host"}} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.Var(new(Prefixes), "cidrs", "")
		fs.Var(new(Addrs), "addrs", "")
		fs.SetOutput(discard{})
		if err := fs.Parse(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
