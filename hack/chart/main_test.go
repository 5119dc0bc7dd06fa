package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	gardencorev1 "github.com/gardener/gardener/pkg/apis/core/v1"
	operatorv1alpha1 "github.com/gardener/gardener/pkg/apis/operator/v1alpha1"
	"github.com/gardener/gardener/pkg/utils/oci"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"sigs.k8s.io/yaml"

	"github.com/tendril-net/tendril/internal/testing/testoci"
)

const root = "../.."

// TestChart runs the command twice, built as make chart runs it, and reads what it wrote by the
// OCI image layout spec's rules alone (not through go-containerregistry): the digest file is the
// manifest's sha256, the config is Chart.yaml, Helm's loader loads the layer as the chart.
// The reference it prints is the one charts/extension.yaml names, and Gardener's HelmRegistry,
// as gardenlet pulls charts, gets the layer back from a registry the layout was pushed to as
// crane push pushes one.
func TestChart(t *testing.T) {
	var chartYAML struct {
		Name    string `json:"name"`
		Version string `json:"version"`
	}
	readYAML(t, filepath.Join(root, "charts", "tendril-seed", "Chart.yaml"), &chartYAML)

	tool := filepath.Join(t.TempDir(), "chart")
	if b, err := exec.Command("go", "build", "-o", tool, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	var refs []string
	outs := []string{t.TempDir(), t.TempDir()}
	for _, out := range outs {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(tool, "--out", out)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%v\n%s", err, stderr.String())
		}
		d, err := os.ReadFile(filepath.Join(out, "digest"))
		if err != nil {
			t.Fatal(err)
		}
		ref := "ghcr.io/tendril-net/charts/tendril-seed:" + chartYAML.Version + "@" + strings.TrimSpace(string(d))
		if !strings.HasPrefix(stdout.String(), ref+"\n") {
			t.Errorf("printed %q, want %s first", stdout.String(), ref)
		}
		refs = append(refs, ref)
	}
	if refs[0] != refs[1] {
		t.Fatalf("two builds: %s and %s", refs[0], refs[1])
	}
	t.Logf("%s (twice)", refs[0])
	ref := refs[0]
	digest := ref[strings.LastIndex(ref, "@")+1:]
	layoutDir := filepath.Join(outs[0], "oci")

	// The layout: oci-layout, index.json naming the manifest by the chart's version, blobs
	// addressed by their sha256.
	manifest := testoci.ReadLayout(t, layoutDir, digest, chartYAML.Version)
	if manifest.Config.MediaType != "application/vnd.cncf.helm.config.v1+json" || len(manifest.Layers) != 1 ||
		manifest.Layers[0].MediaType != "application/vnd.cncf.helm.chart.content.v1.tar+gzip" {
		t.Fatalf("manifest %+v", manifest)
	}
	var config struct {
		Name    string `json:"name"`
		Version string `json:"version"`
	}
	if err := json.Unmarshal(testoci.Blob(t, layoutDir, manifest.Config), &config); err != nil {
		t.Fatal(err)
	}
	if config != chartYAML {
		t.Errorf("config %+v, Chart.yaml %+v", config, chartYAML)
	}
	layer := testoci.Blob(t, layoutDir, manifest.Layers[0])
	ch, err := loader.LoadArchive(bytes.NewReader(layer))
	if err != nil {
		t.Fatalf("Helm's loader: %v", err)
	}
	if err := ch.Validate(); err != nil {
		t.Errorf("Helm's chart validation: %v", err)
	}
	if ch.Metadata.Name != "tendril-seed" || ch.Metadata.Version != chartYAML.Version || len(ch.Templates) == 0 {
		t.Errorf("Helm loads chart %s %s with %d templates, want tendril-seed %s", ch.Metadata.Name, ch.Metadata.Version, len(ch.Templates), chartYAML.Version)
	}

	// What the Extension names is what the command builds.
	var ext operatorv1alpha1.Extension
	readYAML(t, filepath.Join(root, "charts", "extension.yaml"), &ext)
	extRef := *ext.Spec.Deployment.ExtensionDeployment.Helm.OCIRepository.Ref
	if extRef != ref {
		t.Errorf("charts/extension.yaml names %s, the command built %s (go test ./charts -update)", extRef, ref)
	}

	// Pushed as crane push pushes a layout (its manifest's bytes unchanged), pulled by the
	// Extension's reference on this registry as gardenlet pulls it.
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	repo := u.Host + "/charts/tendril-seed"
	tag, err := name.NewTag(repo + ":" + chartYAML.Version)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := layout.ImageIndexFromPath(layoutDir)
	if err != nil {
		t.Fatal(err)
	}
	h, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	img, err := idx.Image(h.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, img); err != nil {
		t.Fatalf("push: %v", err)
	}
	if d, err := remote.Head(tag); err != nil || d.Digest.String() != digest {
		t.Errorf("the registry serves %s as %v (%v), want %s", tag, d, err, digest)
	}
	local := repo + strings.TrimPrefix(extRef, "ghcr.io/tendril-net/charts/tendril-seed")
	pulled, err := oci.NewHelmRegistry(nil).Pull(context.Background(), &gardencorev1.OCIRepository{Ref: &local})
	if err != nil {
		t.Fatalf("Gardener's HelmRegistry: pull %s: %v", local, err)
	}
	if !bytes.Equal(pulled, layer) {
		t.Errorf("Gardener's HelmRegistry pulled %d bytes, not the layer's %d", len(pulled), len(layer))
	}
}

// TestRunRefuses: arguments the command does not take are an error, not ignored.
func TestRunRefuses(t *testing.T) {
	err := run([]string{"--out", t.TempDir(), "charts/tendril-seed"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "unexpected arguments") {
		t.Errorf("error %v, want unexpected arguments", err)
	}
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
