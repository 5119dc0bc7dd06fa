// Package ociimage builds tendril's container image from static binaries without a container
// engine (go-containerregistry assembles it): an empty base, one layer with every binary at
// /<name>, a non-root user, OCI labels. The image is reproducible: the same binaries and Config
// give the same bytes, so the same commit gives the same digest (make image builds the binaries
// with -trimpath and fixed -ldflags, and takes Created from the commit's time).
package ociimage

import (
	"archive/tar"
	"bytes"
	"cmp"
	"compress/gzip"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const (
	// UID and GID run every process of the image: distroless's "nonroot", the user that the
	// extension's tendril-server pods set (runAsUser 65532) and that the chart's pods, which only
	// say runAsNonRoot, get from the image. kubelet accepts runAsNonRoot only for a numeric user.
	UID = 65532
	GID = 65532
	// User is the config's user, numeric for kubelet's runAsNonRoot check.
	User = "65532:65532"

	// The binaries are root's and read-only (r-x for everyone): the processes run as User and
	// cannot replace them even where the root file system is writable (docker run without
	// --read-only); every user can execute them (the egress relay runs as kube-apiserver's user).
	binaryMode = 0o555
	// tmpMode is /tmp's: world-writable with the sticky bit, for os.TempDir where no volume is
	// mounted there (the chart mounts an emptyDir).
	tmpMode = 0o1777

	// DefaultSource is the repository the labels name.
	DefaultSource = "https://github.com/tendril-net/tendril"
)

// Labels the config carries (OCI image spec, annotations.md).
const (
	LabelSource   = "org.opencontainers.image.source"
	LabelRevision = "org.opencontainers.image.revision"
	LabelVersion  = "org.opencontainers.image.version"
	LabelTitle    = "org.opencontainers.image.title"
	// AnnotationRefName names the image in the OCI layout's index.json (its tag).
	AnnotationRefName = "org.opencontainers.image.ref.name"
)

// Config describes the image. The zero value with Binaries set builds an image without an
// entrypoint, labelled version "devel".
type Config struct {
	// Binaries are static Linux executables of one architecture; each lands at /<base name>.
	Binaries []string
	// Entrypoint is the base name of the binary that runs when a pod or `docker run` gives no
	// command; empty: none. The chart and the extension always set command (/tendril-seed,
	// /tendril-server, …).
	Entrypoint string
	// Version and Revision are the labels org.opencontainers.image.version and .revision.
	Version, Revision string
	// Source is the label org.opencontainers.image.source (default DefaultSource).
	Source string
	// Created is every timestamp of the image: the config's, the history's and the mtime of
	// each file (default the Unix epoch). make image passes the commit's time.
	Created time.Time
}

// Build assembles the image; it reads every binary into memory.
func Build(cfg Config) (v1.Image, error) {
	if len(cfg.Binaries) == 0 {
		return nil, errors.New("no binaries")
	}
	created := cfg.Created.UTC().Truncate(time.Second)
	if cfg.Created.IsZero() {
		created = time.Unix(0, 0).UTC()
	}
	version := cfg.Version
	version = cmp.Or(version, "devel")
	source := cfg.Source
	source = cmp.Or(source, DefaultSource)
	files, arch, err := readBinaries(cfg.Binaries)
	if err != nil {
		return nil, err
	}
	if cfg.Entrypoint != "" {
		if _, ok := files[cfg.Entrypoint]; !ok {
			return nil, fmt.Errorf("entrypoint %s is not among the binaries", cfg.Entrypoint)
		}
	}
	layerTar, err := layerTar(files, created)
	if err != nil {
		return nil, err
	}
	// One compression, held in memory: the layer's digest, the OCI layout and the docker
	// tarball all read these bytes (go-containerregistry would compress again for each).
	// compress/gzip writes no time or name into its header, so equal input gives equal bytes.
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.DefaultCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(layerTar); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	compressed := gz.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(compressed)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}

	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.Append(base, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: created},
			CreatedBy: "hack/image: " + strings.Join(slices.Sorted(maps.Keys(files)), " ") + " → /",
		},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture = arch
	cf.OS = "linux"
	cf.Created = v1.Time{Time: created}
	cf.Config = v1.Config{
		User:       User,
		WorkingDir: "/",
		Labels: map[string]string{
			LabelSource:   source,
			LabelRevision: cfg.Revision,
			LabelVersion:  version,
			LabelTitle:    "tendril",
		},
	}
	if cfg.Entrypoint != "" {
		cf.Config.Entrypoint = []string{"/" + cfg.Entrypoint}
	}
	return mutate.ConfigFile(img, cf)
}

// readBinaries reads each binary and checks that it is a static executable for Linux; all must
// share one architecture, which it returns in Go's (and OCI's) spelling.
func readBinaries(paths []string) (map[string][]byte, string, error) {
	files := make(map[string][]byte, len(paths))
	arch := ""
	for _, p := range paths {
		name := filepath.Base(p)
		if _, dup := files[name]; dup {
			return nil, "", fmt.Errorf("%s: two binaries named %s", p, name)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, "", err
		}
		a, err := staticArch(b)
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", p, err)
		}
		if arch != "" && a != arch {
			return nil, "", fmt.Errorf("%s: architecture %s, the others are %s (one image per architecture)", p, a, arch)
		}
		arch = a
		files[name] = b
	}
	return files, arch, nil
}

// archs maps ELF machines to GOARCH for the architectures a seed or shoot node runs.
var archs = map[elf.Machine]string{
	elf.EM_X86_64:  "amd64",
	elf.EM_AARCH64: "arm64",
	elf.EM_PPC64:   "ppc64le",
	elf.EM_S390:    "s390x",
}

// staticArch returns the architecture of a static ELF executable. An empty base image has no
// dynamic loader and no libc: a binary that needs them (built with cgo) would fail to start.
func staticArch(b []byte) (string, error) {
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return "", fmt.Errorf("not an ELF executable: %w", err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return "", errors.New("dynamically linked (needs a loader and libc the empty base image lacks; build with CGO_ENABLED=0)")
		}
	}
	// ET_DYN without an interpreter is a static PIE (go build -buildmode=pie, internal linking).
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return "", fmt.Errorf("ELF type %s, want an executable", f.Type)
	}
	a, ok := archs[f.Machine]
	if !ok {
		return "", fmt.Errorf("ELF machine %s is not a supported architecture", f.Machine)
	}
	return a, nil
}

// layerTar writes the layer: /tmp, then the binaries, in name order, every header fixed
// (mtime, owner, mode, format) so that the same files give the same bytes.
func layerTar(files map[string][]byte, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(h tar.Header) *tar.Header {
		h.ModTime = mtime
		h.Format = tar.FormatUSTAR // no PAX records: nothing here needs them
		return &h
	}
	if err := tw.WriteHeader(hdr(tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: tmpMode})); err != nil {
		return nil, err
	}
	for _, name := range slices.Sorted(maps.Keys(files)) {
		b := files[name]
		if err := tw.WriteHeader(hdr(tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: binaryMode, Size: int64(len(b))})); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
