package sim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestEtcd: member list (fanned out), status, alarms, defragment, forfeit,
// remove and leave, the legacy upgrade's etcd checks, and quorum.
func TestEtcd(t *testing.T) {
	f := start(t, fleetSpec(t, 3, 1))
	cps := f.ControlPlanes()
	w := f.Machines()[3]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	cpAddrs := []string{cps[0].Address(), cps[1].Address(), cps[2].Address()}

	// The health-check recipe: every node reports the same members, whose
	// peer URLs are control-plane addresses.
	list, err := c.EtcdMemberList(client.WithNodes(ctx, cpAddrs...), &machine.EtcdMemberListRequest{})
	if err != nil || len(list.Messages) != 3 {
		t.Fatalf("member list: %v, %v", list, err)
	}
	ids := map[uint64]string{}
	for _, msg := range list.Messages {
		if len(msg.Members) != 3 {
			t.Fatalf("%s lists %d members", msg.Metadata.Hostname, len(msg.Members))
		}
		for _, mem := range msg.Members {
			u, err := url.Parse(mem.PeerUrls[0])
			if err != nil || !contains(cpAddrs, u.Hostname()) || mem.IsLearner {
				t.Fatalf("member %v", mem)
			}
			ids[mem.Id] = mem.Hostname
		}
	}
	if len(ids) != 3 {
		t.Fatalf("members disagree: %v", ids)
	}
	leaders := map[uint64]bool{}
	for _, cp := range cps {
		st := etcdStatus(t, c, cp)
		if st.Leader == 0 || len(st.Errors) > 0 || ids[st.MemberId] != cp.Name() {
			t.Fatalf("%s status %v", cp.Name(), st)
		}
		leaders[st.Leader] = true
	}
	if len(leaders) != 1 {
		t.Fatalf("members see different leaders: %v", leaders)
	}

	// etcd calls exist on control planes only.
	_, err = c.EtcdStatus(client.WithNode(ctx, w.Address()))
	wantCode(t, err, codes.Unimplemented, "only available on control plane nodes")
	_, err = c.EtcdDefragment(client.WithNode(ctx, w.Address()))
	wantCode(t, err, codes.Unimplemented, "only available on control plane nodes")

	if _, err := c.EtcdDefragment(client.WithNode(ctx, cps[0].Address())); err != nil {
		t.Fatal(err)
	}
	if st := etcdStatus(t, c, cps[0]); st.DbSize != st.DbSizeInUse {
		t.Fatalf("after defragment db %d in use %d", st.DbSize, st.DbSizeInUse)
	}

	// Forfeit: a follower keeps nothing to give; the leader hands over.
	var leader, follower *sim.Machine
	for _, cp := range cps {
		if cp.Name() == f.Etcd().Leader {
			leader = cp
		} else {
			follower = cp
		}
	}
	resp, err := c.EtcdForfeitLeadership(client.WithNode(ctx, follower.Address()), &machine.EtcdForfeitLeadershipRequest{})
	if err != nil || resp.Messages[0].Member != "" {
		t.Fatalf("forfeit on a follower: %v, %v", resp, err)
	}
	resp, err = c.EtcdForfeitLeadership(client.WithNode(ctx, leader.Address()), &machine.EtcdForfeitLeadershipRequest{})
	if err != nil || resp.Messages[0].Member == "" || resp.Messages[0].Member == leader.Name() || f.Etcd().Leader != resp.Messages[0].Member {
		t.Fatalf("forfeit on the leader %s: %v, %v; leader now %s", leader.Name(), resp, err, f.Etcd().Leader)
	}

	// Alarms.
	clearAlarm := cps[1].Inject(sim.Fault{Kind: sim.FaultEtcdAlarm})
	alarms, err := c.EtcdAlarmList(client.WithNode(ctx, cps[0].Address()))
	if err != nil || len(alarms.Messages[0].MemberAlarms) != 1 || alarms.Messages[0].MemberAlarms[0].Alarm != machine.EtcdMemberAlarm_NOSPACE ||
		ids[alarms.Messages[0].MemberAlarms[0].MemberId] != cps[1].Name() {
		t.Fatalf("alarms: %v, %v", alarms, err)
	}
	if st := etcdStatus(t, c, cps[1]); len(st.Errors) == 0 {
		t.Fatal("the alarmed member reports no error")
	}
	if _, err := c.EtcdAlarmDisarm(client.WithNode(ctx, cps[0].Address())); err != nil {
		t.Fatal(err)
	}
	if alarms, _ := c.EtcdAlarmList(client.WithNode(ctx, cps[0].Address())); len(alarms.Messages[0].MemberAlarms) != 0 {
		t.Fatalf("alarms after disarm: %v", alarms)
	}
	clearAlarm()

	// An unhealthy member fails the legacy upgrade's check, unless forced.
	clearUnhealthy := cps[2].Inject(sim.Fault{Kind: sim.FaultEtcdUnhealthy})
	if st := etcdStatus(t, c, cps[2]); len(st.Errors) == 0 || st.Leader != 0 {
		t.Fatalf("unhealthy member status %v", st)
	}
	image := client.WithUpgradeImage("ghcr.io/siderolabs/installer:v1.12.5")
	_, err = c.UpgradeWithOptions(client.WithNode(ctx, cps[0].Address()), image)
	if err == nil || !strings.Contains(err.Error(), "is not healthy; all members must be healthy to perform an upgrade") {
		t.Fatalf("upgrade with an unhealthy member: %v", err)
	}
	if cps[0].Down() || len(f.Recorder().Actions(cps[0].Name())) > 0 {
		t.Fatal("a refused upgrade started anyway")
	}
	before := cps[0].BootID()
	if _, err := c.UpgradeWithOptions(client.WithNode(ctx, cps[0].Address()), image, client.WithUpgradeForce(true)); err != nil {
		t.Fatalf("forced upgrade: %v", err)
	}
	waitRebooted(t, cps[0], before)
	clearUnhealthy()

	err = c.EtcdRemoveMemberByID(client.WithNode(ctx, cps[0].Address()), &machine.EtcdRemoveMemberByIDRequest{MemberId: 12345})
	wantCode(t, err, codes.NotFound, "member not found")

	// Leave: two members left, which the legacy upgrade refuses.
	if err := c.EtcdLeaveCluster(client.WithNode(ctx, cps[2].Address()), &machine.EtcdLeaveClusterRequest{}); err != nil {
		t.Fatal(err)
	}
	if st := f.Etcd(); len(st.Members) != 2 || st.Leader == "" {
		t.Fatalf("after leave: %+v", st)
	}
	if _, err := c.EtcdStatus(client.WithNode(ctx, cps[2].Address())); err == nil {
		t.Fatal("a member that left still answers EtcdStatus")
	}
	_, err = c.UpgradeWithOptions(client.WithNode(ctx, cps[0].Address()), image)
	if err == nil || !strings.Contains(err.Error(), "insufficient to maintain quorum") {
		t.Fatalf("upgrade with two members: %v", err)
	}

	// One of two members down: no quorum, no leader.
	cps[1].Inject(sim.Fault{Kind: sim.FaultNoReturn})
	if err := c.Reboot(client.WithNode(ctx, cps[1].Address())); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "etcd without a leader", func(context.Context) (bool, error) { return f.Etcd().Leader == "", nil })
	_, err = c.EtcdMemberList(client.WithNode(ctx, cps[0].Address()), &machine.EtcdMemberListRequest{})
	wantCode(t, err, codes.Unavailable, "no leader")
}

// TestEtcdRecover: the disaster-recovery flow of TALOS_API.md 1.7 —
// snapshot, members leave, reset, recover and bootstrap; the others join.
func TestEtcdRecover(t *testing.T) {
	f := start(t, fleetSpec(t, 3, 1))
	cps := f.ControlPlanes()
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	at := func(m *sim.Machine) context.Context { return client.WithNode(ctx, m.Address()) }

	rc, err := c.EtcdSnapshot(at(cps[0]), &machine.EtcdSnapshotRequest{})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := io.ReadAll(rc)
	if err != nil || len(snap)%512 != sha256.Size {
		t.Fatalf("snapshot of %d bytes (%v): etcd snapshots end in a SHA-256 after 512-byte blocks", len(snap), err)
	}
	snapRev := f.Etcd().Revision
	for range 3 {
		if err := f.EtcdWrite(); err != nil {
			t.Fatal(err)
		}
	}

	err = c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{})
	wantCode(t, err, codes.AlreadyExists, "etcd data directory is not empty")
	err = c.Bootstrap(at(f.Machines()[3]), &machine.BootstrapRequest{})
	wantCode(t, err, codes.Unimplemented, "")

	for _, cp := range cps[1:] {
		if _, err := c.EtcdForfeitLeadership(at(cp), &machine.EtcdForfeitLeadershipRequest{}); err != nil {
			t.Fatal(err)
		}
		if err := c.EtcdLeaveCluster(at(cp), &machine.EtcdLeaveClusterRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, cp := range cps {
		before := cp.BootID()
		if err := c.ResetGeneric(at(cp), &machine.ResetRequest{
			Reboot: true, SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}},
		}); err != nil {
			t.Fatal(err)
		}
		waitRebooted(t, cp, before)
	}
	if st := f.Etcd(); st.Leader != "" {
		t.Fatalf("etcd has a leader after every member is gone: %+v", st)
	}

	err = c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true})
	wantCode(t, err, codes.FailedPrecondition, "EtcdRecover")
	bad := bytes.Clone(snap)
	bad[0] ^= 0xff
	if _, err := c.EtcdRecover(at(cps[0]), bytes.NewReader(bad)); err != nil {
		t.Fatal(err)
	}
	err = c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true})
	wantCode(t, err, codes.InvalidArgument, "hash mismatch")

	if _, err := c.EtcdRecover(at(cps[0]), bytes.NewReader(snap)); err != nil {
		t.Fatal(err)
	}
	if err := c.Bootstrap(at(cps[0]), &machine.BootstrapRequest{RecoverEtcd: true}); err != nil {
		t.Fatal(err)
	}
	st := f.Etcd()
	var names []string
	for _, m := range st.Members {
		if !m.Healthy {
			t.Fatalf("member %s unhealthy after recovery", m.Name)
		}
		names = append(names, m.Name)
	}
	sort.Strings(names)
	if strings.Join(names, ",") != strings.Join([]string{cps[0].Name(), cps[1].Name(), cps[2].Name()}, ",") || st.Leader != cps[0].Name() {
		t.Fatalf("after recovery: %+v", st)
	}
	if st.Revision != snapRev {
		t.Fatalf("revision %d after recovery, want the snapshot's %d", st.Revision, snapRev)
	}
}

// TestBootstrap: a fleet started unbootstrapped waits for Bootstrap, then
// every control plane joins.
func TestBootstrap(t *testing.T) {
	spec := fleetSpec(t, 3, 0)
	spec.Unbootstrapped = true
	f := start(t, spec)
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	if st := f.Etcd(); len(st.Members) != 0 || st.Leader != "" {
		t.Fatalf("unbootstrapped etcd: %+v", st)
	}
	_, err := c.EtcdMemberList(client.WithNode(ctx, f.ControlPlanes()[0].Address()), &machine.EtcdMemberListRequest{})
	wantCode(t, err, codes.Unavailable, "")
	if err := c.Bootstrap(client.WithNode(ctx, f.ControlPlanes()[1].Address()), &machine.BootstrapRequest{}); err != nil {
		t.Fatal(err)
	}
	if st := f.Etcd(); len(st.Members) != 3 || st.Leader != f.ControlPlanes()[1].Name() {
		t.Fatalf("after bootstrap: %+v", st)
	}
}

func etcdStatus(t *testing.T, c *client.Client, m *sim.Machine) *machine.EtcdMemberStatus {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	resp, err := c.EtcdStatus(client.WithNode(ctx, m.Address()))
	if err != nil {
		t.Fatalf("%s: etcd status: %v", m.Name(), err)
	}
	return resp.Messages[0].MemberStatus
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
