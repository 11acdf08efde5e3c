#!/usr/bin/env bash
# `make release VERSION=vX.Y.Z`: checks what can be checked before a release
# and prints the steps a maintainer follows. It changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-}
image=ghcr.io/maesh-dev/ichor-controller
repo=https://github.com/maesh-dev/ichor
final='^v[0-9]+\.[0-9]+\.[0-9]+$'

if [[ ! $version =~ $final ]]; then
  echo "make release needs the final version being released: make release VERSION=v0.2.0 (got '${version}')." >&2
  echo "The steps below use vX.Y.Z for it." >&2
  version=vX.Y.Z
else
  tag=$(sed -n 's/^[[:space:]]*newTag:[[:space:]]*//p' manifests/controller/kustomization.yaml)
  if [[ $tag != "$version" ]]; then
    echo "manifests/controller/kustomization.yaml sets the controller image tag '$tag', not $version:" >&2
    echo "set 'newTag: $version' there and commit it before tagging, so that 'kubectl apply -k manifests'" >&2
    echo "at the tag installs the image of the release." >&2
    exit 1
  fi
  if [[ $(git describe --tags --exact-match --dirty 2>/dev/null || true) != "$version" ]]; then
    echo "note: HEAD is not (cleanly) tagged $version yet: step 1 first." >&2
  fi
fi

cat <<STEPS
Releasing Ichor $version

 1. Tag the release commit (manifests/controller/kustomization.yaml already names $image:$version):
      git tag -a $version -m "Ichor $version" && git push origin $version

 2. Build the plugin archives, their checksums and the krew manifest, and check them with krew
    (validate-krew-manifest, then a krew install of every archive served from loopback):
      make dist VERSION=$version
    -> dist/kubectl-ichor_${version}_{linux,darwin}_{amd64,arm64}.tar.gz, dist/kubectl-ichor_${version}_windows_{amd64,arm64}.zip,
       dist/checksums.txt, krew/ichor.yaml

 3. Build and push the controller image for both architectures:
      docker buildx build --platform linux/amd64,linux/arm64 --build-arg VERSION=$version -t $image:$version --push .

 4. Upload the archives and checksums as the GitHub release (the URIs in krew/ichor.yaml point there):
      gh release create $version dist/kubectl-ichor_${version}_* dist/checksums.txt --title "Ichor $version" --generate-notes
    Then check a download against its sum: kubectl krew install --manifest=krew/ichor.yaml (it downloads and verifies).

 5. Open the krew-index pull request: copy krew/ichor.yaml to plugins/ichor.yaml in a fork of
    kubernetes-sigs/krew-index and open a PR ("ichor: $version"); its CI runs the same validate-krew-manifest.

 6. Commit the rendered manifest to main as the record of the release:
      git add krew/ichor.yaml && git commit -m "krew: ichor.yaml for $version"

Installing the release: kubectl apply -k '$repo//manifests?ref=$version', then kubectl krew install ichor.
STEPS
