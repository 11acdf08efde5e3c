//go:build tools

// Package tools pins the krew binaries hack/krew.sh builds from this module.
package tools

import (
	_ "sigs.k8s.io/krew/cmd/krew"
	_ "sigs.k8s.io/krew/cmd/validate-krew-manifest"
)
