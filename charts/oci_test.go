package charts

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"maps"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestHelmMediaTypes checks the media types against Helm's own constants (helm.sh/helm/v4's
// pkg/registry, in the version this module builds with). The test reads them from Helm's source
// rather than importing the package: that package pulls in oras-go, which this module does not
// require, and a new requirement would change go.mod and with it the image's source revision.
func TestHelmMediaTypes(t *testing.T) {
	dir, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "helm.sh/helm/v4").Output()
	if err != nil {
		t.Fatalf("go list -m helm.sh/helm/v4: %v", err)
	}
	file := filepath.Join(strings.TrimSpace(string(dir)), "pkg", "registry", "constants.go")
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	helm := map[string]string{}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			v := s.(*ast.ValueSpec)
			for i, n := range v.Names {
				if i < len(v.Values) {
					if lit, ok := v.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
						helm[n.Name], _ = strconv.Unquote(lit.Value)
					}
				}
			}
		}
	}
	for name, ours := range map[string]string{"ConfigMediaType": HelmConfigMediaType, "ChartLayerMediaType": HelmChartMediaType} {
		if helm[name] != ours {
			t.Errorf("Helm's registry.%s is %q (%s), ours %q", name, helm[name], file, ours)
		}
	}
}

// TestOCIArtifact checks the artifact as a registry client reads it: the manifest names the
// config and the one layer by their digests and sizes, the config is Chart.yaml, the layer holds
// the files of the chart and nothing else, and a second build is the same, byte for byte.
func TestOCIArtifact(t *testing.T) {
	a, err := OCIArtifact(SeedChart)
	if err != nil {
		t.Fatal(err)
	}
	again, err := OCIArtifact(SeedChart)
	if err != nil {
		t.Fatal(err)
	}
	if again.Digest != a.Digest || !bytes.Equal(again.Chart, a.Chart) {
		t.Errorf("two builds: digests %s and %s", a.Digest, again.Digest)
	}
	if want := "sha256:" + sha256Hex(a.Manifest); a.Digest != want {
		t.Errorf("digest %s, the manifest's sha256 is %s", a.Digest, want)
	}
	type descriptor struct {
		MediaType string `json:"mediaType"`
		Digest    string `json:"digest"`
		Size      int    `json:"size"`
	}
	var m struct {
		SchemaVersion int          `json:"schemaVersion"`
		MediaType     string       `json:"mediaType"`
		Config        descriptor   `json:"config"`
		Layers        []descriptor `json:"layers"`
	}
	if err := json.Unmarshal(a.Manifest, &m); err != nil {
		t.Fatal(err)
	}
	if m.SchemaVersion != 2 || m.MediaType != "application/vnd.oci.image.manifest.v1+json" {
		t.Errorf("manifest: schema %d, media type %q", m.SchemaVersion, m.MediaType)
	}
	if want := (descriptor{HelmConfigMediaType, "sha256:" + sha256Hex(a.Config), len(a.Config)}); m.Config != want {
		t.Errorf("manifest config %+v, want %+v", m.Config, want)
	}
	if want := (descriptor{HelmChartMediaType, "sha256:" + sha256Hex(a.Chart), len(a.Chart)}); len(m.Layers) != 1 || m.Layers[0] != want {
		t.Errorf("manifest layers %+v, want [%+v]", m.Layers, want)
	}

	meta, err := FS.ReadFile(SeedChart + "/Chart.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var chartYAML, config map[string]any
	if err := yaml.Unmarshal(meta, &chartYAML); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(a.Config, &config); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(config, chartYAML) || a.Name != SeedChart || a.Version != chartYAML["version"] {
		t.Errorf("config %v (name %s version %s), Chart.yaml %v", config, a.Name, a.Version, chartYAML)
	}
	if want := Repository + ":" + a.Version + "@" + a.Digest; a.Ref(Repository) != want {
		t.Errorf("Ref %s, want %s", a.Ref(Repository), want)
	}

	got, err := untar(a.Chart)
	if err != nil {
		t.Fatalf("the chart's layer: %v", err)
	}
	embedded := map[string]string{}
	if err := fs.WalkDir(FS, SeedChart, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		c, err := FS.ReadFile(p)
		embedded[p] = string(c)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, embedded) {
		t.Errorf("the chart's layer holds %v, not the chart in %s", slices.Sorted(maps.Keys(got)), SeedChart)
	}
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func untar(archive []byte) (map[string]string, error) {
	zr, err := gzip.NewReader(bytes.NewReader(archive))
	if err != nil {
		return nil, err
	}
	tr := tar.NewReader(zr)
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files, nil
		}
		if err != nil {
			return nil, err
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return nil, err
		}
		files[h.Name] = string(b)
	}
}
