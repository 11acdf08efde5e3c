#!/usr/bin/env bash
# Builds the control plane of the test world from source, into a cache
# directory outside the checkout keyed by the versions, and prints that
# directory: kube-apiserver, kube-controller-manager and kube-scheduler from
# k8s.io/kubernetes (hack/envtest/apiserver), etcd and etcdutl from etcd
# (hack/envtest/etcd). Binaries already in the cache are kept, so a cache
# from before a binary was added only gains the missing one. When all are
# there it only prints the directory, so
#   KUBEBUILDER_ASSETS=$(make -s envtest-assets)
# costs nothing after the first build (cold, on 2 cores: about 20 minutes;
# see the README).
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${ICHOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ichor}
dir="$cache_root/envtest/k8s-$K8S_VERSION-etcd-$ETCD_VERSION"
binaries=(etcd etcdutl kube-apiserver kube-controller-manager kube-scheduler)

have_all() {
  local b
  for b in "${binaries[@]}"; do [[ -x "$dir/$b" ]] || return 1; done
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

minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
stamp="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"

# build NAME OUT builds one binary into OUT/NAME.
build() {
  case $1 in
    etcd) (cd "$here/envtest/etcd" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$2/etcd" go.etcd.io/etcd/server/v3) ;;
    etcdutl) (cd "$here/envtest/etcd" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$2/etcdutl" go.etcd.io/etcd/etcdutl/v3) ;;
    kube-*) (cd "$here/envtest/apiserver" && go build -mod=mod -trimpath -ldflags "$stamp" -o "$2/$1" "k8s.io/kubernetes/cmd/$1") ;;
  esac
}

tmp=$(mktemp -d "$cache_root/envtest/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dir"
for b in "${binaries[@]}"; do
  [[ -x "$dir/$b" ]] && continue
  echo "building $b ($K8S_VERSION, etcd $ETCD_VERSION) into $dir" >&2
  start=$SECONDS
  build "$b" "$tmp" >&2
  echo "built $b in $((SECONDS - start))s" >&2
  # One rename per binary: a reader that does not take the lock sees it whole or not at all.
  mv "$tmp/$b" "$dir/$b"
done
"$dir/kube-apiserver" --version >&2
echo "$dir"
