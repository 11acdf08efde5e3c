package operation_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/utils/ptr"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// leaseHistory records every holder the cluster lock Lease has had, in the
// order the API server changed it (a watch from the Lease's first revision).
type leaseHistory struct {
	mu      sync.Mutex
	changes []leaseChange
}

// leaseChange is a new holder ("" for a free lock) and when the watch saw it.
type leaseChange struct {
	holder string
	at     time.Time
}

func (c *cluster) watchLease() *leaseHistory {
	c.t.Helper()
	h := &leaseHistory{}
	ctx, cancel := context.WithCancel(context.Background())
	c.t.Cleanup(cancel)
	w, err := env.Kube.CoordinationV1().Leases(c.ctrlNS).Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", ichorv1.LockLeaseName).String()})
	if err != nil {
		c.t.Fatal(err)
	}
	go func() {
		for ev := range w.ResultChan() {
			if l, ok := ev.Object.(*coordinationv1.Lease); ok {
				h.mu.Lock()
				if holder := ptr.Deref(l.Spec.HolderIdentity, ""); len(h.changes) == 0 || h.changes[len(h.changes)-1].holder != holder {
					h.changes = append(h.changes, leaseChange{holder, time.Now()})
				}
				h.mu.Unlock()
			}
		}
	}()
	return h
}

func (c leaseChange) String() string {
	return orNobody(c.holder) + " at " + c.at.Format("15:04:05.000")
}

// since returns the changes from the first time want took the lock on.
func (h *leaseHistory) since(want string) []leaseChange {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, c := range h.changes {
		if c.holder == want {
			return append([]leaseChange(nil), h.changes[i:]...)
		}
	}
	return nil
}

func (c *cluster) waitForNode(name, what string, cond func(*corev1.Node) bool) {
	c.t.Helper()
	testenv.Eventually(c.t, time.Minute, name+" "+what, func(ctx context.Context) (bool, error) {
		n := &corev1.Node{}
		err := env.Client.Get(ctx, keyOfNode(name), n)
		if apierrors.IsNotFound(err) {
			return cond(nil), nil
		}
		return err == nil && cond(n), err
	})
}

// hangEtcdCheck makes the etcd health check before a control plane's
// disruption hang until the returned func is called.
func hangEtcdCheck(f *sim.Fleet) (release func()) {
	return f.ControlPlanes()[0].Inject(sim.Fault{Kind: sim.FaultHang, Method: "EtcdAlarmList"})
}

func atStep(machine, step string) func(*ichorv1.TalosOperation) bool {
	return func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, machine)
		return m != nil && m.Phase == ichorv1.MachineInProgress && m.Step == step
	}
}

func waitingFor(holder string) func(*ichorv1.TalosOperation) bool {
	return func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == holder
	}
}

// TestResetKeepsItsLock: a control-plane reset holds the lock as the
// machine until it has settled. Its own cordon (a change of a Ready, joined
// control-plane Node) must not let the membership reconciler free it, or the
// older operation waiting for it would run in the middle of the reset.
func TestResetKeepsItsLock(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 1))
	cp, w := c.fleet.ControlPlanes()[2].Name(), c.fleet.Machines()[3].Name()
	clearFault := c.fleet.Machine(w).Inject(sim.Fault{Kind: sim.FaultError, Method: "Reboot", Code: codes.Internal})
	history := c.watchLease()
	c.start()
	// An older operation that failed: the reset takes the lock over from it.
	c.create("a-reboot", rebootSpec(w))
	c.waitFor("a-reboot", "to fail", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	release := hangEtcdCheck(c.fleet)
	c.create("reset", nodeSpec(cp, ichorv1.NodeReset))
	c.waitFor("reset", "to hold the lock, in its etcd check", time.Minute, atStep(cp, "etcd-health"))
	// The older operation is retried; it waits for the reset.
	clearFault()
	c.kubectl("annotate", "talosoperation", "a-reboot", ichorv1.RetryAnnotation+"=true")
	c.waitFor("a-reboot", "to wait for the reset", time.Minute, waitingFor(ichorv1.MachineIdentity(cp)))
	release()
	c.waitSucceeded("reset", time.Minute)
	c.waitSucceeded("a-reboot", time.Minute)
	var reset time.Time
	for _, act := range c.fleet.Recorder().Actions(cp) {
		if act.Kind == sim.ActionReset {
			reset = act.Start
		}
	}
	got := history.since(ichorv1.MachineIdentity(cp))
	if reset.IsZero() || len(got) < 2 || got[1].at.Before(reset) {
		t.Errorf("the reset's lock changed hands (%v) before its Reset call (%s)", got, reset.Format("15:04:05.000"))
	}
}

// TestTwoResetsOfOneControlPlane: both take the lock under the machine's
// identity; the second must wait for the first, not believe it holds it.
func TestTwoResetsOfOneControlPlane(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 1))
	cp := c.fleet.ControlPlanes()[2].Name()
	release := hangEtcdCheck(c.fleet)
	defer release()
	c.start()
	c.create("reset-1", nodeSpec(cp, ichorv1.NodeReset))
	c.waitFor("reset-1", "to hold the lock, in its etcd check", time.Minute, atStep(cp, "etcd-health"))
	c.create("reset-2", nodeSpec(cp, ichorv1.NodeReset))
	c.waitFor("reset-2", "to wait for reset-1", time.Minute, waitingFor(ichorv1.MachineIdentity(cp)))
	if m := entryOf(c.get("reset-2"), cp); m == nil || m.Phase != ichorv1.MachinePending {
		t.Errorf("reset-2 started on %s while reset-1 held the lock: %+v", cp, m)
	}
}

// TestResetAndRemovalOfOneNode: a removal of the control plane being reset
// waits for the reset, and its end (the Node gone) does not free the lock
// the reset holds.
func TestResetAndRemovalOfOneNode(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, sim.Cluster("", 3, 1))
	cp := c.fleet.ControlPlanes()[2].Name()
	release := hangEtcdCheck(c.fleet)
	defer release()
	history := c.watchLease()
	c.start()
	c.create("reset", nodeSpec(cp, ichorv1.NodeReset))
	c.waitFor("reset", "to hold the lock, in its etcd check", time.Minute, atStep(cp, "etcd-health"))
	c.patchNode(cp, `{"metadata":{"finalizers":["test.ichor.maesh.dev/hold"]}}`)
	if err := env.Client.Delete(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: cp}}); err != nil {
		t.Fatal(err)
	}
	c.waitForNode(cp, "to be marked for deletion", func(n *corev1.Node) bool { return n != nil && !n.DeletionTimestamp.IsZero() })
	c.patchNode(cp, `{"metadata":{"finalizers":null}}`)
	c.waitForNode(cp, "to be gone", func(n *corev1.Node) bool { return n == nil })
	c.create("b-reboot", rebootSpec(c.fleet.Machines()[3].Name()))
	c.waitFor("b-reboot", "to wait for the reset", time.Minute, waitingFor(ichorv1.MachineIdentity(cp)))
	if got := history.since(ichorv1.MachineIdentity(cp)); len(got) != 1 {
		t.Errorf("the lock the reset holds changed hands while it ran: %v", got)
	}
}
