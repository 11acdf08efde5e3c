package operation_test

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/sim"
)

// requestSkip annotates the operation with a skip request, as kubectl
// ichor operation skip does.
func (c *cluster) requestSkip(name, machine, by string, uncordon bool) {
	c.t.Helper()
	ann := map[string]any{ichorv1.SkipAnnotation: machine, ichorv1.SkipByAnnotation: by}
	if uncordon {
		ann[ichorv1.SkipUncordonAnnotation] = "true"
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": ann}})
	if err != nil {
		c.t.Fatal(err)
	}
	op := &ichorv1.TalosOperation{}
	op.Namespace, op.Name = c.ns, name
	if err := env.Client.Patch(context.Background(), op, client.RawPatch(types.MergePatchType, patch)); err != nil {
		c.t.Fatal(err)
	}
}

// skipGone reports whether the operation's skip request has been acted on
// (its annotations removed).
func skipGone(op *ichorv1.TalosOperation) bool {
	_, pending := op.SkipRequested()
	return !pending && op.Annotations[ichorv1.SkipByAnnotation] == "" && op.Annotations[ichorv1.SkipUncordonAnnotation] == ""
}

// waitEvent waits for an Event of the operation with reason and a message
// containing want.
func (c *cluster) waitEvent(name, reason, want string) {
	c.t.Helper()
	waitEventWhere(c.t.(*testing.T), c, name, fmt.Sprintf("a %s Event of %s saying %q", reason, name, want), func(e corev1.Event) bool {
		return e.Reason == reason && strings.Contains(e.Message, want)
	})
}

func node(t *testing.T, name string) *corev1.Node {
	t.Helper()
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(name), n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSkipAFailedMachine: after a worker's install fails, requests the
// operation cannot act on (no such machine, a machine that is done) are
// removed with a SkipIgnored Event and change nothing; skipping the failed
// worker marks it skipped by the requester, leaves Ichor's cordon on it
// (not asked to lift it), frees its place in maxUnavailable so the last
// worker goes, and the operation succeeds saying 3/4 and 1 skipped.
func TestSkipAFailedMachine(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	c.fleet.Machine(w(2)).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	failed := c.waitFor("upgrade", "to fail on "+w(2), time.Minute, (*ichorv1.TalosOperation).FailedAndSettled)
	if m := entryOf(failed, w(3)); m.Phase != ichorv1.MachinePending {
		t.Fatalf("%s is %s while %s's failure holds the budget", w(3), m.Phase, w(2))
	}

	for _, tc := range []struct{ machine, why string }{
		{"no-such-machine", `it has no machine "no-such-machine"; its machines: ` + strings.Join([]string{w(0), w(1), w(2), w(3)}, ", ")},
		{w(1), w(1) + " is done already (Succeeded)"},
		{w(3), w(3) + " has not started: to leave it out, put its Node on hold"},
	} {
		c.requestSkip("upgrade", tc.machine, "mallory", false)
		got := c.waitFor("upgrade", "to remove the skip of "+tc.machine, time.Minute, skipGone)
		c.waitEvent("upgrade", "SkipIgnored", ichorv1.SkipAnnotation+"="+tc.machine+" removed: "+tc.why)
		if !reflect.DeepEqual(got.Status.Machines, failed.Status.Machines) || got.Status.FailureReason != failed.Status.FailureReason {
			t.Fatalf("the skip of %s changed the status:\nbefore %+v\nafter  %+v", tc.machine, failed.Status, got.Status)
		}
	}

	c.requestSkip("upgrade", w(2), "alice", false)
	c.waitFor("upgrade", "to skip "+w(2), time.Minute, func(op *ichorv1.TalosOperation) bool { return entryOf(op, w(2)).Phase == ichorv1.MachineSkipped })
	done := c.waitSucceeded("upgrade", 2*time.Minute)
	if !skipGone(done) {
		t.Errorf("the skip request's annotations are still there: %v", done.Annotations)
	}
	m := entryOf(done, w(2))
	if m.Phase != ichorv1.MachineSkipped || !strings.HasPrefix(m.Message, "skipped by alice after its step install failed: ") {
		t.Errorf("%s: %s %q, want Skipped by alice", w(2), m.Phase, m.Message)
	}
	if done.Status.Progress != "3/4, 1 skipped" {
		t.Errorf("progress %q, want 3/4, 1 skipped", done.Status.Progress)
	}
	if want := "talos v1.13.7 done on 3/4 machine(s), 1 skipped: " + w(2) + " (skipped by alice after its step install failed: "; !strings.HasPrefix(done.Status.Message, want) {
		t.Errorf("message %q, want it to start %q", done.Status.Message, want)
	}
	c.waitEvent("upgrade", "MachineSkipped", w(2)+": skipped by alice after its step install failed")
	if n := node(t, w(2)); !n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != ichorv1.OperationIdentity(c.ns, "upgrade") {
		t.Errorf("%s: unschedulable %v, cordoned by %q: Ichor's cordon should stay when not asked to lift it", w(2), n.Spec.Unschedulable, n.Annotations[executor.CordonedByAnnotation])
	}
	rec := c.fleet.Recorder()
	if n := rec.UpgradesApplied(w(2)); n != 0 {
		t.Errorf("%s was upgraded %d times", w(2), n)
	}
	if n := rec.UpgradesApplied(w(3)); n != 1 {
		t.Errorf("%s was upgraded %d times, want 1", w(3), n)
	}
}

// TestSkipWaitsForTheStepInFlight: a skip of a machine whose step is in
// flight (an install hangs) is refused, since an irreversible call may be
// under way, and the step goes on; once the step has failed, a skip that
// asks for it lifts Ichor's cordon, and the operation goes on.
func TestSkipWaitsForTheStepInFlight(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	release := c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to hang in "+w1+"'s install", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return m != nil && m.Step == "install" && !m.Stopped && m.Phase == ichorv1.MachineInProgress
	})

	c.requestSkip("upgrade", w1, "bob", true)
	got := c.waitFor("upgrade", "to remove the skip", time.Minute, skipGone)
	c.waitEvent("upgrade", "SkipIgnored", fmt.Sprintf("%s=%s removed: %s has a step in flight (install), and an irreversible call may be under way on it", ichorv1.SkipAnnotation, w1, w1))
	if m := entryOf(got, w1); m.Phase != ichorv1.MachineInProgress || m.Step != "install" {
		t.Fatalf("%s: %s at %s after the refused skip", w1, m.Phase, m.Step)
	}
	if n := node(t, w1); !n.Spec.Unschedulable {
		t.Fatalf("the refused skip uncordoned %s", w1)
	}

	c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
	release()
	c.waitFor("upgrade", "to fail on "+w1, time.Minute, (*ichorv1.TalosOperation).FailedAndSettled)
	c.requestSkip("upgrade", w1, "bob", true)
	c.waitFor("upgrade", "to skip "+w1, time.Minute, func(op *ichorv1.TalosOperation) bool { return entryOf(op, w1).Phase == ichorv1.MachineSkipped })
	done := c.waitSucceeded("upgrade", 2*time.Minute)
	if m := entryOf(done, w1); m.Phase != ichorv1.MachineSkipped || !strings.HasPrefix(m.Message, "skipped by bob") {
		t.Errorf("%s: %s %q, want Skipped by bob", w1, m.Phase, m.Message)
	}
	c.waitEvent("upgrade", "MachineSkipped", w1+": skipped by bob after its step install failed")
	c.waitEvent("upgrade", "MachineSkipped", "Ichor's cordon lifted")
	if n := node(t, w1); n.Spec.Unschedulable || n.Annotations[executor.CordonedByAnnotation] != "" {
		t.Errorf("%s: unschedulable %v, cordoned by %q after a skip that asked to lift the cordon", w1, n.Spec.Unschedulable, n.Annotations[executor.CordonedByAnnotation])
	}
	if n := c.fleet.Recorder().UpgradesApplied(w2); n != 1 {
		t.Errorf("%s was upgraded %d times, want 1", w2, n)
	}
}
