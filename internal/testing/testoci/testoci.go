// Package testoci reads an OCI image layout by the image-layout specification's rules alone (not
// through go-containerregistry, which wrote it), for the tests of the commands that write one:
// hack/image (the image) and hack/chart (the Helm chart artifact). Every blob it reads is checked
// against its descriptor's size and digest. It writes nothing and knows no media type but the
// OCI manifest's.
package testoci

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ManifestMediaType is the OCI image manifest's media type.
const ManifestMediaType = "application/vnd.oci.image.manifest.v1+json"

// Descriptor is an OCI content descriptor.
type Descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations"`
}

// Manifest is an OCI image manifest.
type Manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        Descriptor   `json:"config"`
	Layers        []Descriptor `json:"layers"`
}

// ReadLayout checks the layout in dir (oci-layout version 1.0.0; index.json with one OCI image
// manifest, of digest, named tag by org.opencontainers.image.ref.name) and returns that manifest,
// read from its blob.
func ReadLayout(t *testing.T, dir, digest, tag string) Manifest {
	t.Helper()
	var marker struct {
		Version string `json:"imageLayoutVersion"`
	}
	ReadJSON(t, filepath.Join(dir, "oci-layout"), &marker)
	if marker.Version != "1.0.0" {
		t.Errorf("oci-layout version %q", marker.Version)
	}
	var index struct {
		SchemaVersion int          `json:"schemaVersion"`
		Manifests     []Descriptor `json:"manifests"`
	}
	ReadJSON(t, filepath.Join(dir, "index.json"), &index)
	if index.SchemaVersion != 2 || len(index.Manifests) != 1 {
		t.Fatalf("index.json: schema %d, %d manifests", index.SchemaVersion, len(index.Manifests))
	}
	md := index.Manifests[0]
	if md.Digest != digest || md.MediaType != ManifestMediaType || md.Annotations["org.opencontainers.image.ref.name"] != tag {
		t.Errorf("index.json manifest %+v, want %s tagged %s", md, digest, tag)
	}
	var m Manifest
	if err := json.Unmarshal(Blob(t, dir, md), &m); err != nil {
		t.Fatal(err)
	}
	if m.SchemaVersion != 2 || m.MediaType != ManifestMediaType {
		t.Errorf("manifest: schema %d, media type %q", m.SchemaVersion, m.MediaType)
	}
	return m
}

// Blob reads a descriptor's blob from the layout in dir and checks its size and digest.
func Blob(t *testing.T, dir string, d Descriptor) []byte {
	t.Helper()
	algo, hexDigest, ok := strings.Cut(d.Digest, ":")
	if !ok || algo != "sha256" {
		t.Fatalf("digest %q", d.Digest)
	}
	b, err := os.ReadFile(filepath.Join(dir, "blobs", algo, hexDigest))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	if int64(len(b)) != d.Size || hex.EncodeToString(sum[:]) != hexDigest {
		t.Fatalf("blob %s: %d bytes, sha256 %x", d.Digest, len(b), sum)
	}
	return b
}

// ReadJSON decodes the JSON file at path into v.
func ReadJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
