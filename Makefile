# tendril — `make help` lists the targets.
export GOTOOLCHAIN := local
GO        ?= go
FUZZ_TIME ?= 30s
BENCH_ARGS ?=
# SEED_ARGS are more flags of make seed's tendril-local --real (SEED_ARGS=--once: check and exit).
SEED_ARGS ?=
CONTROLLER_GEN_VERSION ?= v0.23.0

# What the seed and the shoots run; tendril-local (make run) and tendril-bench are developer
# tools and would add 188 MB (78 MB compressed) that every shoot node pulls for its agent.
IMAGE_BINARIES ?= tendril-agent tendril-egress-relay tendril-ingress tendril-seed tendril-server
# What every binary's --version and the image's labels say. The version is the chart's
# appVersion. The revision is not the commit but a digest of the image binaries' sources
# (hack/image revision.go): the chart pins the image's digest (make image-pin), and a commit
# inside the image would change with the commit that writes the pin.
VERSION  ?= v$(shell sed -n 's/^appVersion: "\(.*\)"$$/\1/p' charts/tendril-seed/Chart.yaml)
REVISION ?= $(shell CGO_ENABLED=0 $(GO) run ./hack/image revision $(addprefix ./cmd/,$(IMAGE_BINARIES)))
# The image's timestamps: none (1970), so that the digest depends on the binaries alone.
SOURCE_DATE_EPOCH ?= 0
IMAGE_REPO ?= ghcr.io/tendril-net/tendril
# Where make image writes the OCI layout, the docker load tarball and the digest.
IMAGE_OUT ?= bin/image
BUILDINFO := github.com/tendril-net/tendril/internal/proc/buildinfo
# Reproducible binaries: no file system paths (-trimpath), no VCS stamp that a checkout without
# .git (a Docker build context) would lack (-buildvcs=false; the revision comes in by -X).
# hack/image/image_test.go and the Dockerfile build with the same flags.
GO_BUILD_FLAGS = -trimpath -buildvcs=false -ldflags "-X $(BUILDINFO).Version=$(VERSION) -X $(BUILDINFO).Revision=$(REVISION)"

.PHONY: help build image image-pin print-revision chart test vet fuzz bench run seed clean generate testbin seedbin

help: ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# Where build puts the binaries; cmd/tendril-local's TestMainJob builds into a temporary one.
BIN ?= bin
build: ## Build every binary into bin/ (static: no cgo, which also keeps libc out of each process's memory).
	CGO_ENABLED=0 $(GO) build $(GO_BUILD_FLAGS) -o $(BIN)/ ./cmd/...

image: build ## Build the OCI image of bin/ without a Docker engine: bin/image/oci (OCI layout), bin/image/tendril.tar (docker load); prints its digest.
	$(GO) run ./hack/image --out $(IMAGE_OUT) --repository $(IMAGE_REPO) --version $(VERSION) --revision $(REVISION) \
		--source-date-epoch $(SOURCE_DATE_EPOCH) $(addprefix $(BIN)/,$(IMAGE_BINARIES))

# Where make chart writes the seed chart's OCI layout and digest.
CHART_OUT  ?= bin/chart
CHART_REPO ?= ghcr.io/tendril-net/charts/tendril-seed

chart: ## Build the seed chart's Helm OCI artifact that charts/extension.yaml references: bin/chart/oci (OCI layout; push it unchanged, e.g. crane push bin/chart/oci $(CHART_REPO):<version>), bin/chart/digest; prints <repository>:<version>@<digest>.
	$(GO) run ./hack/chart --out $(CHART_OUT) --repository $(CHART_REPO)

print-revision: ## Print the source revision the binaries and the image carry.
	@echo $(REVISION)

image-pin: image ## Pin the chart (and the registration files) to the digest make image printed: after every change to the image's sources (hack/image TestChartPinsTheImage fails until then).
	sed -i "s/^imageDigest: .*/imageDigest: $$(cat $(IMAGE_OUT)/digest)/" charts/tendril-seed/values.yaml
	$(GO) test ./charts -update

vet: ## go vet and gofmt.
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }

# The real seed's test runs where it can (root and Debian's containerd and friends, which .ci/run
# installs): seedbin's binaries and the image it installs are built first there, and nowhere else.
test: vet build testbin ## Run all tests (unit tests with -race, loopback end-to-end tests, envtest, the real seed as root, golden files).
	@if [ "$$(id -u)" = 0 ] && command -v containerd >/dev/null; then hack/seedbin.sh >/dev/null && $(MAKE) --no-print-directory image >/dev/null; fi
	KUBEBUILDER_ASSETS="$$(hack/testbin.sh)" $(GO) test -race -count=1 -timeout 30m ./...

testbin: ## Build kube-apiserver and etcd for envtest into ~/.cache/tendril (once; about 9 minutes on 2 cores).
	@hack/testbin.sh >/dev/null

seedbin: ## Build kubelet, kube-proxy, kube-controller-manager, kube-scheduler, kube-router and CoreDNS for make seed into ~/.cache/tendril (once; about 12 minutes on 2 cores after make testbin).
	@hack/seedbin.sh >/dev/null

generate: ## Regenerate deepcopy functions and the CRDs from apis/ (controller-gen), then the chart's golden files and registration that embed the CRD.
	$(GO) run sigs.k8s.io/controller-tools/cmd/controller-gen@$(CONTROLLER_GEN_VERSION) object paths=./apis/... \
		crd:crdVersions=v1 output:crd:artifacts:config=charts/tendril-seed/crds
	$(GO) test ./charts -update

fuzz: ## Run every fuzz target for FUZZ_TIME each.
	@$(GO) list -f '{{.ImportPath}} {{.Dir}}' ./... | while read -r pkg dir; do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | sed 's/func //'); do \
			echo "== $$pkg $$f"; $(GO) test -run=NONE -fuzz="^$$f$$" -fuzztime=$(FUZZ_TIME) $$pkg || exit 1; \
		done; \
	done

# The suite fits the 2-core machine in under 25 minutes (3 s per measurement, 3 rounds for the
# connection paths; the idle mode about 5 minutes at the N the 20,000-descriptor limit allows; the
# failover mode about 6 minutes, of which about 5 for the kinds that hold connections; the
# impaired tunnel run about 4 minutes: three cells of the grid, the diagonal, for tendril and its
# two peers, one connection and one dial worker; the whole grid is
# `tendril-bench tunnel --impair grid`, about 40 minutes); the tunnel mode needs root for its
# network namespaces and skips what it cannot set up.
BENCH_RATE_ARGS = --rounds 3 --duration 3s
bench: build ## Run the benchmarks against their peers: docs/benchmarks.md, reports and plots in docs/bench/ (analysis: docs/performance.md).
	@mkdir -p docs/bench
	hack/bench-head.sh > docs/benchmarks.md
	$(GO) test -run=NONE -bench=ShootChange -benchtime=200x -timeout 30m ./xds/server/ > docs/bench/xds.txt
	cat docs/bench/xds.txt
	printf '\n## xDS: one shoot change, in process (`go test -bench ShootChange ./xds/server/`)\n\n```\n' >> docs/benchmarks.md
	grep -E '^(Benchmark|cpu:)' docs/bench/xds.txt >> docs/benchmarks.md
	printf '```\n\n' >> docs/benchmarks.md
	bin/tendril-bench sni $(BENCH_RATE_ARGS) --markdown docs/bench/sni.md --json-file docs/bench/sni.json --markdown-append docs/benchmarks.md $(BENCH_ARGS)
	bin/tendril-bench proxy $(BENCH_RATE_ARGS) --markdown docs/bench/proxy.md --json-file docs/bench/proxy.json --markdown-append docs/benchmarks.md $(BENCH_ARGS)
	bin/tendril-bench connect $(BENCH_RATE_ARGS) --markdown docs/bench/connect.md --json-file docs/bench/connect.json --markdown-append docs/benchmarks.md $(BENCH_ARGS)
	bin/tendril-bench idle --markdown docs/bench/idle.md --json-file docs/bench/idle.json --markdown-append docs/benchmarks.md
	bin/tendril-bench tunnel --rounds 3 --markdown docs/bench/tunnel.md --json-file docs/bench/tunnel.json --markdown-append docs/benchmarks.md
	bin/tendril-bench tunnel --targets tendril-connect,openvpn,konnectivity-connect --impair 0/0,50ms/0.5,150ms/2 --conns 1 --dial-workers 1 --up-runs 1 \
		--markdown docs/bench/tunnel-impaired.md --json-file docs/bench/tunnel-impaired.json --markdown-append docs/benchmarks.md
	bin/tendril-bench failover --markdown docs/bench/failover.md --json-file docs/bench/failover.json --markdown-append docs/benchmarks.md
	bin/tendril-bench xds --markdown docs/bench/xds.md --json-file docs/bench/xds.json --markdown-append docs/benchmarks.md
	bin/tendril-bench terminate --json-file docs/bench/terminate.json > docs/bench/terminate.md
	printf '\n## The terminating mode against HAProxy (`tendril-bench terminate`)\n\n' >> docs/benchmarks.md
	cat docs/bench/terminate.md >> docs/benchmarks.md
	bin/tendril-bench plot --rate docs/bench/sni.json,docs/bench/proxy.json,docs/bench/connect.json --xds docs/bench/xds.json --tunnel docs/bench/tunnel.json
	printf '\n## Plots\n\n![SNI](bench/sni-ttfb.png)\n![PROXY](bench/proxy-ttfb.png)\n![CONNECT](bench/connect-ttfb.png)\n![xDS](bench/xds.png)\n![tunnel](bench/tunnel.png)\n' >> docs/benchmarks.md

run: build testbin ## Start a local seed (seed API server, tendril-seed, tendril-ingress, two shoots with their own API servers) until interrupted.
	bin/tendril-local --testbin-dir "$$(hack/testbin.sh)"

seed: image testbin seedbin ## Start a real single-node seed cluster on this machine with tendril installed from its image and chart by digest (root; apt-get install the packages .ci/run names) until interrupted.
	bin/tendril-local --real --testbin-dir "$$(hack/testbin.sh)" --seedbin-dir "$$(hack/seedbin.sh)" $(SEED_ARGS)

clean: ## Remove build outputs.
	rm -rf bin
