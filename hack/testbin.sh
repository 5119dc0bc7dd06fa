#!/usr/bin/env bash
# testbin.sh builds the real kube-apiserver, kubectl and etcd that the controller
# tests run through envtest, from the Go module proxy only, into a cache directory
# outside the repository, once. It prints the directory (for KUBEBUILDER_ASSETS) on
# its last line. A second call finds the binaries and returns at once.
#
# Usage: hack/testbin.sh            # env K8S, ETCD, TESTBIN_DIR override defaults
#
# Why from source: no release binaries are reachable here, only the module proxy.
# k8s.io/kubernetes refers to its staging modules by relative replace; a wrapper
# module replaces each with the published k8s.io/<name> v0.<minor>.<patch>.
# Static (CGO_ENABLED=0, as Kubernetes and etcd build their releases): the real seed packs this
# kube-apiserver and etcd into images of one file each for the shoots' control planes.
set -euo pipefail
K8S=${K8S:-v1.37.1}
ETCD=${ETCD:-v3.7.3}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
OUT=${TESTBIN_DIR:-$CACHE/tendril/testbin/k8s-$K8S-etcd-$ETCD-static}
if [[ -x $OUT/kube-apiserver && -x $OUT/etcd && -x $OUT/kubectl ]]; then
  echo "$OUT"; exit 0
fi
export GOFLAGS=-buildvcs=false GOTOOLCHAIN=local CGO_ENABLED=0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STAGING=v0.${K8S#v1.}
MINOR=$(echo "$K8S" | cut -d. -f2)
mkdir -p "$OUT.tmp" "$WORK/k8s" "$WORK/etcd"
log() { echo "testbin: $*" >&2; }

log "building kube-apiserver $K8S, kubectl and etcd $ETCD into $OUT (about 9 minutes on 2 cores, once)"
MOD=$(go mod download -json "k8s.io/kubernetes@$K8S" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
cd "$WORK/k8s"
{
  printf 'module example.com/k8stestbins\n\ngo 1.26.0\n\ngodebug default=go1.26\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$K8S"
  grep -E '=> ./staging' "$MOD" | awk -v s="$STAGING" '{print "\t"$1" => "$1" "s}'
  printf ')\n'
} >go.mod
printf '//go:build tools\n\npackage k8stestbins\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n\t_ "k8s.io/kubernetes/cmd/kubectl"\n)\n' >tools.go
log "resolving modules"
go mod tidy
PKG=k8s.io/component-base/version CG=k8s.io/client-go/pkg/version
LDF="-s -w -X $PKG.gitVersion=$K8S -X $PKG.gitMajor=1 -X $PKG.gitMinor=$MINOR -X $PKG.gitTreeState=clean -X $CG.gitVersion=$K8S -X $CG.gitMajor=1 -X $CG.gitMinor=$MINOR"
log "compiling kube-apiserver"
go build -ldflags "$LDF" -o "$OUT.tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
log "compiling kubectl"
go build -ldflags "$LDF" -o "$OUT.tmp/kubectl" k8s.io/kubernetes/cmd/kubectl

# etcd: the server/v3 module's root package is package main (etcdmain).
cd "$WORK/etcd"
printf 'module example.com/etcdbin\n\ngo 1.26.0\n' >go.mod
printf '//go:build tools\n\npackage etcdbin\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >tools.go
log "compiling etcd"
go get "go.etcd.io/etcd/server/v3@$ETCD"
go mod tidy
go build -ldflags "-s -w" -o "$OUT.tmp/etcd" go.etcd.io/etcd/server/v3

"$OUT.tmp/kube-apiserver" --version >&2
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT"
