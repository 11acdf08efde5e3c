//go:build tools

// Package tools pins the main packages `make envtest-assets` builds from
// k8s.io/kubernetes: kube-apiserver, kube-controller-manager and
// kube-scheduler.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
