package talos

import (
	"context"
	"fmt"
	"os"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
)

// LeaveEtcd takes the control plane at node out of etcd: Talos removes
// its member, stops etcd and wipes its data.
func LeaveEtcd(ctx context.Context, c *talosclient.Client, node string) error {
	if err := c.EtcdLeaveCluster(talosclient.WithNode(ctx, node), &machine.EtcdLeaveClusterRequest{}); err != nil {
		return fmt.Errorf("etcd leave on %s: %w", node, err)
	}
	return nil
}

// ResetForRecovery resets every control plane at once, in one call, as
// Talos's recovery flow does: not graceful (etcd is to go, not to be
// left), EPHEMERAL (which holds /var/lib/etcd) wiped, and back with a
// reboot. Resetting them together keeps a control plane from rejoining the
// old cluster before the last one's data is gone.
func ResetForRecovery(ctx context.Context, c *talosclient.Client, nodes []string) error {
	req := &machine.ResetRequest{Reboot: true, Graceful: false,
		SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}}}
	resp, err := c.ResetGenericWithResponse(talosclient.WithNodes(ctx, nodes...), req)
	if _, err := talosclient.FilterMessages(resp, err); err != nil {
		return fmt.Errorf("reset: %w", err)
	}
	return nil
}

// UploadSnapshot sends the snapshot file to node with EtcdRecover, for
// the Bootstrap that recovers from it. Talos refuses with
// FailedPrecondition until /var/lib is there again after a reset.
func UploadSnapshot(ctx context.Context, c *talosclient.Client, node, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open snapshot: %w", err)
	}
	defer f.Close()
	if _, err := c.EtcdRecover(talosclient.WithNode(ctx, node), f); err != nil {
		return fmt.Errorf("etcd recover upload to %s: %w", node, err)
	}
	return nil
}

// BootstrapFromSnapshot starts etcd on node as a new single-member cluster
// restored from the uploaded snapshot.
func BootstrapFromSnapshot(ctx context.Context, c *talosclient.Client, node string) error {
	if err := c.Bootstrap(talosclient.WithNode(ctx, node), &machine.BootstrapRequest{RecoverEtcd: true}); err != nil {
		return fmt.Errorf("bootstrap from the snapshot on %s: %w", node, err)
	}
	return nil
}

// EtcdRestored is the check after a recovery: every control plane is a
// started voter of one cluster, with a leader, no errors and no alarm, as
// EtcdHealth has it (without its rule on two members).
func EtcdRestored(ctx context.Context, c *talosclient.Client, controlPlanes []string) error {
	return etcdHealth(ctx, c, controlPlanes, func(ms []Member) error {
		if len(ms) != len(controlPlanes) {
			return fmt.Errorf("etcd has %d member(s) of %d control planes: %s", len(ms), len(controlPlanes), describe(ms))
		}
		return nil
	})
}
