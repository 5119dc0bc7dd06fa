package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// revisionPrefix marks a source revision, so that nobody reads it as a commit.
const revisionPrefix = "src-"

// sourceRevision is the revision the image's binaries print with --version and its labels carry:
// a digest of what the packages pkgs are built from, not the commit. The chart pins the image by
// digest; with the commit inside the image, the commit that writes the pin would change the digest
// it pins. What goes in: every Go and embedded file of this module that the packages compile
// (as CGO_ENABLED=0 builds them), go.mod and go.sum (every dependency's version and sum), the Go
// version. The same tree gives the same revision in any checkout and at any time; a change to
// docs, charts or tests gives the same one too, since it changes no binary.
// dir is the directory the packages are listed from ("": the working directory).
func sourceRevision(dir string, pkgs []string) (string, error) {
	if len(pkgs) == 0 {
		return "", errors.New("revision: no packages given")
	}
	goCmd := func(args ...string) ([]byte, error) {
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
		}
		return out, nil
	}
	root, err := goCmd("list", "-m", "-f", "{{.Dir}}")
	if err != nil {
		return "", err
	}
	modRoot := strings.TrimSpace(string(root))
	goVersion, err := goCmd("env", "GOVERSION")
	if err != nil {
		return "", err
	}
	// One line per package of the main module: its directory, then its files.
	const format = `{{if .Module}}{{if .Module.Main}}{{.Dir}}{{range .GoFiles}} {{.}}{{end}}{{range .EmbedFiles}} {{.}}{{end}}{{"\n"}}{{end}}{{end}}`
	list, err := goCmd(append([]string{"list", "-deps", "-f", format}, pkgs...)...)
	if err != nil {
		return "", err
	}
	files := []string{"go.mod", "go.sum"}
	for line := range strings.SplitSeq(strings.TrimSpace(string(list)), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		dir, err := filepath.Rel(modRoot, fields[0])
		if err != nil {
			return "", err
		}
		for _, f := range fields[1:] {
			files = append(files, filepath.ToSlash(filepath.Join(dir, f)))
		}
	}
	slices.Sort(files)
	files = slices.Compact(files)
	h := sha256.New()
	fmt.Fprintf(h, "%s\n", strings.TrimSpace(string(goVersion)))
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(modRoot, filepath.FromSlash(f)))
		if err != nil {
			return "", fmt.Errorf("revision: %w", err)
		}
		// Name and length first: no two trees hash the same bytes.
		fmt.Fprintf(h, "%s %d\n", f, len(b))
		h.Write(b)
	}
	// 160 bits, as many as a Git commit name carries.
	return revisionPrefix + hex.EncodeToString(h.Sum(nil)[:20]), nil
}
