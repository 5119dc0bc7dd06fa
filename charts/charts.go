// Package charts embeds tendril's Helm charts: tendril-seed, the seed-level deployment of the
// extension (tendril-seed and the shared ingress with tendril-ingress or Envoy), which gardenlet
// installs from a ControllerDeployment. It packs the chart as the Helm OCI artifact that
// extension.yaml references by digest (OCIArtifact); it does not push it anywhere (hack/chart
// writes it as an OCI layout, realseed pushes it to its registry). Per-shoot objects are not
// charts: extension/manifest builds them.
package charts

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"embed"
	"fmt"
	"io/fs"
	"path"
)

// SeedChart is the directory of the tendril-seed chart in FS.
const SeedChart = "tendril-seed"

// FS holds the charts' files ("all:" keeps templates/_helpers.tpl, which a plain pattern skips).
//
//go:embed all:tendril-seed
var FS embed.FS

// Archive packs the chart in dir of FS as Helm does (a gzip'ed tar whose entries sit under the
// chart's directory): the layer of the chart's OCI artifact. The archive depends only on the
// files (and the Go release's compress/flate): entries are in lexical order with zero times and
// fixed modes.
func Archive(dir string) ([]byte, error) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	err := fs.WalkDir(FS, dir, func(name string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := FS.ReadFile(name)
		if err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Name: path.Clean(name), Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err = tw.Write(b)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("archive chart %s: %w", dir, err)
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("archive chart %s: %w", dir, err)
	}
	if err := zw.Close(); err != nil {
		return nil, fmt.Errorf("archive chart %s: %w", dir, err)
	}
	return buf.Bytes(), nil
}
