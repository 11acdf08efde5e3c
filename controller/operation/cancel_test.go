package operation_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestCancel: a cancelled operation stops for good and keeps its record:
// the step in flight settles first (the lock is kept meanwhile), then its
// cordon is lifted, the lock goes to the operation waiting for it, and the
// phase says Cancelled, by whom and which machines were done. The machine
// after it is never touched.
func TestCancel(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	cp, w1, w2 := c.fleet.Machines()[0].Name(), c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to hang in "+w1+"'s install", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == "install"
	})
	c.create("b-reboot", rebootSpec(w2))
	c.waitFor("b-reboot", "to wait for the lock", time.Minute, func(op *ichorv1.TalosOperation) bool { return op.WaitingForLock() })

	op := &ichorv1.TalosOperation{}
	op.Namespace, op.Name = c.ns, "upgrade"
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"alice"}}}`, ichorv1.CancelAnnotation)
	if err := env.Client.Patch(context.Background(), op, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		t.Fatal(err)
	}
	c.waitFor("upgrade", "to be Cancelled with the install in flight", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Cancelled() && strings.Contains(op.Status.Message, "the steps in flight settle")
	})
	if h := c.lockHolder(); h.Holder.Identity != ichorv1.OperationIdentity(c.ns, "upgrade") {
		t.Fatalf("the lock was let go with the install in flight: holder %q", h.Holder)
	}
	release()
	got := c.waitFor("upgrade", "to let go of the lock", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Cancelled() && op.Status.Lock == "" && op.Settled()
	})
	want := "cancelled by alice; done on 1/3 machine(s): " + cp
	if got.Status.Message != want || got.Status.CompletionTime == nil {
		t.Errorf("message %q (completion %v), want %q", got.Status.Message, got.Status.CompletionTime, want)
	}
	node := &corev1.Node{}
	if err := env.Client.Get(context.Background(), client.ObjectKey{Name: w1}, node); err != nil {
		t.Fatal(err)
	}
	if node.Spec.Unschedulable {
		t.Errorf("%s is still cordoned", w1)
	}
	c.waitSucceeded("b-reboot", time.Minute)
	if n := c.fleet.Recorder().UpgradesApplied(w2); n != 0 {
		t.Errorf("%s was upgraded %d times after the cancel", w2, n)
	}
	if e := entryOf(c.get("upgrade"), w2); e == nil || e.Phase != ichorv1.MachinePending {
		t.Errorf("%s: %+v, want Pending", w2, e)
	}
}

// TestEndedAfterKillBetweenCallAndStatus: the controller is killed right
// after a machine's install call was accepted, before status records it,
// and the operation is deleted (or cancelled) while no controller runs. The
// next controller finds an irreversible step in flight whose run no one
// has counted: it must still settle it (the machine's reboot finishes, the
// call is not made again) and then end the operation (the finalizer goes,
// or the phase says Cancelled), lift the cordon and let go of the lock,
// without waiting for an event that already happened.
func TestEndedAfterKillBetweenCallAndStatus(t *testing.T) {
	for _, how := range []string{"deleted", "cancelled"} {
		t.Run(how, func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 1))
			cp := c.fleet.Machines()[0]
			gone := make(chan struct{})
			var ctl atomic.Pointer[testcluster.Controller]
			var once sync.Once
			hook := func(s operation.StepRun) {
				if s.Step == executor.StepInstall && s.Err == nil {
					once.Do(func() { ctl.Load().Kill(); close(gone) })
				}
			}
			ctl.Store(testcluster.StartKillable(t, env.Config, app.Options{Namespace: c.ctrlNS, TestHookAfterRun: hook}))
			c.create("upgrade", talosSpec("v1.13.7"))
			select {
			case <-gone:
			case <-time.After(2 * time.Minute):
				t.Fatal("the install never ran")
			}
			ctl.Load().Stop()
			op := &ichorv1.TalosOperation{}
			op.Namespace, op.Name = c.ns, "upgrade"
			if how == "deleted" {
				if err := env.Client.Delete(context.Background(), op); err != nil {
					t.Fatal(err)
				}
			} else {
				patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"alice"}}}`, ichorv1.CancelAnnotation)
				if err := env.Client.Patch(context.Background(), op, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
					t.Fatal(err)
				}
			}
			testenv.Eventually(t, time.Minute, cp.Name()+" up on v1.13.7 while no controller runs", func(context.Context) (bool, error) {
				return !cp.Down() && cp.Version() == "v1.13.7", nil
			})
			c.start()
			testenv.Eventually(t, time.Minute, "the operation ended and the lock let go", func(ctx context.Context) (bool, error) {
				got := &ichorv1.TalosOperation{}
				err := env.Client.Get(ctx, client.ObjectKeyFromObject(op), got)
				if how == "deleted" {
					if !notFound(err) {
						return false, client.IgnoreNotFound(err)
					}
				} else if err != nil || !got.Cancelled() || !got.Settled() || got.Status.Lock != "" {
					return false, err
				}
				return c.lockHolder().Holder.Identity == "", nil
			})
			node := &corev1.Node{}
			if err := env.Client.Get(context.Background(), keyOfNode(cp.Name()), node); err != nil {
				t.Fatal(err)
			}
			if node.Spec.Unschedulable {
				t.Errorf("%s is still cordoned", cp.Name())
			}
			if n := c.fleet.Recorder().UpgradesApplied(cp.Name()); n != 1 {
				t.Errorf("%s was upgraded %d times, want 1", cp.Name(), n)
			}
		})
	}
}
