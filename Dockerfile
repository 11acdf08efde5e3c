# syntax=docker/dockerfile:1
# The ichor-controller image: one static binary on a distroless base, run as
# a non-root user. `make image` builds it (docker or podman):
#   docker build --build-arg VERSION=v0.1.0 -t ghcr.io/maesh-dev/ichor-controller:v0.1.0 .
# It needs BuildKit (cache mounts): docker buildx, DOCKER_BUILDKIT=1 or podman.
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
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -ldflags "-s -w -X maesh.dev/ichor/internal/version.Version=${VERSION}" \
      -o /out/ichor-controller ./controller

# static: no libc, no shell; nonroot: uid and gid 65532.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ichor-controller /ichor-controller
USER 65532:65532
ENTRYPOINT ["/ichor-controller"]
