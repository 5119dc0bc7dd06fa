package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSourceRevision: the revision follows what the binary is built from (a Go file, an embedded
// file, go.mod) and nothing else (a test, a document, the commit), in a module of its own.
func TestSourceRevision(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.com/m\n\ngo 1.26\n")
	write("go.sum", "")
	write("cmd/a/main.go", "package main\n\nimport \"example.com/m/lib\"\n\nfunc main() { println(lib.Greeting) }\n")
	write("lib/lib.go", "package lib\n\nimport _ \"embed\"\n\n//go:embed greeting.txt\nvar Greeting string\n")
	write("lib/greeting.txt", "hello\n")
	write("lib/lib_test.go", "package lib\n")
	write("README.md", "# m\n")
	rev := func() string {
		t.Helper()
		r, err := sourceRevision(dir, []string{"./cmd/a"})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(r, revisionPrefix) || len(r) != len(revisionPrefix)+40 {
			t.Fatalf("revision %q: want %s and 40 hex digits", r, revisionPrefix)
		}
		return r
	}
	first := rev()
	if again := rev(); again != first {
		t.Fatalf("the same tree gave %s, then %s", first, again)
	}
	for _, c := range []struct {
		file, content string
		changes       bool
	}{
		{"README.md", "# m, documented\n", false},
		{"lib/lib_test.go", "package lib\n\n// a test changes no binary\n", false},
		{"lib/greeting.txt", "hello, world\n", true},
		{"lib/lib.go", "package lib\n\nimport _ \"embed\"\n\n// Greeting is embedded.\n//\n//go:embed greeting.txt\nvar Greeting string\n", true},
		{"go.mod", "module example.com/m\n\ngo 1.26.0\n", true},
	} {
		before := rev()
		write(c.file, c.content)
		if after := rev(); (after != before) != c.changes {
			t.Errorf("%s changed: revision %s → %s, want changed=%v", c.file, before, after, c.changes)
		}
	}
	if _, err := sourceRevision(dir, nil); err == nil {
		t.Error("no packages: no error")
	}
	if _, err := sourceRevision(dir, []string{"./absent"}); err == nil {
		t.Error("a package that does not exist: no error")
	}
}
