#!/usr/bin/env bash
# Prints the version `make` stamps into both binaries: `git describe` of the
# newest release tag (v0.1.0 on the tag, v0.1.0-3-gabc1234 after it, -dirty
# with uncommitted changes), or v0.0.0-g<commit>[-dirty] before the first
# tag. Each is a semantic version with its v, as krew's manifest needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if v=$(git describe --tags --match 'v[0-9]*' --dirty 2>/dev/null); then
  echo "$v"
elif c=$(git rev-parse --short HEAD 2>/dev/null); then
  dirty=""
  git diff --quiet HEAD -- 2>/dev/null || dirty="-dirty"
  echo "v0.0.0-g$c$dirty"
else
  echo "v0.0.0-dev"
fi
