package operation_test

import (
	"context"
	"strings"
	"testing"
	"time"

	machineapi "github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/membership"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func (c *cluster) waitLockHolder(want string) {
	c.t.Helper()
	testenv.Eventually(c.t, time.Minute, "the lock to be held by "+orNobody(want), func(context.Context) (bool, error) {
		return c.lockHolder().Holder.Identity == want, nil
	})
}

// waitBaseline waits until the membership reconciler has marked the
// control planes of the cluster it first ran in as joined: a Node created
// after that can be a join.
func (c *cluster) waitBaseline() {
	c.t.Helper()
	testenv.Eventually(c.t, time.Minute, "the membership baseline", func(context.Context) (bool, error) {
		return c.lockHolder().Baseline != "", nil
	})
}

func orNobody(s string) string {
	if s == "" {
		return "nobody"
	}
	return s
}

func controlPlaneNode(name string, finalizers ...string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: finalizers,
		Labels: map[string]string{ichorv1.ControlPlaneLabel: ""}}}
}

func setReady(t *testing.T, n *corev1.Node) {
	t.Helper()
	// The node-lifecycle controller writes Node status too: write on the latest.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := env.Client.Get(context.Background(), client.ObjectKeyFromObject(n), n); err != nil {
			return err
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
		return env.Client.Status().Update(context.Background(), n)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestControlPlaneJoin: a control plane that has never been Ready holds the
// cluster lock under its own identity until it is; operations wait.
func TestControlPlaneJoin(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	c.start()
	c.waitBaseline()
	joining := controlPlaneNode(c.ns + "-new-cp")
	if err := env.Client.Create(context.Background(), joining); err != nil {
		t.Fatal(err)
	}
	id := ichorv1.MachineIdentity(joining.Name)
	c.waitLockHolder(id)
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitFor("reboot", "to wait for the join", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	})
	setReady(t, joining)
	c.waitSucceeded("reboot", time.Minute)
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(joining.Name), n); err != nil || n.Annotations[membership.JoinedAnnotation] != "true" {
		t.Errorf("joined annotation %q (%v)", n.Annotations[membership.JoinedAnnotation], err)
	}
}

// TestControlPlaneDownAtInstall: a control plane that is NotReady when Ichor
// first runs in the cluster (down for maintenance) predates it: it is not a
// join, is marked joined, and an operation on another machine runs.
func TestControlPlaneDownAtInstall(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	down := controlPlaneNode(c.ns + "-down-cp")
	if err := env.Client.Create(context.Background(), down); err != nil {
		t.Fatal(err)
	}
	c.start()
	c.waitBaseline()
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitSucceeded("reboot", time.Minute)
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(down.Name), n); err != nil || n.Annotations[membership.JoinedAnnotation] != "true" {
		t.Errorf("joined annotation %q (%v)", n.Annotations[membership.JoinedAnnotation], err)
	}
}

// TestControlPlaneRemoval: a control-plane Node being deleted holds the lock
// until it is gone (and etcd, which never had a member for it, agrees).
func TestControlPlaneRemoval(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	c.start()
	c.waitBaseline()
	leaving := controlPlaneNode(c.ns+"-old-cp", "test.ichor.maesh.dev/hold")
	if err := env.Client.Create(context.Background(), leaving); err != nil {
		t.Fatal(err)
	}
	setReady(t, leaving)
	id := ichorv1.MachineIdentity(leaving.Name)
	testenv.Eventually(t, time.Minute, "the control plane to be marked joined", func(ctx context.Context) (bool, error) {
		n := &corev1.Node{}
		err := env.Client.Get(ctx, keyOfNode(leaving.Name), n)
		return err == nil && n.Annotations[membership.JoinedAnnotation] == "true", err
	})
	c.waitLockHolder("")
	if err := env.Client.Delete(context.Background(), leaving); err != nil {
		t.Fatal(err)
	}
	c.waitLockHolder(id)
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitFor("reboot", "to wait for the removal", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	})
	c.patchNode(leaving.Name, `{"metadata":{"finalizers":null}}`)
	c.waitSucceeded("reboot", time.Minute)
}

// TestControlPlaneDeletedOutright: a control-plane Node without finalizers
// deleted outright (kubectl delete node) while etcd still lists its member
// holds the lock as the machine, across a restart of the controller, until
// the member is removed; then the waiting operations run.
func TestControlPlaneDeletedOutright(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 1))
	ctl := c.start()
	c.waitBaseline()
	cps, worker := c.fleet.ControlPlanes(), c.fleet.Machines()[3]
	leaving := cps[2]
	if err := env.Client.Delete(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: leaving.Name()}}); err != nil {
		t.Fatal(err)
	}
	id := ichorv1.MachineIdentity(leaving.Name())
	c.waitLockHolder(id)
	c.create("reboot", rebootSpec(worker.Name()))
	waiting := func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	}
	c.waitFor("reboot", "to wait for the removal", time.Minute, waiting)
	testenv.Eventually(t, time.Minute, "the Lease to say what etcd says", func(context.Context) (bool, error) {
		rs := c.lockHolder().Removals
		return len(rs) == 1 && strings.Contains(rs[0].Etcd, "etcd still lists member "+leaving.Name()), nil
	})

	ctl.Stop()
	c.start()
	// An operation created now is judged by the new controller alone.
	c.create("reboot-again", rebootSpec(worker.Name()))
	c.waitFor("reboot-again", "to wait for the removal after the restart", time.Minute, waiting)
	if op := c.get("reboot"); op.Status.StartTime != nil {
		t.Fatalf("reboot started while etcd still lists %s: %s", leaving.Name(), op.Status.Message)
	}

	removeMember(t, c.fleet, cps[0], leaving)
	c.waitSucceeded("reboot", 2*time.Minute)
	c.waitSucceeded("reboot-again", 2*time.Minute)
	// The first reboot may be taken over once completed; the removal never.
	if st := c.lockHolder(); len(st.Removals) != 0 || strings.Contains(st.TakenOverFrom, id) {
		t.Errorf("removals %+v, taken over from %q", st.Removals, st.TakenOverFrom)
	}
}

// removeMember removes m's etcd member through the control plane via, as
// an operator with talosctl etcd remove-member would.
func removeMember(t *testing.T, f *sim.Fleet, via, m *sim.Machine) {
	t.Helper()
	var id uint64
	for _, mem := range f.Etcd().Members {
		if mem.Name == m.Name() {
			id = mem.ID
		}
	}
	if id == 0 {
		t.Fatalf("etcd lists no member for %s", m.Name())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tc, err := talosclient.New(ctx, talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	if err := tc.EtcdRemoveMemberByID(talosclient.WithNode(ctx, via.Address()), &machineapi.EtcdRemoveMemberByIDRequest{MemberId: id}); err != nil {
		t.Fatal(err)
	}
}
