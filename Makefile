# Ichor's build. `make test` is the one test command (.ci/run calls it).
SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c

BIN := $(CURDIR)/bin
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo v0.0.0-dev)
LDFLAGS := -X maesh.dev/ichor/internal/version.Version=$(VERSION)
CONTROLLER_GEN := $(BIN)/controller-gen
# Integration tests share one API server per package; keep the two cores for them.
TEST_FLAGS ?= -p 2 -timeout 30m
PKGS ?= ./...

.PHONY: all build generate test bench lint envtest-assets clean

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
	KUBEBUILDER_ASSETS=$$assets CONTROLLER_GEN=$(CONTROLLER_GEN) go test $(TEST_FLAGS) $(PKGS)

bench: ## Run the benchmarks and print their ratios against the budgets.
	@assets=$$(hack/envtest-assets.sh); \
	KUBEBUILDER_ASSETS=$$assets go test -run '^$$' -bench . -benchtime 1x -timeout 60m $(PKGS)

lint: ## go vet and a gofmt check.
	go vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "not gofmt-formatted:"; echo "$$out"; exit 1; fi

clean: ## Remove build output (the envtest cache outside the checkout stays).
	rm -rf $(BIN) dist .ichor-sandbox
