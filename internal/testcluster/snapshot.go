package testcluster

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"

	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/sim"
)

// TakeSnapshot writes an etcd snapshot of the machine's member to path,
// taken through the Talos API as talosctl etcd snapshot takes it.
func TakeSnapshot(t testing.TB, c *talosclient.Client, m *sim.Machine, path string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var buf bytes.Buffer
	if err := talos.EtcdSnapshot(ctx, c, m.Address(), &buf); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

// UploadsAfterBootstrap is how long after the Bootstrap machine accepted
// each EtcdRecover upload it accepted later came: none, when a recovery
// uploads before it bootstraps (retrying the upload while Bootstrap is
// refused) and never after.
func UploadsAfterBootstrap(rec *sim.Recorder, machine string) []time.Duration {
	var boots []sim.Call
	for _, c := range rec.Handled(machine, "Bootstrap") {
		if c.Accepted() {
			boots = append(boots, c)
		}
	}
	if len(boots) == 0 {
		return nil
	}
	var late []time.Duration
	for _, u := range rec.Handled(machine, "EtcdRecover") {
		if u.Accepted() && u.At.After(boots[0].At) {
			late = append(late, u.At.Sub(boots[0].At))
		}
	}
	return late
}
