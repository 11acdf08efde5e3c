package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestHostedEtcdRecover: the disaster-recovery flow of TALOS_API.md 1.7
// against the control planes' real etcd. A snapshot streamed by
// EtcdSnapshot is one etcdutl reads; after three ConfigMaps are created,
// the members leave, every control plane is reset with EPHEMERAL wiped
// (etcd and the API are gone), the snapshot is uploaded and bootstrapped
// from: the API answers again, the ConfigMap from before the snapshot is
// there and the three created after it are gone; the other control plane
// joins.
func TestHostedEtcdRecover(t *testing.T) {
	f, kc := hostedFleet(t, 2)
	cps := f.ControlPlanes()
	c := talos(t, f)
	testenv.CreateConfigMaps(t, kc, "before")

	snap := etcdSnapshot(t, c, cps[0])
	var st struct {
		Revision int64 `json:"revision"`
		TotalKey int   `json:"totalKey"`
	}
	if err := json.Unmarshal(etcdutl(t, snap, "snapshot", "status", "-w", "json"), &st); err != nil || st.Revision == 0 || st.TotalKey == 0 {
		t.Fatalf("etcdutl snapshot status: %+v, %v", st, err)
	}
	testenv.CreateConfigMaps(t, kc, "after0", "after1", "after2")
	if got, err := testenv.ConfigMaps(kc); err != nil || got != "after0,after1,after2,before" {
		t.Fatalf("before the recovery: %q, %v", got, err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	at := func(m *sim.Machine) context.Context { return client.WithNode(ctx, m.Address()) }
	err := c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true})
	wantCode(t, err, codes.AlreadyExists, "etcd data directory is not empty")
	if _, err := c.EtcdForfeitLeadership(at(cps[1]), &machine.EtcdForfeitLeadershipRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := c.EtcdLeaveCluster(at(cps[1]), &machine.EtcdLeaveClusterRequest{}); err != nil {
		t.Fatal(err)
	}
	for _, cp := range cps {
		before := cp.BootID()
		if err := c.ResetGeneric(at(cp), &machine.ResetRequest{
			Reboot: true, SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}},
		}); err != nil {
			t.Fatal(err)
		}
		// The reset stops its kube-apiserver, which may take its 10 s.
		testenv.Eventually(t, 2*time.Minute, cp.Name()+" back with a new boot ID", func(context.Context) (bool, error) {
			return !cp.Down() && cp.BootID() != before, nil
		})
	}
	if f.HostedEtcd().Serving {
		t.Fatal("etcd serves after every member's data was wiped")
	}
	if got, err := testenv.ConfigMaps(kc); err == nil {
		t.Fatalf("with etcd gone the endpoint answers %q", got)
	}

	bad := bytes.Clone(snap)
	bad[len(bad)/2] ^= 0xff
	recoverEtcd(t, c, at(cps[0]), bad)
	err = c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true})
	wantCode(t, err, codes.InvalidArgument, "snapshot")

	recoverEtcd(t, c, at(cps[0]), snap)
	testenv.Eventually(t, time.Minute, "Bootstrap{RecoverEtcd} on "+cps[0].Name(), func(context.Context) (bool, error) {
		err := c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true})
		return err == nil, unless(err, codes.FailedPrecondition, codes.DeadlineExceeded)
	})
	testenv.Eventually(t, 3*time.Minute, "the API back on the snapshot's data", func(context.Context) (bool, error) {
		got, err := testenv.ConfigMaps(kc)
		return err == nil && got == "before", nil
	})
	testenv.Eventually(t, time.Minute, cps[1].Name()+" joined", func(context.Context) (bool, error) {
		st := f.Etcd()
		return len(st.Members) == 2 && st.Members[0].Healthy && st.Members[1].Healthy && st.Leader == cps[0].Name(), nil
	})
}

// recoverEtcd uploads a snapshot with EtcdRecover, retrying while the
// node refuses with FailedPrecondition (not ready for recovery yet), as
// Talos's own recovery test does.
func recoverEtcd(t *testing.T, c *client.Client, ctx context.Context, snap []byte) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "EtcdRecover", func(context.Context) (bool, error) {
		_, err := c.EtcdRecover(ctx, bytes.NewReader(snap))
		return err == nil, unless(err, codes.FailedPrecondition)
	})
}

// unless is err, or nil when its code is one of retry (a refusal to
// try again).
func unless(err error, retry ...codes.Code) error {
	if slices.Contains(retry, client.StatusCode(err)) {
		return nil
	}
	return err
}

// etcdSnapshot streams a snapshot from m, as talosctl etcd snapshot does.
func etcdSnapshot(t *testing.T, c *client.Client, m *sim.Machine) []byte {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	rc, err := c.EtcdSnapshot(client.WithNode(ctx, m.Address()), &machine.EtcdSnapshotRequest{})
	if err != nil {
		t.Fatalf("etcd snapshot on %s: %v", m.Name(), err)
	}
	defer rc.Close()
	snap, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("etcd snapshot on %s: %v", m.Name(), err)
	}
	return snap
}

// etcdutl runs etcdutl (from KUBEBUILDER_ASSETS) on a snapshot file.
func etcdutl(t *testing.T, snap []byte, args ...string) []byte {
	t.Helper()
	path := filepath.Join(t.TempDir(), "etcd.snapshot")
	if err := os.WriteFile(path, snap, 0o600); err != nil {
		t.Fatal(err)
	}
	args = append(args[:2:2], append([]string{path}, args[2:]...)...)
	out, err := exec.Command(filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "etcdutl"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("etcdutl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return out
}
