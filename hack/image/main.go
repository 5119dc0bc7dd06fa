// Command image builds tendril's container image from the static binaries `make build` wrote,
// without a Docker engine (make image runs it):
//
//	go run ./hack/image --out bin/image --version v0.1.0 --revision <commit> \
//	    --source-date-epoch <commit time> bin/tendril-agent bin/tendril-seed …
//
// It writes OUT/oci (an OCI image layout), OUT/tendril.tar (for docker load) and OUT/digest (the
// manifest's digest, which it also prints). The Dockerfile builds the same image with Docker.
//
//	go run ./hack/image revision ./cmd/tendril-agent ./cmd/tendril-seed …
//
// prints the source revision of those packages (sourceRevision), which make passes to the
// binaries and the image instead of the commit, so that the chart can pin the image's digest.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/tendril-net/tendril/hack/image/ociimage"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "revision" {
		rev, err := sourceRevision("", args[1:])
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(stdout, rev)
		return err
	}
	var cfg ociimage.Config
	var out, repo, epoch string
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&out, "out", "bin/image", "output directory: oci/ (OCI layout), tendril.tar (docker load), digest")
	fs.StringVar(&repo, "repository", "ghcr.io/tendril-net/tendril", "the image's repository; its tag is --version")
	fs.StringVar(&cfg.Version, "version", "", "label org.opencontainers.image.version and the tag (required)")
	fs.StringVar(&cfg.Revision, "revision", "", "label org.opencontainers.image.revision: the source revision (required; make image: go run ./hack/image revision)")
	fs.StringVar(&cfg.Source, "source", ociimage.DefaultSource, "label org.opencontainers.image.source")
	fs.StringVar(&cfg.Entrypoint, "entrypoint", "tendril-seed", "the binary that runs when no command is given (empty: none)")
	fs.StringVar(&epoch, "source-date-epoch", os.Getenv("SOURCE_DATE_EPOCH"), "every timestamp of the image, in seconds since 1970 (default $SOURCE_DATE_EPOCH; make image: 0, so that the digest depends on the binaries alone)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Binaries = fs.Args()
	switch {
	case len(cfg.Binaries) == 0:
		return errors.New("no binaries given")
	case cfg.Version == "" || cfg.Revision == "":
		return errors.New("--version and --revision are required")
	case epoch == "":
		return errors.New("--source-date-epoch (or $SOURCE_DATE_EPOCH) is required: the image's timestamps must not depend on when it was built")
	}
	sec, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil || sec < 0 {
		return fmt.Errorf("--source-date-epoch %q: want seconds since 1970", epoch)
	}
	cfg.Created = time.Unix(sec, 0)

	img, err := ociimage.Build(cfg)
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := ociimage.WriteLayout(filepath.Join(out, "oci"), img, cfg.Version); err != nil {
		return err
	}
	if err := ociimage.WriteTarball(filepath.Join(out, "tendril.tar"), img, repo+":"+cfg.Version); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "digest"), []byte(digest.String()+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s:%s@%s\n  OCI layout:  %s\n  docker load: %s\n",
		repo, cfg.Version, digest, filepath.Join(out, "oci"), filepath.Join(out, "tendril.tar"))
	return nil
}
