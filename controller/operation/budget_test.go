package operation_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func (c *cluster) node(name string) *corev1.Node {
	c.t.Helper()
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(name), n); err != nil {
		c.t.Fatal(err)
	}
	return n
}

// workersOverlapping returns the pairs of workers the operation worked on
// at once, from the times status recorded.
func workersOverlapping(op *ichorv1.TalosOperation) []string {
	var out []string
	ms := op.Status.Machines
	for i := range ms {
		for j := i + 1; j < len(ms); j++ {
			a, b := ms[i], ms[j]
			if a.Role != ichorv1.RoleWorker || b.Role != ichorv1.RoleWorker || a.StartedAt == nil || b.StartedAt == nil || a.FinishedAt == nil || b.FinishedAt == nil {
				continue
			}
			if a.StartedAt.Before(b.FinishedAt) && b.StartedAt.Before(a.FinishedAt) {
				out = append(out, a.Name+" and "+b.Name)
			}
		}
	}
	return out
}

// TestCordonedWorkerIsInService: a worker an operator cordons while it is
// Ready is in service. With maxUnavailable 1 it waits its turn like any
// other (it does not start beside the worker in progress), the operation
// does not wait for its cordon to be lifted, and the operator's cordon stays.
func TestCordonedWorkerIsInService(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	release := c.holdDrain(w(1))
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to drain "+w(1), time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w(1))
		return m != nil && m.Phase == ichorv1.MachineInProgress && m.Step == executor.StepDrain
	})
	c.kubectl("cordon", w(3))
	release()
	op := c.waitSucceeded("upgrade", 2*time.Minute)
	if both := workersOverlapping(op); len(both) > 0 {
		t.Errorf("workers worked on at once with maxUnavailable 1: %v", both)
	}
	if o := c.fleet.Recorder().Overlaps(sim.ActionReboot, sim.ActionUpgrade); len(o) > 0 {
		t.Errorf("disruptive actions overlapped: %+v", o)
	}
	if n := c.node(w(3)); !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != "" {
		t.Errorf("the operator's cordon of %s: unschedulable %v, %s=%q", w(3), n.Spec.Unschedulable,
			executor.CordonedByAnnotation, n.Annotations[executor.CordonedByAnnotation])
	}
}

// TestOperatorCordonsMeanwhile: an operator cordons a worker after Ichor
// decided to cordon it and before Ichor's cordon lands (held at the
// controller's transport while the operator's is made). Ichor's write
// carries the resourceVersion of the Node it decided on, so it conflicts,
// Ichor reads the Node again and leaves the operator's cordon alone: after
// the upgrade the worker is still cordoned, and not marked as Ichor's.
func TestOperatorCordonsMeanwhile(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	m := c.fleet.Machines()[1]
	w := m.Name()
	race, operator := holdingFirst(func(req *http.Request) bool {
		return req.Method == http.MethodPatch && strings.HasSuffix(req.URL.Path, "/nodes/"+w) &&
			bodyContains(req, `"unschedulable":true`)
	}, func(req *http.Request) error {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: w}}
		return env.Client.Patch(req.Context(), n, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"unschedulable":true}}`)))
	})
	c.startWith(testcluster.StartController, race)
	op := talosSpec("v1.13.7")
	op.Machines = onlyMachine(m)
	c.create("upgrade", op)
	c.waitSucceeded("upgrade", 2*time.Minute)
	select {
	case err := <-operator:
		if err != nil {
			t.Fatalf("the operator's cordon of %s: %v", w, err)
		}
	default:
		t.Fatalf("Ichor never sent its cordon of %s", w)
	}
	if n := c.node(w); !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != "" {
		t.Errorf("the operator's cordon of %s, made between Ichor's read and its write: unschedulable %v, %s=%q", w, n.Spec.Unschedulable,
			executor.CordonedByAnnotation, n.Annotations[executor.CordonedByAnnotation])
	}
}

// TestWorkerDownBesideOneInFlightWaits: with maxUnavailable 1, a worker of
// the operation goes down (an operator rebooted it, and it does not come
// back yet) while another is being drained. It counts against the budget:
// it does not start beside the drain in flight (cordoning it would take
// away the room the drain's evicted pods need when it comes back), and the
// operation says it waits for it. Once it is back, the workers go one
// after another.
func TestWorkerDownBesideOneInFlightWaits(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1, w2 := c.fleet.Machines()[1], c.fleet.Machines()[2]
	release := c.holdDrain(w1.Name())
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to drain "+w1.Name(), time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1.Name())
		return m != nil && m.Phase == ichorv1.MachineInProgress && m.Step == executor.StepDrain
	})

	clear := w2.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	if err := adminTalos(t, c.fleet).Reboot(talosclient.WithNode(ctx, w2.Address())); err != nil {
		t.Fatalf("an operator's reboot of %s: %v", w2.Name(), err)
	}
	want := "waiting for workers to come back: 1 out of service (" + w2.Name() + ": NotReady) with maxUnavailable 1"
	c.waitFor("upgrade", "to wait for "+w2.Name(), time.Minute, func(op *ichorv1.TalosOperation) bool {
		if m := entryOf(op, w2.Name()); m != nil && m.StartedAt != nil {
			t.Fatalf("%s started (%s) while it was down and %s was in flight", w2.Name(), m.Step, w1.Name())
		}
		return strings.Contains(op.Status.Message, want)
	})
	clear()
	testenv.Eventually(t, time.Minute, w2.Name()+"'s Node Ready again", func(ctx context.Context) (bool, error) {
		return machine.Ready(c.node(w2.Name())), nil
	})
	release()
	op := c.waitSucceeded("upgrade", 2*time.Minute)
	if both := workersOverlapping(op); len(both) > 0 {
		t.Errorf("workers worked on at once with maxUnavailable 1: %v", both)
	}
	for _, w := range []*sim.Machine{w1, w2} {
		if n := c.fleet.Recorder().UpgradesApplied(w.Name()); n != 1 {
			t.Errorf("%s: %d upgrades applied, want 1", w.Name(), n)
		}
	}
}

// TestWorkersLeftCordonedFailTheStep: a worker that another operation
// cordoned and left so when its step failed stays out of service until
// someone retries or deletes that operation, which cannot run while this
// one holds the cluster lock. When such workers use up maxUnavailable the
// operation does not wait forever: its next worker fails with
// WorkersUnavailable, saying which and what to do, nothing of it runs, and
// the lock goes. Retrying the other, then this one, finishes both.
func TestWorkersLeftCordonedFailTheStep(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	c.fleet.Machine(w(1)).Inject(sim.Fault{Kind: sim.FaultError, Method: "Reboot", Code: codes.Internal})
	c.start()
	c.create("a-reboot", rebootSpec(w(1)))
	c.waitFor("a-reboot", "to fail", time.Minute, (*ichorv1.TalosOperation).FailedAndSettled)
	if by := c.node(w(1)).Annotations[executor.CordonedByAnnotation]; by == "" {
		t.Fatalf("%s is not left cordoned by a-reboot", w(1))
	}
	b := talosSpec("v1.13.7")
	b.Machines = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
		{Key: "kubernetes.io/hostname", Operator: metav1.LabelSelectorOpIn, Values: []string{w(2), w(3)}}}}
	c.create("b-upgrade", b)
	op := c.waitFailed("b-upgrade", "WorkersUnavailable")
	holder := ichorv1.OperationIdentity(c.ns, "a-reboot")
	if !strings.Contains(op.Status.Message, w(1)) || !strings.Contains(op.Status.Message, holder) {
		t.Errorf("the message does not name %s and %s: %q", w(1), holder, op.Status.Message)
	}
	for _, m := range op.Status.Machines {
		if m.StartedAt != nil {
			t.Errorf("%s started (%s at %s) although the budget was used up", m.Name, m.Phase, m.Step)
		}
	}
	if n := c.fleet.Recorder().Calls(w(2), "LifecycleService/Upgrade") + c.fleet.Recorder().Calls(w(3), "LifecycleService/Upgrade"); n != 0 {
		t.Errorf("%d upgrades with the budget used up", n)
	}

	c.fleet.Machine(w(1)).ClearFaults()
	c.kubectl("annotate", "talosoperation", "a-reboot", ichorv1.RetryAnnotation+"=true")
	c.waitSucceeded("a-reboot", time.Minute)
	c.kubectl("annotate", "talosoperation", "b-upgrade", ichorv1.RetryAnnotation+"=true")
	c.waitSucceeded("b-upgrade", 2*time.Minute)
	for i := 2; i <= 3; i++ {
		if n := c.fleet.Recorder().UpgradesApplied(w(i)); n != 1 {
			t.Errorf("%s: %d upgrades applied, want 1", w(i), n)
		}
	}
}

// TestCordonLeftByEndedOperation: a reset that succeeded leaves its
// machine cordoned on purpose (it was taken out; its Node is not lifted
// when it comes back). That cordon is all it left: once the machine is
// Ready again it is in service like one an operator cordoned, so an
// upgrade with maxUnavailable 1 runs on every worker instead of failing
// with WorkersUnavailable, and the reset's cordon stays.
func TestCordonLeftByEndedOperation(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1 := c.fleet.Machines()[1].Name()
	c.start()
	c.create("a-reset", ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode,
		Node: &ichorv1.NodeAction{Machine: w1, Action: ichorv1.NodeReset, Reset: &ichorv1.ResetOptions{Reboot: true}}})
	c.waitSucceeded("a-reset", time.Minute)
	testenv.Eventually(t, time.Minute, w1+" back and Ready after its reset", func(context.Context) (bool, error) {
		return machine.Ready(c.node(w1)), nil
	})
	holder := ichorv1.OperationIdentity(c.ns, "a-reset")
	if n := c.node(w1); !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != holder {
		t.Fatalf("%s: unschedulable %v, cordoned by %q: want the reset's cordon left", w1, n.Spec.Unschedulable, n.Annotations[executor.CordonedByAnnotation])
	}
	c.create("b-upgrade", talosSpec("v1.13.7"))
	c.waitSucceeded("b-upgrade", 2*time.Minute)
	for _, m := range c.fleet.Machines() {
		if n := c.fleet.Recorder().UpgradesApplied(m.Name()); n != 1 {
			t.Errorf("%s: %d upgrades applied, want 1", m.Name(), n)
		}
	}
	if n := c.node(w1); !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != holder {
		t.Errorf("%s: unschedulable %v, cordoned by %q: the reset's cordon was not the upgrade's to lift", w1, n.Spec.Unschedulable, n.Annotations[executor.CordonedByAnnotation])
	}
}

// TestStepNotStartedIsReported: a step that status records as in progress
// but that this controller cannot start (here a step name it does not
// know, as an older or newer controller may have written) is reported in a
// Warning Event naming it, not silently dropped.
func TestStepNotStartedIsReported(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	op := c.create("reboot", rebootSpec(w1))
	now := metav1.Now()
	op.Status = ichorv1.TalosOperationStatus{StartTime: &now, Target: "reboot", Machines: []ichorv1.MachineStatus{
		{Name: w1, Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "frobnicate", Attempts: 1, StartedAt: &now}}}
	if err := env.Client.Status().Update(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	c.start()
	testenv.Eventually(t, time.Minute, "a StepNotStarted Event", func(context.Context) (bool, error) {
		for _, e := range c.events("reboot") {
			if e.Reason == "StepNotStarted" && strings.Contains(e.Message, w1+": frobnicate not started") {
				return true, nil
			}
		}
		return false, nil
	})
}
