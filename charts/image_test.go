package charts

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

// TestImageDigest: with imageDigest set, every tendril container and the image tendril-seed
// hands to the shoots is repository@digest; without, image as given; a malformed digest fails.
func TestImageDigest(t *testing.T) {
	const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, tc := range []struct{ image, digest, want string }{
		{"ghcr.io/tendril-net/tendril:v0.1.0", digest, "ghcr.io/tendril-net/tendril@" + digest},
		{"registry.local:5000/tendril", digest, "registry.local:5000/tendril@" + digest},
		{"registry.local:5000/tendril:v2", digest, "registry.local:5000/tendril@" + digest},
		{"ghcr.io/tendril-net/tendril:v0.1.0", "", "ghcr.io/tendril-net/tendril:v0.1.0"},
	} {
		objs := decode(t, render(t, map[string]any{"image": tc.image, "imageDigest": tc.digest}))
		seed := find[*appsv1.Deployment](t, objs, "gardener-extension-tendril").Spec.Template.Spec.Containers[0]
		ingress := find[*appsv1.Deployment](t, objs, "tendril-ingress").Spec.Template.Spec.Containers[0]
		if seed.Image != tc.want || ingress.Image != tc.want || !slices.Contains(seed.Args, "--image="+tc.want) {
			t.Errorf("image %q digest %q: tendril-seed %s (args %q), tendril-ingress %s; want %s",
				tc.image, tc.digest, seed.Image, seed.Args, ingress.Image, tc.want)
		}
	}
	for _, bad := range []string{"sha256:abc", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", strings.ToUpper(digest)} {
		_, err := renderer().RenderEmbeddedFS(FS, SeedChart, "tendril", namespace, withGardener(map[string]any{"imageDigest": bad}))
		if err == nil || !strings.Contains(err.Error(), "want sha256:<64 hex digits>") {
			t.Errorf("imageDigest %q: error %v", bad, err)
		}
	}
}
