#!/usr/bin/env bash
# Builds kube-apiserver and etcd from source for the integration tests, into a
# cache directory outside the checkout keyed by their versions, and prints that
# directory; beside them clusterrole-aggregator, kube-controller-manager's
# ClusterRole aggregation controller (hack/envtest/apiserver/clusterrole-aggregator).
# When the binaries are already there it only prints it, so
#   KUBEBUILDER_ASSETS=$(make -s envtest-assets)
# costs nothing after the first (about 13 minutes on 2 cores) build.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${ICHOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ichor}
dir="$cache_root/envtest/k8s-$K8S_VERSION-etcd-$ETCD_VERSION"

have_all() { [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" && -x "$dir/clusterrole-aggregator" ]]; }
build_aggregator() {
  (cd "$here/envtest/apiserver" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$1/clusterrole-aggregator" ./clusterrole-aggregator) >&2
}

if have_all; then
  echo "$dir"
  exit 0
fi

mkdir -p "$cache_root/envtest"
# Two builds at once (make -j, a second shell) would race on the same files.
exec 9>"$cache_root/envtest/.lock"
flock 9
if have_all; then
  echo "$dir"
  exit 0
fi
if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
  # A cache from before clusterrole-aggregator: add it (seconds once
  # kube-apiserver's packages are in the Go build cache).
  tmp=$(mktemp -d "$cache_root/envtest/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  build_aggregator "$tmp"
  mv "$tmp/clusterrole-aggregator" "$dir/"
  echo "$dir"
  exit 0
fi

tmp=$(mktemp -d "$cache_root/envtest/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
stamp="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"

echo "building kube-apiserver $K8S_VERSION and etcd $ETCD_VERSION into $dir (cold: about 13 minutes)" >&2
(cd "$here/envtest/etcd" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3) >&2
(cd "$here/envtest/apiserver" && go build -mod=mod -trimpath -ldflags "$stamp" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver) >&2
build_aggregator "$tmp"
"$tmp/kube-apiserver" --version >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
