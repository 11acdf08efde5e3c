# syntax=docker/dockerfile:1
# The ichor-controller image: one static binary on a distroless base, run as
# a non-root user. `make image` builds it (docker or podman):
#   docker build --build-arg VERSION=v0.1.0 -t ghcr.io/maesh-dev/ichor-controller:v0.1.0 .
# It needs BuildKit (cache mounts): docker buildx, DOCKER_BUILDKIT=1 or podman.
# It fetches the Cilium chart that api/compat/table.yaml pins (ciliumChart)
# from Cilium's chart repository and checks its digest: the only download
# that is not a Go module. The controller loads it from /charts.
# Multi-arch, as a release does it:
#   docker buildx build --platform linux/amd64,linux/arm64 --build-arg VERSION=v0.1.0 \
#     -t ghcr.io/maesh-dev/ichor-controller:v0.1.0 --push .
ARG GO_VERSION=1.26.5

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build
ARG TARGETOS=linux
ARG TARGETARCH=amd64
ARG VERSION=v0.0.0-dev
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
# Only what the controller is built from (hack/dist's tests check this list).
COPY api/ api/
COPY controller/ controller/
COPY internal/ internal/
COPY manifests/ manifests/
COPY hack/chartpin/ hack/chartpin/
# The pinned chart, by version and digest: hack/chartpin prints its URL,
# digest and file name; a digest that does not match fails the build.
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    set -eu; set -- $(go run ./hack/chartpin); mkdir -p /out/charts; \
    curl -fsSL --retry 3 -o "/out/charts/$3" "$1"; \
    echo "${2#sha256:}  /out/charts/$3" | sha256sum -c -
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -ldflags "-s -w -X maesh.dev/ichor/internal/version.Version=${VERSION}" \
      -o /out/ichor-controller ./controller

# static: no libc, no shell; nonroot: uid and gid 65532.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ichor-controller /ichor-controller
COPY --from=build /out/charts/ /charts/
USER 65532:65532
ENTRYPOINT ["/ichor-controller"]
