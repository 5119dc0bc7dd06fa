# The tendril image for those who build with Docker: `make image` builds the same image without
# a Docker engine (hack/image) and is what the chart pins by digest. Both give: an empty base,
# the binaries the seed and the shoots run at /<name> (root's, mode 0555), /tmp (1777), user 65532:65532, entrypoint
# /tendril-seed, the OCI labels source, revision and version. The digests differ (Docker records
# its own history and timestamps); the files and the config's user, entrypoint and labels do not.
#
#   docker build --build-arg VERSION=v0.1.0 --build-arg REVISION=$(make -s print-revision) -t tendril .

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION} AS build
ARG VERSION=devel
ARG REVISION=unknown
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# GO_BUILD_FLAGS and IMAGE_BINARIES of the Makefile.
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-X github.com/tendril-net/tendril/internal/buildinfo.Version=${VERSION} -X github.com/tendril-net/tendril/internal/buildinfo.Revision=${REVISION}" \
      -o /rootfs/ ./cmd/tendril-agent ./cmd/tendril-egress-relay ./cmd/tendril-ingress ./cmd/tendril-seed ./cmd/tendril-server && \
    chmod 0555 /rootfs/tendril-* && \
    mkdir -m 1777 /rootfs/tmp

FROM scratch
ARG VERSION=devel
ARG REVISION=unknown
COPY --from=build /rootfs/ /
LABEL org.opencontainers.image.source="https://github.com/tendril-net/tendril" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.title="tendril"
USER 65532:65532
WORKDIR /
ENTRYPOINT ["/tendril-seed"]
