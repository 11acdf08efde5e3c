# Ichor's build. `make test` is the one test command (.ci/run calls it).
SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c

BIN := $(CURDIR)/bin
# git describe of the newest v* tag, or v0.0.0-g<commit> before the first (hack/version.sh).
ifndef VERSION
VERSION := $(shell hack/version.sh)
endif
LDFLAGS := -X maesh.dev/ichor/internal/version.Version=$(VERSION)
CONTROLLER_GEN := $(BIN)/controller-gen
# Integration tests share one API server per package. Three packages at
# once on the two cores: most of their time is spent waiting on simulated
# machines (1.75 cores were busy on average over a whole run). Within a package,
# the tests on hosted fleets of their own run two at a time (-parallel 2).
# The test binaries are linked without DWARF (-w): a third less of the link's
# CPU, some forty links a run; stack traces do not need it.
TEST_FLAGS ?= -p 3 -parallel 2 -timeout 40m -ldflags=-w
# Every process of a test run (the test binaries, and the API servers, etcds
# and controllers they start, which inherit it) on one P: with some twenty
# Go processes on two cores, the runtime's idle spinning and parallel GC
# cost about a tenth of the run's CPU and gained no time.
TEST_GOMAXPROCS ?= 1
# And each collects garbage at a heap three times its live size rather than
# once (GOGC=300): memory is plentiful (24 GiB) where the two cores are not.
# TestKubernetesCARotation (a hosted fleet's API servers, etcd and
# controllers) took 94 CPU-seconds instead of 107 and 85 s instead of 95;
# its largest process peaked at 398 MB instead of 315. The benchmarks keep
# the default: they measure the controller as it ships.
TEST_GOGC ?= 300
# Tests build without kustomize's Go-plugin loader (cli-runtime brings in
# kustomize, whose loader imports the standard library's plugin package,
# which only an external link can make): the operation package's test
# binary linked in 12 CPU-seconds instead of 19, and a third smaller. The
# tests' own go builds (the controller and plugin binaries) inherit it
# through GOFLAGS. The image and the release archives build without cgo,
# where that package is a stub anyway.
TEST_GOFLAGS := -tags=kustomize_disable_go_plugin_support $(GOFLAGS)
# The longest packages first: go test starts packages in the order given,
# and the operation package alone takes most of the run (started last, it
# would leave a core idle at the end).
PKGS ?= ./controller/operation ./hack/sandbox ./sim ./plugin/clitest ./...

# The controller image (Dockerfile) and the engine that builds it.
IMAGE ?= ghcr.io/maesh-dev/ichor-controller
CONTAINER_ENGINE ?= docker
# Flags of the sandbox and the demo, like SANDBOX_FLAGS="--workers 5 --pace 2s".
SANDBOX_FLAGS ?=
# Archived files carry the commit's time, so one commit packs the same bytes.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)

# The chaos campaign (make chaos): its seed (0 takes one from the clock; run i
# of a campaign runs with SEED+i, so SEED=<a run's seed> RUNS=1 reruns that
# run), how many runs (MIN_KILLS goes on until that many kills), and per run
# the kills at random moments, faults, operator actions and the schedule's span;
# RERUN=false does not run a run that found violations again from its seed.
SEED ?= 0
RUNS ?= 10
MIN_KILLS ?= 0
KILLS ?= 3
FAULTS ?= 6
ACTIONS ?= 6
SPAN ?= 12s
RERUN ?= true

.PHONY: all build generate test bench chaos lint envtest-assets clean sandbox demo demo-recovery test-recovery-demo image dist release

all: build

build: ## Build every binary into bin/.
	@mkdir -p $(BIN)
	@for d in controller plugin; do \
	  if [ -f $$d/main.go ]; then go build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./$$d; fi; \
	done
	@[ ! -f $(BIN)/plugin ] || mv $(BIN)/plugin $(BIN)/kubectl-ichor
	@[ ! -f $(BIN)/controller ] || mv $(BIN)/controller $(BIN)/ichor-controller

$(CONTROLLER_GEN): hack/tools/go.mod hack/tools/go.sum
	@mkdir -p $(BIN)
	cd hack/tools && go build -o $(CONTROLLER_GEN) sigs.k8s.io/controller-tools/cmd/controller-gen

generate: $(CONTROLLER_GEN) ## Regenerate deepcopy and the CRD.
	hack/generate.sh $(CONTROLLER_GEN) $(CURDIR)

envtest-assets: ## Build kube-apiserver and etcd from source (cached) and print their directory.
	@hack/envtest-assets.sh

test: $(CONTROLLER_GEN) ## Run every test against a real API server and simulated Talos machines.
	@assets=$$(hack/envtest-assets.sh); \
	KUBEBUILDER_ASSETS=$$assets CONTROLLER_GEN=$(CONTROLLER_GEN) GOMAXPROCS=$(TEST_GOMAXPROCS) GOGC=$(TEST_GOGC) GOFLAGS="$(TEST_GOFLAGS)" go test $(TEST_FLAGS) $(PKGS)

# Each benchmark in a process of its own, one at a time (hack/bench.sh).
bench: ## Run the benchmarks and print each figure beside its budget as a ratio (hack/bench-summary.sh).
	@assets=$$(hack/envtest-assets.sh); \
	KUBEBUILDER_ASSETS=$$assets hack/bench.sh | hack/bench-summary.sh

chaos: ## Run the seeded fault campaign (kills, Talos faults, operator actions) and print its report; 0 violations or it fails.
	@assets=$$(hack/envtest-assets.sh); \
	KUBEBUILDER_ASSETS=$$assets go test -count=1 -timeout 4h -v -run '^TestCampaign$$' ./internal/chaos -args \
	  -chaos.campaign -chaos.seed=$(SEED) -chaos.runs=$(RUNS) -chaos.min-kills=$(MIN_KILLS) \
	  -chaos.kills=$(KILLS) -chaos.faults=$(FAULTS) -chaos.actions=$(ACTIONS) -chaos.span=$(SPAN) -chaos.rerun=$(RERUN)

lint: ## go vet and a gofmt check.
	go vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "not gofmt-formatted:"; echo "$$out"; exit 1; fi

sandbox: build ## Run Ichor on this machine until Ctrl-C: API server, simulated Talos machines, controller.
	@assets=$$(hack/envtest-assets.sh); \
	go build -ldflags "$(LDFLAGS)" -o $(BIN)/ichor-sandbox ./hack/sandbox; \
	KUBEBUILDER_ASSETS=$$assets exec $(BIN)/ichor-sandbox $(SANDBOX_FLAGS)

demo: build ## The sandbox and a scripted walk-through with kubectl ichor; exits 0 only if every step behaved.
	@assets=$$(hack/envtest-assets.sh); \
	go build -ldflags "$(LDFLAGS)" -o $(BIN)/ichor-sandbox ./hack/sandbox; \
	KUBEBUILDER_ASSETS=$$assets exec $(BIN)/ichor-sandbox --demo --plugin-dir $(BIN) $(SANDBOX_FLAGS)

test-recovery-demo: $(CONTROLLER_GEN) ## TestRecoveryDemo alone, as make test runs it (about 2 minutes).
	@assets=$$(hack/envtest-assets.sh); \
	KUBEBUILDER_ASSETS=$$assets GOFLAGS="$(TEST_GOFLAGS)" go test -count=1 -timeout 20m -run '^TestRecoveryDemo$$' ./hack/sandbox

demo-recovery: build ## The sandbox and a second walk-through: an etcd restore and a whole-cluster shutdown, followed through the API's absence.
	@assets=$$(hack/envtest-assets.sh); \
	go build -ldflags "$(LDFLAGS)" -o $(BIN)/ichor-sandbox ./hack/sandbox; \
	KUBEBUILDER_ASSETS=$$assets exec $(BIN)/ichor-sandbox --demo=recovery --plugin-dir $(BIN) $(SANDBOX_FLAGS)

image: ## Build the controller image $(IMAGE):$(VERSION) with docker or podman (not in the tests: no engine runs here).
	@command -v $(CONTAINER_ENGINE) >/dev/null || { echo "make image needs a container engine: install docker, or run with CONTAINER_ENGINE=podman"; exit 1; }
	DOCKER_BUILDKIT=1 $(CONTAINER_ENGINE) build --build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION) .

dist: ## Cross-build kubectl-ichor archives and checksums into dist/, render krew/ichor.yaml, check both with krew.
	@tools=$$(hack/krew-tools.sh); rm -rf dist; \
	go run ./hack/dist -version $(VERSION) -out dist -mtime $(SOURCE_DATE_EPOCH) -krew-tools $$tools

release: ## Check the version and print the steps of a release (make release VERSION=vX.Y.Z).
	@hack/release.sh $(VERSION)

clean: ## Remove build output (the envtest cache outside the checkout stays).
	rm -rf $(BIN) dist .ichor-sandbox
