# poolcsi developer entry points. Everything needs Go; tests and `run` need root.
BIN := bin/poolcsi
# The version of this build, semver: the VERSION file, the one place it is written. The
# image tag, the chart's version and appVersion and deploy/kubernetes follow it
# (test/k8s/chart's TestVersionsAgree fails when they drift); the commit is stamped apart.
VERSION ?= $(shell cat VERSION)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)
# The commit's time, not the clock's: the same tree links the same binary, so make run and
# make build relink only after a change (a clock stamp made every run relink).
BUILD_DATE ?= $(shell TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null)
LDFLAGS := -X main.version=$(VERSION) -X main.commit=$(COMMIT) -X main.buildDate=$(BUILD_DATE)

.PHONY: build test unit lint fuzz run demo clean e2e conformance conformance-stop image image-debs image-lock release bench bench-check

# Prints a variable as make sees it (make -s print-IMAGE_TAG): the version test reads them.
print-%:
	@echo '$($*)'

build:
	CGO_ENABLED=0 go build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/poolcsi

# The whole suite (root): gofmt, lint (with go vet's analyzers), unit, sanity,
# end-to-end, faults, Kubernetes harness.
test:
	hack/test.sh

# The fast loop, no root needed: unit tests with -race, sanity over the fake
# kernel, internal/driver coverage. Under a minute.
unit:
	hack/unit.sh

# Every Go fuzz target for FUZZTIME (default 10s) each.
fuzz:
	hack/fuzz.sh

# golangci-lint (built once from the Go module proxy, cached in ~/.cache/poolcsi-tools), zero findings.
lint:
	hack/lint.sh

# The headline benchmarks (root; 10-20 minutes a run): life vs the raw commands,
# ListVolumes and GetCapacity at 10,000 volumes, create/delete at 0 and 10,000, start
# at 10,000 with RSS, and, once, a claim → Running against local-path-provisioner on the
# one-node cluster where its components are built ("not run" and why otherwise). Writes
# their table (medians of BENCH_RUNS runs, with each figure's noise band) into
# docs/performance.md. Not part of make test: timings are noisy.
BENCH_RUNS ?= 3
BENCH_FLAGS ?=
bench:
	go run ./hack/bench -write -runs $(BENCH_RUNS) $(BENCH_FLAGS)

# One run of the same benchmarks against the committed table: fails naming every
# figure that moved past its noise band.
bench-check:
	go run ./hack/bench -check $(BENCH_FLAGS)

# Runs the driver on a local pool under /var/lib/poolcsi, socket in /run/poolcsi.
run: build
	$(BIN) serve --endpoint unix:///run/poolcsi/csi.sock --node-id $$(hostname) --pool local=/var/lib/poolcsi/pools/local --metrics-address 127.0.0.1:9808 -v 3

clean:
	rm -rf bin _output

# poolcsi's image for linux/amd64 and linux/arm64, without Docker: an OCI image layout
# (one image index) in _output/image, each platform's static poolcsi plus the tools of
# deploy/image-tools.txt from the Debian bookworm packages of that architecture pinned in
# deploy/image-packages.lock (downloaded once into .cache/image-debs). Push it with
# skopeo copy --all oci:_output/image docker://REGISTRY/poolcsi:TAG (docs/deploy.md).
# deploy/Dockerfile is the same image for Docker users. The image and release tools are
# hack/release, a Go module of their own (go-containerregistry, Helm; never in the root module).
IMAGE_ARCHES ?= amd64,arm64
IMAGE_TAG ?= $(VERSION)
IMAGE_LDFLAGS := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
image:
	@for arch in $$(echo '$(IMAGE_ARCHES)' | tr , ' '); do \
		echo "image: building poolcsi for linux/$$arch"; \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$arch go build -trimpath -ldflags "$(IMAGE_LDFLAGS)" \
			-o _output/bin/linux-$$arch/poolcsi ./cmd/poolcsi || exit 1; \
	done
	cd hack/release && go run ./cmd/image -arches '$(IMAGE_ARCHES)' -ref '$(IMAGE_TAG)' -version '$(VERSION)' -revision '$(COMMIT)'

# A release's artefacts in _output/release (docs/release.md): the image index of make image
# as an OCI archive, the packaged chart, the plain YAML for RELEASE_REPOSITORY's image of this
# version (pinned by digest), an SPDX SBOM of the image (its Go modules and Debian
# packages) and SHA256SUMS. The version is the VERSION file's; no network beyond make image's.
RELEASE_REPOSITORY ?= ghcr.io/poolcsi/poolcsi
RELEASE_OUT ?= $(CURDIR)/_output/release
release: image
	cd hack/release && go run ./cmd/release -version '$(VERSION)' -commit '$(COMMIT)' \
		-repository '$(RELEASE_REPOSITORY)' -arches '$(IMAGE_ARCHES)' -out '$(RELEASE_OUT)'

# Downloads the pinned Debian packages of make image into .cache/image-debs (the image
# tests read them from there and never download).
image-debs:
	cd hack/release && go run ./cmd/image -fetch-only

# Pins the current versions of the image's Debian packages in deploy/image-packages.lock
# (reads the bookworm indexes; review the diff).
image-lock:
	cd hack/release && go run ./cmd/image -update-lock

# The Kubernetes storage e2e suite (e2e.test v1.36.3) against the chart on a real
# two-node cluster (root; test/k8s/cmd/conformance): a few specs of it, or those E2E_FOCUS
# names (a ginkgo regexp).
E2E_FOCUS ?=
e2e:
	cd test/k8s && go run ./cmd/conformance -focus '$(E2E_FOCUS)' -timeout 5h

# Every External Storage spec, one driver and test pattern at a time, each result kept in
# test/k8s/e2e/results.json and docs/conformance.md rewritten after each. It resumes where
# an earlier run stopped (RERUN=1 runs everything again, RERUN=failed the chunks with a
# failure; CHUNKS=<regexp> only the chunks it matches, SPECS=<regexp> only the specs it
# matches); BUDGET stops starting new ones. It runs on two nodes (TestTwoNodes's cluster).
BUDGET ?= 4h
PROCS ?= 3
conformance:
	cd test/k8s && go run ./cmd/conformance -focus 'External.Storage' -report '$(CURDIR)/docs/conformance.md' \
		-budget '$(BUDGET)' -rerun '$(RERUN)' -procs '$(PROCS)' -chunks '$(CHUNKS)' -specs '$(SPECS)' -timeout 6h

# Stops a running make conformance after the chunk it is running (its results kept); the
# path is conformanceStop in test/k8s/e2e/suite.go.
conformance-stop:
	touch /run/lock/poolcsi-conformance.stop

# A guided tour (root): one volume through every CSI call on a throw-away pool.
# Builds as the caller and runs the binary with sudo unless already root, as
# root's PATH usually has no go.
demo: build
	$(if $(filter 0,$(shell id -u)),,sudo) $(BIN) demo
