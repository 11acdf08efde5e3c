#!/usr/bin/env bash
# Regenerates deepcopy and the CRD into a tree (the checkout, or a copy of it
# that the idempotency test diffs against the checkout).
set -euo pipefail
gen=$1
root=$2
cd "$root"
"$gen" object:headerFile=hack/boilerplate.go.txt paths=./api/...
"$gen" crd:crdVersions=v1 paths=./api/... output:crd:artifacts:config=manifests/crd
