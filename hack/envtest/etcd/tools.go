//go:build tools

// Package tools pins the etcd main package (the root of etcd's server module).
package tools

import _ "go.etcd.io/etcd/server/v3"
