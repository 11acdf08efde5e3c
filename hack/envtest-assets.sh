#!/usr/bin/env bash
# Builds kube-apiserver and etcd from source for the integration tests, into a
# cache directory outside the checkout keyed by their versions, and prints that
# directory. When both binaries are already there it only prints it, so
#   KUBEBUILDER_ASSETS=$(make -s envtest-assets)
# costs nothing after the first (about 13 minutes on 2 cores) build.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${ICHOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ichor}
dir="$cache_root/envtest/k8s-$K8S_VERSION-etcd-$ETCD_VERSION"

if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
  echo "$dir"
  exit 0
fi

mkdir -p "$cache_root/envtest"
# Two builds at once (make -j, a second shell) would race on the same files.
exec 9>"$cache_root/envtest/.lock"
flock 9
if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
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
"$tmp/kube-apiserver" --version >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
