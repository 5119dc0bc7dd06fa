package charts

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"sigs.k8s.io/yaml"
)

// The media types of a Helm chart as an OCI artifact (helm.sh/docs/topics/registries): what
// Helm pushes and what Gardener's HelmRegistry looks for among the layers.
const (
	HelmConfigMediaType = "application/vnd.cncf.helm.config.v1+json"
	HelmChartMediaType  = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
)

// Repository is where tendril's seed chart is released; extension.yaml names it.
const Repository = "ghcr.io/tendril-net/charts/" + SeedChart

// Artifact is a chart as a Helm OCI artifact: an OCI image manifest whose config is the
// chart's Chart.yaml as JSON and whose one layer is the chart's archive.
type Artifact struct {
	// Name and Version are the chart's, from Chart.yaml; the version is the artifact's tag.
	Name, Version string
	// Config, Chart and Manifest are the blobs as a registry stores them.
	Config, Chart, Manifest []byte
	// Digest is the manifest's, "sha256:<hex>": what a reference by digest names.
	Digest string
}

// OCIArtifact packs the chart in dir of FS as a Helm OCI artifact. Like Archive it depends only
// on the chart's files: no annotation carries a time (Helm's own push adds
// org.opencontainers.image.created, so `helm push` of the same archive gives another digest),
// so the digest that extension.yaml pins is the digest of the artifact built from this tree.
func OCIArtifact(dir string) (*Artifact, error) {
	meta, err := FS.ReadFile(dir + "/Chart.yaml")
	if err != nil {
		return nil, fmt.Errorf("chart %s: %w", dir, err)
	}
	a := &Artifact{}
	if a.Config, err = yaml.YAMLToJSON(meta); err != nil {
		return nil, fmt.Errorf("chart %s: Chart.yaml: %w", dir, err)
	}
	var chart struct {
		Name    string `json:"name"`
		Version string `json:"version"`
	}
	if err := json.Unmarshal(a.Config, &chart); err != nil {
		return nil, fmt.Errorf("chart %s: Chart.yaml: %w", dir, err)
	}
	if chart.Name == "" || chart.Version == "" {
		return nil, fmt.Errorf("chart %s: Chart.yaml names no name or version", dir)
	}
	a.Name, a.Version = chart.Name, chart.Version
	if a.Chart, err = Archive(dir); err != nil {
		return nil, err
	}
	a.Manifest, err = json.Marshal(v1.Manifest{
		SchemaVersion: 2,
		MediaType:     types.OCIManifestSchema1,
		Config:        descriptor(a.Config, HelmConfigMediaType),
		Layers:        []v1.Descriptor{descriptor(a.Chart, HelmChartMediaType)},
	})
	if err != nil {
		return nil, fmt.Errorf("chart %s: manifest: %w", dir, err)
	}
	a.Digest = descriptor(a.Manifest, "").Digest.String()
	return a, nil
}

// Ref is the artifact's reference in repository by tag and digest (repository:version@digest):
// the tag says which release it is, the digest is what a client pulls.
func (a *Artifact) Ref(repository string) string {
	return repository + ":" + a.Version + "@" + a.Digest
}

func descriptor(b []byte, mediaType types.MediaType) v1.Descriptor {
	sum := sha256.Sum256(b)
	return v1.Descriptor{MediaType: mediaType, Size: int64(len(b)), Digest: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])}}
}
