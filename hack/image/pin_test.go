package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestChartPinsTheImage builds the image as make image does, in this tree, and fails unless the
// chart's imageDigest is its digest: what the chart installs is what this commit builds. The
// revision the binaries carry is their sources' (revision.go), and the image's time is fixed, so
// the digest is the same in every checkout of the commit (CI's clean clone checks the pin written
// in another).
func TestChartPinsTheImage(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	values, err := os.ReadFile(filepath.Join(root, "charts", "tendril-seed", "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^imageDigest: (sha256:[0-9a-f]{64})$`).FindSubmatch(values)
	if m == nil {
		t.Fatal("charts/tendril-seed/values.yaml pins no imageDigest")
	}
	pinned := string(m[1])

	tmp := t.TempDir()
	out := filepath.Join(tmp, "image")
	cmd := exec.Command("make", "--no-print-directory", "image", "BIN="+filepath.Join(tmp, "bin"), "IMAGE_OUT="+out)
	cmd.Dir = root
	// Not the make test that runs this test: its jobserver and variables are not this make's.
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
		for _, k := range []string{"MAKEFLAGS=", "MAKELEVEL=", "MFLAGS=", "REVISION=", "SOURCE_DATE_EPOCH=", "VERSION="} {
			if strings.HasPrefix(kv, k) {
				return true
			}
		}
		return false
	})
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make image: %v\n%s", err, b)
	}
	d, err := os.ReadFile(filepath.Join(out, "digest"))
	if err != nil {
		t.Fatal(err)
	}
	if built := strings.TrimSpace(string(d)); built != pinned {
		t.Errorf("charts/tendril-seed/values.yaml pins %s, make image builds %s from this tree: run make image-pin and commit what it changes", pinned, built)
	}
}
