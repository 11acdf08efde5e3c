//go:build tools

// Package tools pins the tools the Makefile builds from this module.
package tools

import _ "sigs.k8s.io/controller-tools/cmd/controller-gen"
