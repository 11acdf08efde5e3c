package talos

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/resources/v1alpha1"
)

// Shutdown powers the machine off; force skips the drain Talos would do.
func Shutdown(ctx context.Context, c *talosclient.Client, node string, force bool) error {
	if err := c.Shutdown(talosclient.WithNode(ctx, node), talosclient.WithShutdownForce(force)); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}

// ShutdownAll shuts the machines down in one request, its nodes metadata
// naming them all (apid fans MachineService calls out), so that they stop
// together: every control plane at once, whose etcd then stops at once
// instead of losing quorum half way. A machine that refuses fails the
// whole call, naming it.
func ShutdownAll(ctx context.Context, c *talosclient.Client, nodes []string, force bool) error {
	if err := c.Shutdown(talosclient.WithNodes(ctx, nodes...), talosclient.WithShutdownForce(force)); err != nil {
		return fmt.Errorf("shutdown of %s: %w", strings.Join(nodes, ", "), err)
	}
	return nil
}

// Wipe is what a reset wipes.
type Wipe int

// Wipe modes.
const (
	WipeAll Wipe = iota
	WipeSystemDisk
	WipeEphemeral
)

// Reset resets the machine: graceful leaves etcd and drains first (Talos does
// both), reboot brings it back (into maintenance mode) instead of powering off.
func Reset(ctx context.Context, c *talosclient.Client, node string, graceful, reboot bool, wipe Wipe) error {
	req := &machine.ResetRequest{Graceful: graceful, Reboot: reboot}
	switch wipe {
	case WipeSystemDisk:
		req.Mode = machine.ResetRequest_SYSTEM_DISK
	case WipeEphemeral:
		req.SystemPartitionsToWipe = []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}}
	default:
		req.Mode = machine.ResetRequest_ALL
	}
	if err := c.ResetGeneric(talosclient.WithNode(ctx, node), req); err != nil {
		return fmt.Errorf("reset: %w", err)
	}
	return nil
}

// RestartService restarts a service (kubelet or an extension service) and
// waits until it is back running and healthy.
func RestartService(ctx context.Context, c *talosclient.Client, node, id string) error {
	return AcrossRestart(ctx, c, node, id, func(ctx context.Context) error {
		if _, err := c.ServiceRestart(ctx, id); err != nil {
			return fmt.Errorf("restart service %s: %w", id, err)
		}
		return nil
	})
}

// ServiceHealthy reports whether the service id runs and is healthy now
// (its Service resource; none is not healthy).
func ServiceHealthy(ctx context.Context, c *talosclient.Client, node, id string) (bool, error) {
	svc, err := safe.StateGetByID[*v1alpha1.Service](talosclient.WithNode(ctx, node), c.COSI, id)
	if state.IsNotFoundError(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read service %s: %w", id, err)
	}
	return svc.TypedSpec().Running && svc.TypedSpec().Healthy, nil
}

// AcrossRestart runs do, which restarts the service id (a ServiceRestart, or
// a configuration change that restarts it), and waits until its Service
// resource has gone and come back running and healthy, as talosctl's
// rotate-ca helper does. The watch starts before do, so the restart cannot
// be missed.
func AcrossRestart(ctx context.Context, c *talosclient.Client, node, id string, do func(ctx context.Context) error) error {
	ctx = talosclient.WithNode(ctx, node)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := make(chan safe.WrappedStateEvent[*v1alpha1.Service])
	ptr := resource.NewMetadata(v1alpha1.NamespaceName, v1alpha1.ServiceType, id, resource.VersionUndefined)
	if err := safe.StateWatch(ctx, c.COSI, ptr, ch); err != nil {
		return fmt.Errorf("watch service %s: %w", id, err)
	}
	// The watch first reports the current state.
	var before resource.Version
	select {
	case ev := <-ch:
		if r, err := ev.Resource(); err == nil && ev.Type() != state.Destroyed {
			before = r.Metadata().Version()
		}
	case <-ctx.Done():
		return fmt.Errorf("watch service %s: %w", id, ctx.Err())
	}
	if err := do(ctx); err != nil {
		return err
	}
	restarted := false
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("service %s did not come back healthy: %w", id, ctx.Err())
		case ev := <-ch:
			switch ev.Type() {
			case state.Errored:
				return fmt.Errorf("watch service %s: %w", id, ev.Error())
			case state.Destroyed:
				restarted = true
				continue
			}
			r, err := ev.Resource()
			if err != nil {
				return fmt.Errorf("watch service %s: %w", id, err)
			}
			if !r.Metadata().Version().Equal(before) {
				restarted = true
			}
			if spec := r.TypedSpec(); restarted && spec.Running && spec.Healthy {
				return nil
			}
		}
	}
}

// Defragment defragments the local etcd member of a control plane.
func Defragment(ctx context.Context, c *talosclient.Client, node string) error {
	if _, err := c.EtcdDefragment(talosclient.WithNode(ctx, node)); err != nil {
		return fmt.Errorf("etcd defragment: %w", err)
	}
	return nil
}

// ForfeitLeadership moves etcd leadership away from the control plane at
// node and returns the new leader ("" when it was not the leader).
func ForfeitLeadership(ctx context.Context, c *talosclient.Client, node string) (string, error) {
	resp, err := c.EtcdForfeitLeadership(talosclient.WithNode(ctx, node), &machine.EtcdForfeitLeadershipRequest{})
	if err != nil {
		return "", fmt.Errorf("etcd forfeit leadership: %w", err)
	}
	if len(resp.Messages) == 0 {
		return "", errors.New("etcd forfeit leadership: empty answer")
	}
	return resp.Messages[0].Member, nil
}

// IsLeader reports whether the local etcd member at node leads the cluster.
func IsLeader(ctx context.Context, c *talosclient.Client, node string) (bool, error) {
	resp, err := c.EtcdStatus(talosclient.WithNode(ctx, node))
	if err != nil {
		return false, fmt.Errorf("etcd status: %w", err)
	}
	if len(resp.Messages) == 0 || resp.Messages[0].MemberStatus == nil {
		return false, errors.New("etcd status: empty answer")
	}
	st := resp.Messages[0].MemberStatus
	return st.Leader != 0 && st.Leader == st.MemberId, nil
}

// Answers reports whether the machine answers the Talos API within timeout.
func Answers(ctx context.Context, c *talosclient.Client, node string, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, err := Version(ctx, c, node)
	return !Unreachable(err)
}
