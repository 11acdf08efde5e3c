// Package version holds the version stamped into both binaries by `make build`.
package version

// Version is set with -ldflags "-X maesh.dev/ichor/internal/version.Version=...".
var Version = "v0.0.0-dev"
