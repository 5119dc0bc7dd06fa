package main

import (
	"errors"
	"io"
	"slices"
	"testing"
	"time"
)

func TestParseSNI(t *testing.T) {
	c, err := parseSNI([]string{"--duration", "3s", "--concurrency", "1,8", "--targets", "direct,nginx",
		"--bytes", "8MiB", "--json", "--markdown", "out.md"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.Config
	if cfg.Duration != 3*time.Second || !slices.Equal(cfg.Concurrency, []int{1, 8}) ||
		!slices.Equal(cfg.Targets, []string{"direct", "nginx"}) || cfg.BulkBytes != 8<<20 ||
		!c.JSON || c.Markdown != "out.md" || cfg.Shoots != 4 || cfg.BulkConns != 4 || cfg.BinDir != "bin" {
		t.Errorf("parsed %+v", c)
	}
	for _, bad := range [][]string{{"--concurrency", "1,x"}, {"--bytes", "-1"}, {"extra"}} {
		if _, err := parseSNI(bad, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("parseSNI(%q) = %v, want a usage error", bad, err)
		}
	}
}

func TestByteSize(t *testing.T) {
	for in, want := range map[string]int64{"64MiB": 64 << 20, "1GiB": 1 << 30, "10MB": 10e6, "4096": 4096, "3 KiB": 3072} {
		var b byteSize
		if err := b.Set(in); err != nil || int64(b) != want {
			t.Errorf("Set(%q) = %d, %v; want %d", in, b, err, want)
		}
	}
}

func TestCommandLine(t *testing.T) {
	got := commandLine([]string{"bin/tendril-bench", "sni", "--markdown", "my report.md"})
	if want := "bin/tendril-bench sni --markdown 'my report.md'"; got != want {
		t.Errorf("commandLine = %s, want %s", got, want)
	}
}

func TestUnknownMode(t *testing.T) {
	if err := run(t.Context(), []string{"tendril-bench", "tunnel"}, io.Discard, io.Discard); !errors.Is(err, errUsage) {
		t.Errorf("run(tunnel) = %v, want a usage error", err)
	}
}
