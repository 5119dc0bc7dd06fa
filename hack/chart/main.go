// Command chart writes the seed chart's Helm OCI artifact (charts.OCIArtifact), the one
// charts/extension.yaml references by digest, as an OCI image layout (make chart runs it):
//
//	go run ./hack/chart --out bin/chart
//
// It writes OUT/oci (the layout, the manifest tagged with the chart's version in index.json) and
// OUT/digest (the manifest's digest), and prints repository:version@digest. It does not push:
// a copy that keeps the manifest's bytes (crane push OUT/oci REPOSITORY:VERSION, oras cp
// --from-oci-layout) serves the artifact under that digest; `helm push` of the chart's archive
// would not (Helm writes its own manifest, with the time of the push in it).
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/tendril-net/tendril/charts"
	"github.com/tendril-net/tendril/hack/image/ociimage"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	var out, repo string
	fs := flag.NewFlagSet("chart", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&out, "out", "bin/chart", "output directory: oci/ (OCI layout), digest")
	fs.StringVar(&repo, "repository", charts.Repository, "the chart's repository, for the printed reference; its tag is the chart's version")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	a, err := charts.OCIArtifact(charts.SeedChart)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := writeLayout(filepath.Join(out, "oci"), a); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "digest"), []byte(a.Digest+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s\n  OCI layout: %s\n", a.Ref(repo), filepath.Join(out, "oci"))
	return nil
}

// writeLayout writes the artifact as the only manifest of a new OCI image layout in dir
// (replacing what was there: appending would leave an older build's manifest in index.json).
func writeLayout(dir string, a *charts.Artifact) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("OCI layout %s: %w", dir, err)
	}
	for _, b := range [][]byte{a.Config, a.Chart, a.Manifest} {
		sum := sha256.Sum256(b)
		if err := p.WriteBlob(v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])}, io.NopCloser(bytes.NewReader(b))); err != nil {
			return fmt.Errorf("OCI layout %s: %w", dir, err)
		}
	}
	digest, err := v1.NewHash(a.Digest)
	if err != nil {
		return err
	}
	if err := p.AppendDescriptor(v1.Descriptor{
		MediaType:   types.OCIManifestSchema1,
		Size:        int64(len(a.Manifest)),
		Digest:      digest,
		Annotations: map[string]string{ociimage.AnnotationRefName: a.Version},
	}); err != nil {
		return fmt.Errorf("OCI layout %s: %w", dir, err)
	}
	return nil
}
