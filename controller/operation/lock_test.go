package operation_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"google.golang.org/grpc/codes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func (c *cluster) lockHolder() lock.State {
	c.t.Helper()
	st, err := (&lock.Lock{Client: env.Client, Namespace: c.ctrlNS}).Get(context.Background())
	if err != nil {
		c.t.Fatal(err)
	}
	return st
}

func rebootSpec(machine string) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: machine, Action: ichorv1.NodeReboot}}
}

// TestOperationsTakeTurns: three operations written in one go with the
// real kubectl take the cluster lock one after the other, in the order the
// API server created them, which is not the order their names sort in; the
// later ones wait, Paused with ClusterLockHeld naming the holder.
func TestOperationsTakeTurns(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	// A slow enough first operation that the others see it hold the lock.
	cp1, w1, w2 := c.fleet.Machines()[0].Name(), c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	manifest := fmt.Sprintf(`apiVersion: ichor.maesh.dev/v1alpha1
kind: TalosOperation
metadata: {name: z-upgrade, namespace: %[1]s}
spec: {kind: talos, talos: {version: v1.13.7}}
---
apiVersion: ichor.maesh.dev/v1alpha1
kind: TalosOperation
metadata: {name: m-reboot, namespace: %[1]s}
spec: {kind: node, node: {machine: %[2]s, action: reboot}}
---
apiVersion: ichor.maesh.dev/v1alpha1
kind: TalosOperation
metadata: {name: a-reboot, namespace: %[1]s}
spec: {kind: node, node: {machine: %[3]s, action: reboot}}
`, c.ns, w2, cp1)
	path := filepath.Join(t.TempDir(), "ops.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	c.kubectl("apply", "-f", path)

	first := ichorv1.OperationIdentity(c.ns, "z-upgrade")
	for _, name := range []string{"m-reboot", "a-reboot"} {
		op := c.waitFor(name, "to wait for the lock", time.Minute, func(op *ichorv1.TalosOperation) bool {
			return op.Status.Reason == ichorv1.ReasonClusterLockHeld
		})
		if op.Status.Phase != ichorv1.PhasePaused || op.Status.LockHolder != first || op.Status.Lock != ichorv1.LockWaiting {
			t.Errorf("%s: phase %s lock %s holder %q, want Paused, Waiting, %q", name, op.Status.Phase, op.Status.Lock, op.Status.LockHolder, first)
		}
	}
	c.waitFor("z-upgrade", "to hang in its install", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == "install"
	})
	if h := c.lockHolder(); h.Holder.Identity != first {
		t.Errorf("lock held by %s, want %q", h.Holder, first)
	}
	release()
	z := c.waitSucceeded("z-upgrade", time.Minute)
	m := c.waitSucceeded("m-reboot", time.Minute)
	a := c.waitSucceeded("a-reboot", time.Minute)
	if m.Status.StartTime.Before(z.Status.CompletionTime) || a.Status.StartTime.Before(m.Status.CompletionTime) {
		t.Errorf("not one after the other in creation order: z-upgrade done %s, m-reboot %s-%s, a-reboot from %s",
			z.Status.CompletionTime, m.Status.StartTime, m.Status.CompletionTime, a.Status.StartTime)
	}
	// The reboots went in creation order too: m-reboot's before a-reboot's
	// (the last reboot of each machine: z-upgrade rebooted them as well).
	rebooted := func(machine string) time.Time {
		var last time.Time
		for _, act := range c.fleet.Recorder().Actions(machine) {
			if act.Kind == sim.ActionReboot {
				last = act.Start
			}
		}
		if last.IsZero() {
			t.Fatalf("%s was not rebooted", machine)
		}
		return last
	}
	if !rebooted(w2).Before(rebooted(cp1)) {
		t.Errorf("a-reboot (%s) rebooted before m-reboot (%s), which the API server created before it", rebooted(cp1), rebooted(w2))
	}
	if o := c.fleet.Recorder().Overlaps(); len(o) > 0 {
		t.Errorf("disruptive actions overlapped: %+v", o)
	}
	c.waitLockHolder("")
}

func entryOf(op *ichorv1.TalosOperation, name string) *ichorv1.MachineStatus {
	for i := range op.Status.Machines {
		if op.Status.Machines[i].Name == name {
			return &op.Status.Machines[i]
		}
	}
	return nil
}

// TestTheWaiterAwaitsTheRelease: a holder that completes releases the
// lock right after it records its end, and the operation waiting for the
// lock, which that end wakes in the same controller, waits for the release
// instead of taking a completed holder over (a takeover would only
// conflict with the release, or, as here, win and leave a note about a
// holder that was letting go anyway). The release is slow (a second, as
// on a loaded API server), so the waiter's turn comes between the two.
func TestTheWaiterAwaitsTheRelease(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	hang := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reboot"})
	var released atomic.Int32
	c.start(slowRelease(c.ctrlNS, time.Second, &released))
	holderAndWaiter(c, w1, w2)
	hang()
	a := c.waitSucceeded("a-reboot", time.Minute)
	b := c.waitSucceeded("b-reboot", time.Minute)
	if released.Load() == 0 {
		t.Fatal("no release of the lock was slowed: the test did not come between an end and its release")
	}
	if st := c.lockHolder(); st.TakenOverFrom != "" {
		t.Errorf("b-reboot took the lock over from %q, whose release was under way", st.TakenOverFrom)
	}
	if b.Status.StartTime.Before(a.Status.CompletionTime) {
		t.Errorf("b-reboot started (%s) before a-reboot completed (%s)", b.Status.StartTime, a.Status.CompletionTime)
	}
}

// TestTheWaiterChecksWhileTheHolderEnds: an operation waiting for the lock
// whose checks ran before the holder went idle runs them again while it
// waits for that holder's release, not after it takes the lock: the holder
// changed nothing from the moment its end was decided, so a take on its
// release counts as free from then, and the checks beside the holder's last
// writes count as made holding the lock. Here the waiter's checks (their
// read of kube-proxy's DaemonSet, which only the checks make) are held
// until the holder's end is written, and the release is slow: no check
// may read the cluster once the release is written.
func TestTheWaiterChecksWhileTheHolderEnds(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	hang := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reboot"})
	var released, held, afterRelease atomic.Int32
	var armed, releaseWritten atomic.Bool
	aEnded := func() bool {
		a := &ichorv1.TalosOperation{}
		return env.Client.Get(ctx, keyOf(c.ns, "a-reboot"), a) == nil && a.Succeeded()
	}
	holdChecks := beforeRequest(isChecksRead, func(*http.Request) {
		if releaseWritten.Load() {
			afterRelease.Add(1)
		}
		if !armed.Load() || aEnded() {
			return
		}
		held.Add(1)
		_ = wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) { return aEnded(), nil })
	})
	c.start(slowRelease(c.ctrlNS, time.Second, &released), holdChecks,
		afterAnswer(isRelease(c.ctrlNS), func(*http.Request) { releaseWritten.Store(true) }))
	holderAndWaiter(c, w1, w2)
	armed.Store(true)
	hang()
	a := c.waitSucceeded("a-reboot", time.Minute)
	b := c.waitSucceeded("b-reboot", time.Minute)
	if released.Load() == 0 || held.Load() == 0 {
		t.Fatalf("%d release(s) of the lock slowed and %d check(s) held until a-reboot's end: the test did not come between", released.Load(), held.Load())
	}
	if n := afterRelease.Load(); n > 0 {
		t.Errorf("b-reboot's checks read the cluster %d time(s) after a-reboot's release: they ran again after the take, not while it waited", n)
	}
	if b.Status.StartTime.Before(a.Status.CompletionTime) {
		t.Errorf("b-reboot started (%s) before a-reboot completed (%s)", b.Status.StartTime, a.Status.CompletionTime)
	}
}

// isChecksRead passes the read that only an operation's checks make (of
// kube-proxy's DaemonSet, from the API server).
func isChecksRead(req *http.Request) bool {
	return req.Method == http.MethodGet && strings.HasSuffix(req.URL.Path, "/daemonsets/kube-proxy")
}

// isRelease passes the controller's releases of the cluster lock in the
// controller namespace ns: a write of the lock Lease that names no holder.
func isRelease(ns string) func(*http.Request) bool {
	return func(req *http.Request) bool {
		if req.Method != http.MethodPut || !strings.HasSuffix(req.URL.Path, "/namespaces/"+ns+"/leases/"+ichorv1.LockLeaseName) {
			return false
		}
		lease, ok := requestObject(req).(*coordinationv1.Lease)
		return ok && lease.Spec.HolderIdentity == nil
	}
}

// holderAndWaiter creates a-reboot of w1 and, once it has reached its
// reboot (which the caller's fault holds there), b-reboot of w2, which
// waits for the lock a-reboot holds.
func holderAndWaiter(c *cluster, w1, w2 string) {
	c.create("a-reboot", rebootSpec(w1))
	c.waitFor("a-reboot", "to reach its reboot", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == executor.StepReboot
	})
	c.create("b-reboot", rebootSpec(w2))
	c.waitFor("b-reboot", "to wait for the lock", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Lock == ichorv1.LockWaiting
	})
}

// slowRelease holds each of the controller's releases of the cluster lock
// in the controller namespace ns for delay, and counts them in released.
func slowRelease(ns string, delay time.Duration, released *atomic.Int32) controllerOption {
	return beforeRequest(isRelease(ns), func(req *http.Request) {
		released.Add(1)
		select {
		case <-time.After(delay):
		case <-req.Context().Done():
		}
	})
}

// TestTakeover: a holder paused on a failed step loses the lock to the next
// operation; a holder an operator paused keeps it until it is resumed.
func TestTakeover(t *testing.T) {
	t.Run("paused on a failed step", func(t *testing.T) {
		c := newCluster(t, sim.Cluster("", 1, 2))
		w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
		c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
		c.start()
		c.create("a-upgrade", talosSpec("v1.13.7"))
		c.waitFor("a-upgrade", "to fail", time.Minute, (*ichorv1.TalosOperation).StepFailed)
		// w1 stays cordoned (nothing is rolled back) and counts against the budget.
		b := rebootSpec(w2)
		b.MaxUnavailable = 2
		c.create("b-reboot", b)
		c.waitSucceeded("b-reboot", time.Minute)
		st := c.lockHolder()
		if want := ichorv1.OperationIdentity(c.ns, "a-upgrade") + " (paused on a failed step)"; st.TakenOverFrom != want {
			t.Errorf("takeover note %q, want %q", st.TakenOverFrom, want)
		}
		if a := c.get("a-upgrade"); !a.StepFailed() || a.Status.Phase != ichorv1.PhasePaused {
			t.Errorf("a-upgrade: %s %q", a.Status.Phase, a.Status.FailureReason)
		}
	})
	t.Run("paused by an operator", func(t *testing.T) {
		c := newCluster(t, sim.Cluster("", 1, 2))
		w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
		release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
		c.start()
		c.create("a-upgrade", talosSpec("v1.13.7"))
		c.waitFor("a-upgrade", "to reach w1's install", time.Minute, func(op *ichorv1.TalosOperation) bool {
			m := entryOf(op, w1)
			return m != nil && m.Step == "install"
		})
		c.patchSpec("a-upgrade", `{"paused":true}`)
		c.create("b-reboot", rebootSpec(w2))
		release()
		a := c.waitFor("a-upgrade", "to pause between steps", time.Minute, func(op *ichorv1.TalosOperation) bool {
			m := entryOf(op, w1)
			return op.Status.Reason == ichorv1.ReasonPausedByOperator && m != nil && m.Step != "install"
		})
		if a.Status.Lock != ichorv1.LockHeld {
			t.Errorf("an operator-paused operation must keep the lock; status.lock = %q", a.Status.Lock)
		}
		b := c.waitFor("b-reboot", "to wait for the lock", time.Minute, func(op *ichorv1.TalosOperation) bool {
			return op.Status.Reason == ichorv1.ReasonClusterLockHeld
		})
		if b.Status.LockHolder != ichorv1.OperationIdentity(c.ns, "a-upgrade") {
			t.Errorf("b-reboot waits for %q", b.Status.LockHolder)
		}
		if n := c.fleet.Recorder().Calls(w2, "Reboot"); n != 0 {
			t.Errorf("b-reboot rebooted %s while the lock was held: %d calls", w2, n)
		}
		c.patchSpec("a-upgrade", `{"paused":false}`)
		a = c.waitSucceeded("a-upgrade", time.Minute)
		b = c.waitSucceeded("b-reboot", time.Minute)
		if b.Status.StartTime.Before(a.Status.CompletionTime) {
			t.Errorf("b-reboot started before a-upgrade completed")
		}
	})
	t.Run("deleted holder", func(t *testing.T) {
		c := newCluster(t, sim.Cluster("", 1, 1))
		w1 := c.fleet.Machines()[1].Name()
		// A holder that no longer exists, as after a controller was removed mid-operation.
		l := &lock.Lock{Client: env.Client, Namespace: c.ctrlNS, Judge: lock.ClusterJudge{Client: env.Client}}
		gone := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "gone", UID: "gone"}}
		if _, err := l.Acquire(context.Background(), lock.Request{Holder: lock.ForOperation(gone, ichorv1.OperationIdentity(c.ns, "gone"))}); err != nil {
			t.Fatal(err)
		}
		c.start()
		c.create("b-reboot", rebootSpec(w1))
		c.waitSucceeded("b-reboot", time.Minute)
		if st := c.lockHolder(); st.TakenOverFrom != ichorv1.OperationIdentity(c.ns, "gone")+" (deleted)" {
			t.Errorf("takeover note %q", st.TakenOverFrom)
		}
	})
}

// TestDeleteWaitsForTheStep: deleting an operation mid-step keeps it (its
// finalizer) until the step in flight settles, then lets go of the lock.
func TestDeleteWaitsForTheStep(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to hang in w1's install", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == "install"
	})
	op := c.get("upgrade")
	if err := env.Client.Delete(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	c.waitFor("upgrade", "to be marked deleted", time.Minute, func(op *ichorv1.TalosOperation) bool { return !op.DeletionTimestamp.IsZero() })
	if h := c.lockHolder(); h.Holder.Identity != ichorv1.OperationIdentity(c.ns, "upgrade") {
		t.Fatalf("the lock was let go mid-step: holder %s", h.Holder)
	}
	release()
	waitGone(t, c.ns, "upgrade")
	if h := c.lockHolder(); !h.Free() {
		t.Errorf("lock still held by %s", h.Holder)
	}
}

// TestDeleteMidReboot: deleting an operation while its machine reboots
// waits until the machine is back (the step settles), lifts the cordon the
// operation made, and only then lets the lock go: the reboot waiting for it
// never overlaps.
func TestDeleteMidReboot(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	comeBack := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultNoReturn})
	c.start()
	c.create("a-reboot", rebootSpec(w1))
	c.waitFor("a-reboot", "to wait for "+w1+" to come back", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == "wait-rebooted" && c.fleet.Machine(w1).Down()
	})
	b := rebootSpec(w2)
	b.MaxUnavailable = 2
	c.create("b-reboot", b)
	c.waitFor("b-reboot", "to wait for the lock", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld
	})
	if err := env.Client.Delete(context.Background(), c.get("a-reboot")); err != nil {
		t.Fatal(err)
	}
	c.waitFor("a-reboot", "to say it waits for the machine", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return strings.HasPrefix(op.Status.Message, "deleted: the steps in flight settle")
	})
	if h := c.lockHolder(); h.Holder.Identity != ichorv1.OperationIdentity(c.ns, "a-reboot") {
		t.Fatalf("the lock was let go with %s still rebooting: holder %s", w1, h.Holder)
	}
	comeBack()
	waitGone(t, c.ns, "a-reboot")
	c.waitSucceeded("b-reboot", time.Minute)
	node := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(w1), node); err != nil {
		t.Fatal(err)
	}
	if node.Spec.Unschedulable || node.Annotations[executor.CordonedByAnnotation] != "" {
		t.Errorf("%s stays cordoned by the deleted operation: unschedulable %v, %s=%q", w1, node.Spec.Unschedulable,
			executor.CordonedByAnnotation, node.Annotations[executor.CordonedByAnnotation])
	}
	if o := c.fleet.Recorder().Overlaps(); len(o) > 0 {
		t.Errorf("the reboots overlapped: %+v", o)
	}
}

func waitGone(t *testing.T, ns, name string) {
	t.Helper()
	testenv.Eventually(t, time.Minute, name+" to be gone", func(ctx context.Context) (bool, error) {
		err := env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &ichorv1.TalosOperation{})
		if notFound(err) {
			return true, nil
		}
		return false, err
	})
}

// TestJobHolder: an operation waits behind a Job that holds the lock (the
// Cilium Helm Job does) and starts when the Job finishes.
func TestJobHolder(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, sim.Cluster("", 1, 1))
	// Running until finishJob: a Job's pod on a simulated machine ends by
	// itself after a few seconds, and the real Job controller would mark it
	// Complete before the operation had waited for it.
	job := c.runningJob("cilium-helm")
	id := ichorv1.JobIdentity(c.ns, job.Name)
	l := &lock.Lock{Client: env.Client, Namespace: c.ctrlNS, Judge: lock.ClusterJudge{Client: env.Client}}
	if res, err := l.Acquire(ctx, lock.Request{Holder: lock.ForJob(job)}); err != nil || !res.Acquired {
		t.Fatalf("the Job takes the lock: %+v %v", res, err)
	}
	c.start()
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitFor("reboot", "to wait for the Job", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	})
	c.finishJob(job)
	c.waitSucceeded("reboot", time.Minute)
	if st := c.lockHolder(); st.TakenOverFrom != id+" (finished)" {
		t.Errorf("takeover note %q", st.TakenOverFrom)
	}
}

// TestChecksAgainOnceTheLockIsHeld: the checks an operation passed before
// it took the lock are made again once it holds it when the cluster may
// have changed between the two. Here the Job holding the lock moves
// kube-proxy to Kubernetes v1.20.0 (which Talos v1.13 does not run) and
// lets the lock go right after the upgrade's first checks read
// kube-proxy's DaemonSet (as it was): that turn takes the lock, and the
// upgrade is refused once it holds it, with nothing disrupted.
func TestChecksAgainOnceTheLockIsHeld(t *testing.T) {
	ctx := context.Background()
	spec := sim.Cluster("", 1, 1)
	spec.KubeProxy = true
	c := newCluster(t, spec)
	t.Cleanup(func() { removeKubeProxy(t) })
	job := c.runningJob("holder")
	l := &lock.Lock{Client: env.Client, Namespace: c.ctrlNS, Judge: lock.ClusterJudge{Client: env.Client}}
	if res, err := l.Acquire(ctx, lock.Request{Holder: lock.ForJob(job)}); err != nil || !res.Acquired {
		t.Fatalf("the Job takes the lock: %+v %v", res, err)
	}
	// Only the checks read kube-proxy's DaemonSet from the API server.
	moved, whileChecking := afterFirstAnswer(func(req *http.Request) bool {
		return req.Method == http.MethodGet && strings.HasSuffix(req.URL.Path, "/daemonsets/kube-proxy")
	}, func(*http.Request) error {
		ds := &appsv1.DaemonSet{}
		if err := env.Client.Get(ctx, keyOf("kube-system", "kube-proxy"), ds); err != nil {
			return err
		}
		ds.Spec.Template.Spec.Containers[0].Image = "registry.k8s.io/kube-proxy:v1.20.0"
		if err := env.Client.Update(ctx, ds); err != nil {
			return err
		}
		_, _, err := l.Release(ctx, lock.ForJob(job))
		return err
	})
	c.start(moved)
	c.create("upgrade", talosSpec("v1.13.7"))
	select {
	case err := <-whileChecking:
		if err != nil {
			t.Fatalf("kube-proxy moved and the Job's lock let go right after the checks read it: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the upgrade's checks did not read kube-proxy's DaemonSet within a minute")
	}
	op := c.waitFor("upgrade", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
	cond := meta.FindStatusCondition(op.Status.Conditions, preflight.TalosKubernetesSupported)
	if cond == nil || cond.Status != metav1.ConditionFalse || !strings.Contains(cond.Message, "v1.20.0") || !strings.Contains(cond.Message, "(once the cluster lock was held)") {
		t.Errorf("condition %s = %+v, want Kubernetes v1.20.0 refused once the cluster lock was held", preflight.TalosKubernetesSupported, cond)
	}
	for _, call := range []string{"ImageService/Pull", "Upgrade", "Reboot"} {
		if n := c.fleet.Recorder().Calls("", call); n > 0 {
			t.Errorf("the refused upgrade called %s %d time(s)", call, n)
		}
	}
}

// TestTakeoverWaitsForStepsInFlight: with maxUnavailable 2, w1 fails (Talos
// rolls its upgrade back) while w2's install (which reboots it) is still in
// flight. The failed operation
// starts nothing new and keeps the lock until w2 is back, and only then
// counts as paused on a failed step: the waiting reboot of w3 never
// overlaps w2's. w2 stops before its uncordon, and a retry finishes both.
func TestTakeoverWaitsForStepsInFlight(t *testing.T) {
	spec := sim.Cluster("", 1, 3)
	// Slow enough that w2 has reached its install when w1 comes back rolled back.
	spec.Durations.Reboot = time.Second
	c := newCluster(t, spec)
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	c.fleet.Machine(w(1)).Inject(sim.Fault{Kind: sim.FaultRollback})
	release := c.fleet.Machine(w(2)).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	a := talosSpec("v1.13.7")
	a.MaxUnavailable = 2
	c.create("a-upgrade", a)
	c.waitFor("a-upgrade", "to fail on "+w(1)+" with "+w(2)+"'s install in flight", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w(2))
		return op.StepFailed() && m != nil && m.Step == "install" && !m.Stopped
	})
	// w1 and w2 are cordoned: b's budget must allow for them.
	b := rebootSpec(w(3))
	b.MaxUnavailable = 3
	c.create("b-reboot", b)
	holder := ichorv1.OperationIdentity(c.ns, "a-upgrade")
	got := c.waitFor("b-reboot", "to take its first turn", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Phase != "" && op.Status.Phase != ichorv1.PhasePending
	})
	if got.Status.Reason != ichorv1.ReasonClusterLockHeld || got.Status.LockHolder != holder {
		t.Fatalf("b-reboot went ahead while %s's install was in flight: phase %s reason %s holder %q", w(2), got.Status.Phase, got.Status.Reason, got.Status.LockHolder)
	}
	if op := c.get("a-upgrade"); op.FailedAndSettled() || !strings.Contains(op.Status.Message, "settle first: "+w(2)+": install") {
		t.Errorf("a-upgrade counts as settled with %s in flight, message %q", w(2), op.Status.Message)
	}
	release()
	c.waitSucceeded("b-reboot", time.Minute)
	op := c.get("a-upgrade")
	if m := entryOf(op, w(2)); m.Phase != ichorv1.MachineInProgress || !m.Stopped || m.Step != "uncordon" {
		t.Errorf("%s: %s step %s stopped %v; want InProgress, stopped before uncordon", w(2), m.Phase, m.Step, m.Stopped)
	}
	rec := c.fleet.Recorder()
	for _, o := range rec.Overlaps(sim.ActionReboot, sim.ActionUpgrade) {
		if o.A.Machine == w(3) || o.B.Machine == w(3) {
			t.Errorf("b-reboot's reboot overlapped a-upgrade's work: %+v", o)
		}
	}

	c.fleet.Machine(w(1)).ClearFaults()
	c.kubectl("annotate", "talosoperation", "a-upgrade", ichorv1.RetryAnnotation+"=true")
	c.waitSucceeded("a-upgrade", time.Minute)
	for i := 1; i <= 2; i++ {
		node := &corev1.Node{}
		if err := env.Client.Get(context.Background(), keyOfNode(w(i)), node); err != nil {
			t.Fatal(err)
		}
		if n := rec.UpgradesApplied(w(i)); n != 1 || node.Spec.Unschedulable {
			t.Errorf("%s: %d upgrades, unschedulable %v; want 1, schedulable", w(i), n, node.Spec.Unschedulable)
		}
	}
}

// takenOver is a Judge that finds every holder stale: a taker acting on
// what it read while the holder went on.
type takenOver struct{}

func (takenOver) Stale(context.Context, lock.Holder) (lock.Verdict, error) {
	return lock.Verdict{Stale: true, Why: "judged stale by the test"}, nil
}

// beforeLeaseWrite runs run once, before the first write of the cluster
// lock's Lease that goes through the transport once when says so: the
// write then conflicts with what run did.
func beforeLeaseWrite(when func() bool, run *atomic.Pointer[func()]) controllerOption {
	return beforeRequest(func(req *http.Request) bool {
		return req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/leases/"+ichorv1.LockLeaseName) && when()
	}, func(*http.Request) {
		if f := run.Swap(nil); f != nil {
			(*f)()
		}
	})
}

// TestTakeoverBetweenAcquireAndLaunch: another taker takes the lock over
// after the turn read the Lease and found it still its own, before the
// turn's Confirm writes it. The turn has moved the machine on in status,
// but its Confirm (a write guarded by the Lease it read) finds the lock
// gone, and the next step never starts; the operation waits for the new
// holder, and goes on once that holder is gone.
func TestTakeoverBetweenAcquireAndLaunch(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "ImageService/Pull"})
	pulled := func() bool { return len(c.fleet.Recorder().Handled(w1, "Pull")) > 0 }
	var takeover atomic.Pointer[func()]
	ctl := c.start(beforeLeaseWrite(pulled, &takeover))
	a := talosSpec("v1.13.7")
	a.Machines = onlyMachine(c.fleet.Machine(w1))
	c.create("a-upgrade", a)
	c.waitFor("a-upgrade", "to pull on "+w1, time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == executor.StepPull
	})
	// b: an operation an operator paused before it started, which keeps
	// the lock it is given.
	bSpec := talosSpec("v1.13.7")
	bSpec.Paused = true
	c.create("b-upgrade", bSpec)
	b := lock.ForOperation(c.get("b-upgrade"), ichorv1.OperationIdentity(c.ns, "b-upgrade"))
	take := func() {
		taker := &lock.Lock{Client: env.Client, Namespace: c.ctrlNS, Judge: takenOver{}}
		if res, err := taker.Acquire(ctx, lock.Request{Holder: b}); err != nil || !res.Acquired {
			t.Errorf("taking the lock over: %+v %v", res, err)
		}
	}
	takeover.Store(&take)
	release()
	c.waitFor("a-upgrade", "to wait for b-upgrade", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Lock == ichorv1.LockWaiting && op.Status.LockHolder == b.Identity
	})
	if takeover.Load() != nil {
		t.Fatal("the controller did not confirm the lock before the step after the pull")
	}
	if n := ctl.steps.count(w1 + "/" + executor.StepCordon); n != 0 {
		t.Errorf("%s started on %s %d time(s) after the lock was taken over", executor.StepCordon, w1, n)
	}
	if c.node(w1).Spec.Unschedulable {
		t.Errorf("%s was cordoned after the lock was taken over", w1)
	}
	if err := env.Client.Delete(ctx, c.get("b-upgrade")); err != nil {
		t.Fatal(err)
	}
	c.waitSucceeded("a-upgrade", time.Minute)
}
