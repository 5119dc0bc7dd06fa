#!/usr/bin/env bash
# seedbin.sh builds what a real single-node seed runs beside hack/testbin.sh's kube-apiserver,
# kubectl and etcd: kubelet, kube-proxy, kube-controller-manager and kube-scheduler (k8s.io/kubernetes,
# the same wrapper module and build settings as testbin.sh, so the Go build cache is shared),
# kube-router (the NetworkPolicy enforcer, firewall only) and CoreDNS (cluster DNS), from the Go
# module proxy only, into a cache directory outside the repository, once. It prints the directory
# on its last line; a second call finds the binaries and returns at once.
#
# Usage: hack/seedbin.sh            # env K8S, KUBE_ROUTER, COREDNS, SEEDBIN_DIR override defaults
#
# Why kube-router: kube-network-policies needs the nft queue expression (NFT_QUEUE), which this
# kernel lacks; kube-router v2.1.0 is the newest the module proxy serves (security advisories are
# reported for it: it enforces policies of a test cluster on loopback here, nothing else).
set -euo pipefail
K8S=${K8S:-v1.37.1}
KUBE_ROUTER=${KUBE_ROUTER:-v2.1.0}
COREDNS=${COREDNS:-v1.14.7}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
OUT=${SEEDBIN_DIR:-$CACHE/tendril/seedbin/k8s-$K8S-kube-router-$KUBE_ROUTER-coredns-$COREDNS-static}
BINS=(kubelet kube-proxy kube-controller-manager kube-scheduler kube-router coredns)
have() { for b in "${BINS[@]}"; do [[ -x $OUT/$b ]] || return 1; done; }
if have; then echo "$OUT"; exit 0; fi
# Static, as testbin.sh builds (its Go build cache then serves these too).
export GOFLAGS=-buildvcs=false GOTOOLCHAIN=local CGO_ENABLED=0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STAGING=v0.${K8S#v1.}
MINOR=$(echo "$K8S" | cut -d. -f2)
mkdir -p "$OUT.tmp" "$WORK/k8s" "$WORK/kube-router" "$WORK/coredns"
log() { echo "seedbin: $*" >&2; }

log "building kubelet, kube-proxy, kube-controller-manager, kube-scheduler $K8S, kube-router $KUBE_ROUTER and CoreDNS $COREDNS into $OUT (about 10 minutes on 2 cores after make testbin, once)"
MOD=$(go mod download -json "k8s.io/kubernetes@$K8S" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
cd "$WORK/k8s"
{
  printf 'module example.com/k8sseedbins\n\ngo 1.26.0\n\ngodebug default=go1.26\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$K8S"
  grep -E '=> ./staging' "$MOD" | awk -v s="$STAGING" '{print "\t"$1" => "$1" "s}'
  printf ')\n'
} >go.mod
{
  printf '//go:build tools\n\npackage k8sseedbins\n\nimport (\n'
  for c in kubelet kube-proxy kube-controller-manager kube-scheduler; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c"; done
  printf ')\n'
} >tools.go
log "resolving modules"
go mod tidy
PKG=k8s.io/component-base/version CG=k8s.io/client-go/pkg/version
LDF="-s -w -X $PKG.gitVersion=$K8S -X $PKG.gitMajor=1 -X $PKG.gitMinor=$MINOR -X $PKG.gitTreeState=clean -X $CG.gitVersion=$K8S -X $CG.gitMajor=1 -X $CG.gitMinor=$MINOR"
for c in kubelet kube-proxy kube-controller-manager kube-scheduler; do
  log "compiling $c"
  go build -ldflags "$LDF" -o "$OUT.tmp/$c" "k8s.io/kubernetes/cmd/$c"
done

# kube-router and CoreDNS are built in modules of their own (their own dependency versions): go
# install of a module version ignores any go.mod around it.
log "compiling kube-router"
GOBIN="$OUT.tmp" go install -ldflags "-s -w" "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER"
# CoreDNS runs as a pod (k8s-app=kube-dns in kube-system, where Gardener's allow-to-dns policy
# points) from an image that holds this one file.
log "compiling coredns"
GOBIN="$OUT.tmp" go install -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS"

for b in "${BINS[@]}"; do [[ -x $OUT.tmp/$b ]] || { log "missing $b after the build"; exit 1; }; done
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT"
