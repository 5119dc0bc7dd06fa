package main

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/tendril-net/tendril/bench/harness"
	"github.com/tendril-net/tendril/bench/incluster"
	"github.com/tendril-net/tendril/bench/sni"
)

func TestParseSNI(t *testing.T) {
	c, err := parseCommand(sni.Mode, []string{"--duration", "3s", "--concurrency", "1,8", "--targets", "direct,nginx",
		"--bytes", "8MiB", "--json", "--markdown", "out.md"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.Config
	if cfg.Duration != 3*time.Second || !slices.Equal(cfg.Concurrency, []int{1, 8}) ||
		!slices.Equal(cfg.Targets, []string{"direct", "nginx"}) || cfg.BulkBytes != 8<<20 ||
		!c.JSON || c.Markdown != "out.md" || cfg.Shoots != 4 || cfg.BulkConns != 4 || cfg.BinDir != binDir() {
		t.Errorf("parsed %+v", c)
	}
	for _, bad := range [][]string{{"--concurrency", "1,x"}, {"--bytes", "-1"}, {"extra"}} {
		if _, err := parseCommand(sni.Mode, bad, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("parseCommand(sni, %q) = %v, want a usage error", bad, err)
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
	if err := run(t.Context(), []string{"tendril-bench", "bogus"}, io.Discard, io.Discard); !errors.Is(err, errUsage) {
		t.Errorf("run(bogus) = %v, want a usage error", err)
	}
}

func TestParseModes(t *testing.T) {
	for _, mode := range []harness.Mode{sni.Mode, incluster.Proxy, incluster.Connect} {
		name := mode.Name
		r, err := parsers[name]([]string{"--markdown-append", "all.md", "--targets", "direct,tendril"}, io.Discard)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		c, ok := r.(*command)
		if !ok {
			t.Fatalf("%s: parsed as %T, want the harness's command", name, r)
		}
		if c.Mode.Name != name || c.MarkdownAppend != "all.md" || !slices.Equal(c.Config.Targets, []string{"direct", "tendril"}) {
			t.Errorf("%s: parsed %+v", name, c)
		}
		def, err := parseCommand(mode, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(def.Config.Targets, mode.Targets) {
			t.Errorf("%s: default targets %v, want %v", name, def.Config.Targets, mode.Targets)
		}
	}
	if _, err := parseCommand(incluster.Proxy, []string{"--markdown", "x.md", "--markdown-append", "x.md"}, io.Discard); !errors.Is(err, errUsage) {
		t.Errorf("same file for --markdown and --markdown-append: %v, want a usage error", err)
	}
}

func TestMarkdownAppend(t *testing.T) {
	path := filepath.Join(t.TempDir(), "benchmarks.md")
	section := func(s string) func(io.Writer) error {
		return func(w io.Writer) error { _, err := io.WriteString(w, s); return err }
	}
	if err := writeFile(path, true, section("# sni\n")); err != nil { // created by appending
		t.Fatal(err)
	}
	if err := writeFile(path, true, section("# proxy\n")); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := "# sni\n\n---\n\n# proxy\n"; string(b) != want {
		t.Errorf("appended file %q, want %q", b, want)
	}
	if err := writeFile(path, false, section("# connect\n")); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); string(b) != "# connect\n" {
		t.Errorf("replaced file %q", b)
	}
}

func TestParseIdle(t *testing.T) {
	c, err := parseIdle([]string{"--conns", "500", "--listeners", "sni", "--targets", "tendril,haproxy", "--hold", "2s", "--markdown", "idle.md"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Config.Conns != 500 || !slices.Equal(c.Config.Listeners, []string{"sni"}) || !slices.Equal(c.Config.Targets, []string{"tendril", "haproxy"}) ||
		c.Config.Hold != 2*time.Second || c.Markdown != "idle.md" {
		t.Errorf("parsed %+v", c)
	}
	def, err := parseIdle(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	// N 0 is idle's default: sized to the descriptor limit at run time.
	if def.Config.Conns != 0 || def.Config.Release != 30*time.Second || len(def.Config.Listeners) != 2 || len(def.Config.Targets) != 3 {
		t.Errorf("defaults %+v", def.Config)
	}
	for _, bad := range [][]string{{"--conns", "-1"}, {"--hold", "0s"}, {"--parallel", "0"}, {"extra"}} {
		if _, err := parseIdle(bad, io.Discard); !errors.Is(err, errUsage) {
			t.Errorf("parseIdle(%q) = %v, want a usage error", bad, err)
		}
	}
}
