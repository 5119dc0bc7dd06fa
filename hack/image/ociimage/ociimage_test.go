package ociimage

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

// tinyBinary builds a small static program for linux/goarch into dir/name: without fmt and
// symbols, about 1 MB, as every test builds images of it several times (compress/flate under the
// race detector takes seconds per megabyte).
func tinyBinary(dir, name, goarch string) (string, error) {
	src := filepath.Join(dir, name+".go")
	if err := os.WriteFile(src, []byte("package main\n\nimport \"os\"\n\nfunc main() { os.Stdout.WriteString(\""+name+"\\n\") }\n"), 0o644); err != nil {
		return "", err
	}
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, src)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+goarch, "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %w\n%s", err, b)
	}
	return out, nil
}

// binaries are two static amd64 programs, built once for the package's tests.
var binaries []string

func TestMain(m *testing.M) {
	os.Exit(func() int {
		dir, err := os.MkdirTemp("", "ociimage")
		if err != nil {
			panic(err)
		}
		defer os.RemoveAll(dir)
		for _, name := range []string{"tendril-seed", "tendril-agent"} {
			p, err := tinyBinary(dir, name, "amd64")
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			binaries = append(binaries, p)
		}
		return m.Run()
	}())
}

func config() Config {
	return Config{
		Binaries:   binaries,
		Entrypoint: "tendril-seed",
		Version:    "v9.8.7",
		Revision:   "0123456789abcdef0123456789abcdef01234567",
		Created:    time.Unix(1795719830, 0),
	}
}

func digest(t *testing.T, img v1.Image) v1.Hash {
	t.Helper()
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestBuildConfig(t *testing.T) {
	img, err := Build(config())
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIManifestSchema1 || m.Config.MediaType != types.OCIConfigJSON ||
		len(m.Layers) != 1 || m.Layers[0].MediaType != types.OCILayer {
		t.Errorf("manifest %+v: want an OCI manifest with an OCI config and one gzip layer", m)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	created := time.Unix(1795719830, 0).UTC()
	if cf.Architecture != "amd64" || cf.OS != "linux" || !cf.Created.Time.Equal(created) {
		t.Errorf("platform %s/%s created %v", cf.OS, cf.Architecture, cf.Created)
	}
	c := cf.Config
	if c.User != "65532:65532" || strings.Join(c.Entrypoint, " ") != "/tendril-seed" || len(c.Cmd) != 0 || c.WorkingDir != "/" {
		t.Errorf("user %q entrypoint %q cmd %q workdir %q", c.User, c.Entrypoint, c.Cmd, c.WorkingDir)
	}
	want := map[string]string{
		LabelSource:   DefaultSource,
		LabelRevision: "0123456789abcdef0123456789abcdef01234567",
		LabelVersion:  "v9.8.7",
		LabelTitle:    "tendril",
	}
	if got, _ := json.Marshal(c.Labels); string(got) != string(must(json.Marshal(want))) {
		t.Errorf("labels %s, want %s", got, must(json.Marshal(want)))
	}
	if len(cf.History) != 1 || !cf.History[0].Created.Time.Equal(created) || len(cf.RootFS.DiffIDs) != 1 {
		t.Errorf("history %+v rootfs %+v", cf.History, cf.RootFS)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestLayer: /tmp and the binaries, in name order, root's, read-only, stamped with Created.
func TestLayer(t *testing.T) {
	img, err := Build(config())
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if h.Uid != 0 || h.Gid != 0 || h.Uname != "" || h.Gname != "" || h.ModTime.Unix() != 1795719830 || h.Format != tar.FormatUSTAR {
			t.Errorf("%s: owner %d:%d %q:%q mtime %v format %v", h.Name, h.Uid, h.Gid, h.Uname, h.Gname, h.ModTime, h.Format)
		}
		switch h.Name {
		case "tmp/":
			if h.Typeflag != tar.TypeDir || h.Mode != 0o1777 {
				t.Errorf("tmp/: type %c mode %o", h.Typeflag, h.Mode)
			}
		default:
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			src, err := os.ReadFile(filepath.Join(filepath.Dir(binaries[0]), h.Name))
			if err != nil {
				t.Fatal(err)
			}
			if h.Typeflag != tar.TypeReg || h.Mode != 0o555 || !bytes.Equal(b, src) {
				t.Errorf("%s: type %c mode %o, %d bytes (source %d)", h.Name, h.Typeflag, h.Mode, len(b), len(src))
			}
		}
	}
	if strings.Join(names, " ") != "tmp/ tendril-agent tendril-seed" {
		t.Errorf("layer holds %q", names)
	}
}

// TestReproducible: the same input gives the same digest; each input that the image records
// changes it.
func TestReproducible(t *testing.T) {
	a, err := Build(config())
	if err != nil {
		t.Fatal(err)
	}
	// The binaries in the other order, from a copy with other file times.
	dir := t.TempDir()
	var copies []string
	for i := len(binaries) - 1; i >= 0; i-- {
		b, err := os.ReadFile(binaries[i])
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.Base(binaries[i]))
		if err := os.WriteFile(p, b, 0o700); err != nil {
			t.Fatal(err)
		}
		copies = append(copies, p)
	}
	cfg := config()
	cfg.Binaries = copies
	b, err := Build(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if digest(t, a) != digest(t, b) {
		t.Fatalf("the same binaries gave %s and %s", digest(t, a), digest(t, b))
	}
	for name, change := range map[string]func(*Config){
		"revision":   func(c *Config) { c.Revision = "fedcba9876543210fedcba9876543210fedcba98" },
		"version":    func(c *Config) { c.Version = "v9.8.8" },
		"created":    func(c *Config) { c.Created = c.Created.Add(time.Second) },
		"entrypoint": func(c *Config) { c.Entrypoint = "tendril-agent" },
		"binaries":   func(c *Config) { c.Binaries = c.Binaries[:1] },
	} {
		cfg := config()
		change(&cfg)
		c, err := Build(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if digest(t, c) == digest(t, a) {
			t.Errorf("a different %s gave the same digest", name)
		}
	}
}

func TestBuildRefuses(t *testing.T) {
	dir := t.TempDir()
	text := filepath.Join(dir, "script")
	if err := os.WriteFile(text, []byte("#!/bin/sh\necho hi\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// An amd64 binary whose header says arm64 (e_machine, 2 bytes at offset 18): cross-compiling
	// would cost a build of the standard library for arm64.
	b, err := os.ReadFile(binaries[0])
	if err != nil {
		t.Fatal(err)
	}
	binary.LittleEndian.PutUint16(b[18:], uint16(elf.EM_AARCH64))
	arm := filepath.Join(dir, "tendril-arm")
	if err := os.WriteFile(arm, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cases := map[string]struct {
		cfg  Config
		want string
	}{
		"nothing":         {Config{}, "no binaries"},
		"missing":         {Config{Binaries: []string{filepath.Join(dir, "absent")}}, "no such file"},
		"not ELF":         {Config{Binaries: []string{text}}, "not an ELF executable"},
		"two names":       {Config{Binaries: []string{binaries[0], binaries[0]}}, "two binaries named tendril-seed"},
		"mixed arch":      {Config{Binaries: []string{binaries[0], arm}}, "architecture arm64, the others are amd64"},
		"bad entrypoint":  {Config{Binaries: binaries, Entrypoint: "tendril-server"}, "entrypoint tendril-server is not among"},
		"directory given": {Config{Binaries: []string{dir}}, "is a directory"},
	}
	// A dynamically linked executable from the system, where there is one.
	for _, p := range []string{"/bin/true", "/usr/bin/true"} {
		if b, err := os.ReadFile(p); err == nil && bytes.HasPrefix(b, []byte("\x7fELF")) {
			cases["dynamic"] = struct {
				cfg  Config
				want string
			}{Config{Binaries: []string{p}}, "dynamically linked"}
			break
		}
	}
	for name, c := range cases {
		if _, err := Build(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want %q", name, err, c.want)
		}
	}
	// One architecture alone is fine: the config says arm64.
	img, err := Build(Config{Binaries: []string{arm}})
	if err != nil {
		t.Fatal(err)
	}
	if cf, err := img.ConfigFile(); err != nil || cf.Architecture != "arm64" || cf.Config.Entrypoint != nil || cf.Config.Labels[LabelVersion] != "devel" {
		t.Errorf("arm64 image: %+v, %v", cf, err)
	}
}

// TestWrite: the OCI layout and the docker tarball hold the built image, byte for byte, and
// writing twice gives the same files.
func TestWrite(t *testing.T) {
	img, err := Build(config())
	if err != nil {
		t.Fatal(err)
	}
	want := digest(t, img)
	var tarballs [][]byte
	for _, dir := range []string{t.TempDir(), t.TempDir()} {
		oci := filepath.Join(dir, "oci")
		if err := os.MkdirAll(filepath.Join(oci, "stale"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := WriteLayout(oci, img, "v9.8.7"); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(oci, "stale")); !os.IsNotExist(err) {
			t.Errorf("WriteLayout left what was in %s: %v", oci, err)
		}
		idx, err := layout.ImageIndexFromPath(oci)
		if err != nil {
			t.Fatal(err)
		}
		// go-containerregistry's check of what was written: every digest, size and diff_id agrees.
		written, err := idx.Image(want)
		if err != nil {
			t.Fatal(err)
		}
		if err := validate.Image(written); err != nil {
			t.Fatal(err)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		if len(im.Manifests) != 1 || im.Manifests[0].Digest != want || im.Manifests[0].Annotations[AnnotationRefName] != "v9.8.7" ||
			im.Manifests[0].Platform == nil || im.Manifests[0].Platform.Architecture != "amd64" {
			t.Errorf("index.json %+v, want one manifest %s tagged v9.8.7 for amd64", im.Manifests, want)
		}
		path := filepath.Join(dir, "tendril.tar")
		if err := WriteTarball(path, img, "ghcr.io/tendril-net/tendril:v9.8.7"); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		tarballs = append(tarballs, b)
		loaded, err := tarball.ImageFromPath(path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := must(loaded.ConfigName()), must(img.ConfigName()); got != want {
			t.Errorf("tarball config %s, image's %s", got, want)
		}
		if got, want := must(must(loaded.Layers())[0].Digest()), must(must(img.Layers())[0].Digest()); got != want {
			t.Errorf("tarball layer %s, image's %s", got, want)
		}
		m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(path) })
		if err != nil {
			t.Fatal(err)
		}
		if len(m) != 1 || strings.Join(m[0].RepoTags, " ") != "ghcr.io/tendril-net/tendril:v9.8.7" {
			t.Errorf("manifest.json %+v", m)
		}
	}
	if !bytes.Equal(tarballs[0], tarballs[1]) {
		t.Error("two tarballs of one image differ")
	}
	if err := WriteTarball(filepath.Join(t.TempDir(), "x.tar"), img, "not a reference"); err == nil {
		t.Error("a bad reference was accepted")
	}
}
