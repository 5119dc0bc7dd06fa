package realseed

import (
	"fmt"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/tendril-net/tendril/hack/image/ociimage"
)

// pushBinary packs one static binary into an image (empty base, /<name>, user 65532) and pushes
// it to the local registry as repository:tag; it returns the reference by digest that pods run.
func (c *Cluster) pushBinary(path, repository, tag string) (string, error) {
	img, err := ociimage.Build(ociimage.Config{Binaries: []string{path}, Entrypoint: filepath.Base(path)})
	if err != nil {
		return "", fmt.Errorf("image of %s: %w", path, err)
	}
	return c.Push(img, repository, tag)
}

// Push pushes img to the local registry as repository:tag and returns repository@digest there.
func (c *Cluster) Push(img v1.Image, repository, tag string) (string, error) {
	ref, err := name.NewTag(c.Registry+"/"+repository+":"+tag, name.Insecure)
	if err != nil {
		return "", err
	}
	if err := remote.Write(ref, img); err != nil {
		return "", fmt.Errorf("push %s to the local registry: %w", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		return "", err
	}
	return c.Registry + "/" + repository + "@" + d.String(), nil
}
