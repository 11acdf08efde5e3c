//go:build tools

// Package tools pins the main packages `make envtest-assets` builds from
// etcd v3.6.16: etcd (the root of etcd's server module) and etcdutl (the
// root of its etcdutl module, for snapshot status and restore).
package tools

import (
	_ "go.etcd.io/etcd/etcdutl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
