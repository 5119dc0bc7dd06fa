package main

import (
	"errors"
	"io"
	"slices"
	"testing"

	"github.com/tendril-net/tendril/bench/failover"
)

func TestParseFailover(t *testing.T) {
	def, err := parseFailover(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(def.Config.Kinds, failover.Kinds) || def.Config.Repetitions != 10 || def.Config.BinDir != binDir() {
		t.Errorf("defaults %+v", def.Config)
	}
	c, err := parseFailover([]string{"--kinds", "agent,openvpn", "--repetitions", "3", "--markdown-append", "all.md"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Config.Kinds, []string{"agent", "openvpn"}) || c.Config.Repetitions != 3 || c.MarkdownAppend != "all.md" {
		t.Errorf("parsed %+v", c)
	}
	for _, bad := range [][]string{{"--repetitions", "0"}, {"--repetitions", "101"}, {"--kinds", "agent,leader"}, {"extra"}} {
		if _, err := parseFailover(bad, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v, want a usage error", bad, err)
		}
	}
}
