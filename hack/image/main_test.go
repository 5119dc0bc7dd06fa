package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/tendril-net/tendril/internal/testing/testoci"
)

const (
	version  = "v0.0.0-test"
	revision = "0123456789abcdef0123456789abcdef01234567"
	epoch    = "1795719830"
)

// imaged are the binaries TestImage puts in its image: the shoot's two, the smallest. Each
// megabyte costs seconds under the race detector (make test), which instruments compress/flate.
var imaged = []string{"tendril-agent", "tendril-egress-relay"}

// TestImage builds every binary as make build does and checks its --version, makes an image of
// some of them twice with this command, built as make image runs it, then reads the OCI layout
// by the spec's rules alone (not through go-containerregistry), unpacks the layer and runs each
// binary from it with --version, as the image's user.
func TestImage(t *testing.T) {
	bin := t.TempDir()
	// GO_BUILD_FLAGS of the Makefile. After make build (make test runs it first) only the
	// linker has work left.
	const pkg = "github.com/tendril-net/tendril/internal/proc/buildinfo"
	build := exec.Command("go", "build", "-trimpath", "-buildvcs=false",
		"-ldflags", "-X "+pkg+".Version="+version+" -X "+pkg+".Revision="+revision,
		"-o", bin+"/", "../../cmd/...")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	cmds, err := os.ReadDir("../../cmd")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cmds {
		checkVersion(t, exec.Command(filepath.Join(bin, c.Name()), "--version"), c.Name())
	}
	var binaries []string
	for _, name := range imaged {
		binaries = append(binaries, filepath.Join(bin, name))
	}
	// The command as make image runs it (go run: not under the race detector).
	tool := filepath.Join(t.TempDir(), "image")
	if b, err := exec.Command("go", "build", "-o", tool, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}

	var digests []string
	var tarballs [][]byte
	outs := []string{t.TempDir(), t.TempDir()}
	for _, out := range outs {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(tool, append([]string{"--out", out, "--version", version, "--revision", revision,
			"--source-date-epoch", epoch, "--entrypoint", "tendril-agent"}, binaries...)...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%v\n%s", err, stderr.String())
		}
		d, err := os.ReadFile(filepath.Join(out, "digest"))
		if err != nil {
			t.Fatal(err)
		}
		digest := strings.TrimSpace(string(d))
		if !strings.HasPrefix(stdout.String(), "ghcr.io/tendril-net/tendril:"+version+"@"+digest+"\n") {
			t.Errorf("printed %q, digest file %s", stdout.String(), digest)
		}
		digests = append(digests, digest)
		tb, err := os.ReadFile(filepath.Join(out, "tendril.tar"))
		if err != nil {
			t.Fatal(err)
		}
		tarballs = append(tarballs, tb)
	}
	if digests[0] != digests[1] || !bytes.Equal(tarballs[0], tarballs[1]) {
		t.Fatalf("two builds: digests %s and %s, tarballs equal: %v", digests[0], digests[1], bytes.Equal(tarballs[0], tarballs[1]))
	}
	t.Logf("digest %s (twice)", digests[0])

	layoutDir := filepath.Join(outs[0], "oci")

	// The layout: oci-layout, index.json naming the manifest, blobs addressed by their sha256.
	manifest := testoci.ReadLayout(t, layoutDir, digests[0], version)
	if manifest.Config.MediaType != "application/vnd.oci.image.config.v1+json" || len(manifest.Layers) != 1 ||
		manifest.Layers[0].MediaType != "application/vnd.oci.image.layer.v1.tar+gzip" {
		t.Fatalf("manifest %+v", manifest)
	}
	var config struct {
		Architecture string `json:"architecture"`
		OS           string `json:"os"`
		Created      string `json:"created"`
		Config       struct {
			User       string
			Entrypoint []string
			Cmd        []string
			Labels     map[string]string
		} `json:"config"`
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(testoci.Blob(t, layoutDir, manifest.Config), &config); err != nil {
		t.Fatal(err)
	}
	c := config.Config
	if config.Architecture != runtime.GOARCH || config.OS != "linux" || config.Created != "2026-11-26T19:03:50Z" {
		t.Errorf("config: %s/%s created %s", config.OS, config.Architecture, config.Created)
	}
	if c.User != "65532:65532" || strings.Join(c.Entrypoint, " ") != "/tendril-agent" || c.Cmd != nil {
		t.Errorf("config: user %q entrypoint %q cmd %q", c.User, c.Entrypoint, c.Cmd)
	}
	for k, v := range map[string]string{
		"org.opencontainers.image.source":   "https://github.com/tendril-net/tendril",
		"org.opencontainers.image.revision": revision,
		"org.opencontainers.image.version":  version,
	} {
		if c.Labels[k] != v {
			t.Errorf("label %s=%q, want %q", k, c.Labels[k], v)
		}
	}

	// Unpack the layer as a container runtime would, checking its diff_id on the way.
	root := t.TempDir()
	zr, err := gzip.NewReader(bytes.NewReader(testoci.Blob(t, layoutDir, manifest.Layers[0])))
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	tr := tar.NewReader(io.TeeReader(zr, h))
	var entries []string
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		entries = append(entries, hdr.Name)
		p := filepath.Join(root, hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.Mkdir(p, os.FileMode(hdr.Mode&0o777)|os.ModeSticky); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, b, os.FileMode(hdr.Mode)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := io.Copy(h, zr); err != nil { // the tar's zero blocks after the last entry
		t.Fatal(err)
	}
	if diffID := "sha256:" + hex.EncodeToString(h.Sum(nil)); len(config.RootFS.DiffIDs) != 1 || config.RootFS.DiffIDs[0] != diffID {
		t.Errorf("diff_ids %q, the layer's is %s", config.RootFS.DiffIDs, diffID)
	}
	if want := "tmp/ " + strings.Join(imaged, " "); strings.Join(entries, " ") != want {
		t.Errorf("layer holds %q, want %s", entries, want)
	}

	// Run each as the image's user where the test can switch to it.
	if os.Geteuid() == 0 {
		// t.TempDir's directories are root's 0700; the user must reach the binaries.
		for d := root; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, name := range imaged {
		cmd := exec.Command(filepath.Join(root, name), "--version")
		if os.Geteuid() == 0 {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65532, Gid: 65532}}
		}
		checkVersion(t, cmd, name)
	}
}

// checkVersion runs a binary's --version: it names the binary, the version and the revision.
func checkVersion(t *testing.T, cmd *exec.Cmd, name string) {
	t.Helper()
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("%s --version: %v\n%s", name, err, b)
		return
	}
	if want := name + " " + version + " (revision " + revision + ", go"; !strings.HasPrefix(string(b), want) {
		t.Errorf("%s --version printed %q, want %q…", name, b, want)
	}
}

// TestRunRefuses: missing inputs are usage errors, not an image with empty labels or the time
// of the build.
func TestRunRefuses(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--version", "v1", "--revision", "r", "--source-date-epoch", "1"}, "no binaries"},
		{[]string{"--revision", "r", "--source-date-epoch", "1", "x"}, "--version and --revision are required"},
		{[]string{"--version", "v1", "--revision", "r", "x"}, "--source-date-epoch"},
		{[]string{"--version", "v1", "--revision", "r", "--source-date-epoch", "yesterday", "x"}, "want seconds since 1970"},
		{[]string{"--version", "v1", "--revision", "r", "--source-date-epoch", "1", filepath.Join(t.TempDir(), "absent")}, "no such file"},
	} {
		err := run(append([]string{"--out", t.TempDir()}, c.args...), io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want %q", c.args, err, c.want)
		}
	}
}
