#!/usr/bin/env bash
# Builds krew (as kubectl-krew, the name kubectl runs it by) and krew's
# validate-krew-manifest from the tool module hack/krew, into a cache
# directory outside the checkout keyed by krew's version, and prints that
# directory. When they are already there it only prints it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
version=$(cd "$here/krew" && go list -m -f '{{.Version}}' sigs.k8s.io/krew)
cache_root=${ICHOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ichor}
dir="$cache_root/krew/$version"

have_all() { [[ -x "$dir/kubectl-krew" && -x "$dir/validate-krew-manifest" ]]; }
if have_all; then
  echo "$dir"
  exit 0
fi
mkdir -p "$cache_root/krew"
exec 9>"$cache_root/krew/.lock"
flock 9
if have_all; then
  echo "$dir"
  exit 0
fi
tmp=$(mktemp -d "$cache_root/krew/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building krew $version and validate-krew-manifest into $dir" >&2
(
  cd "$here/krew"
  go build -trimpath -ldflags "-s -w" -o "$tmp/kubectl-krew" sigs.k8s.io/krew/cmd/krew
  go build -trimpath -ldflags "-s -w" -o "$tmp/validate-krew-manifest" sigs.k8s.io/krew/cmd/validate-krew-manifest
) >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
