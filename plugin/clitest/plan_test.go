package clitest

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestPlan: against a real controller and fleet, `--plan` creates the
// operation paused and prints the controller's plan. Without a terminal it
// stays paused, saying how to resume it; on a terminal a no deletes it; a
// plan that changed before the answer (a worker put on hold) is shown again
// and asked about again; --yes runs it. Nothing is upgraded before a yes.
func TestPlan(t *testing.T) {
	ns, ctrlNS, fleet := withController(t)
	upgraded := func() bool {
		for _, m := range fleet.Machines() {
			if m.Version() == "v1.13.7" {
				return true
			}
		}
		return false
	}
	args := func(name string, more ...string) []string {
		return append([]string{"ichor", "upgrade", "talos", "--to", "v1.13.7", "--max-unavailable", "2", "--plan", "--name", name, "-n", ns, "--controller-namespace", ctrlNS}, more...)
	}

	r := kubectl(t, "", args("no-terminal")...)
	tr := strings.NewReplacer(ns, "NS")
	golden(t, "testdata/plan-no-terminal.golden", tr.Replace(r.out+"stderr: "+r.err))
	if r.code != 0 {
		t.Fatalf("--plan without a terminal: exit %d, stderr %q", r.code, r.err)
	}
	if op := getOp(t, ns, "no-terminal"); !op.Spec.Paused || op.Status.StartTime != nil || upgraded() {
		t.Fatalf("--plan without a terminal did not leave it paused and unstarted: paused %v, started %v", op.Spec.Paused, op.Status.StartTime)
	}
	ok(t, "delete", "talosoperation", "no-terminal", "-n", ns)

	p := startTerminal(t, args("answered-no")...)
	p.waitOutput(t, "Run this plan? [y/N]: ")
	p.typeKeys(t, "n\r")
	if code := p.wait(t); code != 0 {
		t.Fatalf("no: exit %d\n%s", code, p.stdout())
	}
	// The controller removes its finalizer once the deletion is seen.
	testenv.Eventually(t, time.Minute, "a no to delete the operation", func(ctx context.Context) (bool, error) {
		err := env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "answered-no"}, &ichorv1.TalosOperation{})
		return apierrors.IsNotFound(err), client.IgnoreNotFound(err)
	})
	if !strings.Contains(p.stdout(), "talosoperation.ichor.maesh.dev/answered-no deleted; nothing ran") || upgraded() {
		t.Errorf("a no did not say it deleted it, or something ran:\n%s", p.stdout())
	}

	// The plan changes before the answer: a worker is put on hold.
	w2 := fleet.Machines()[2].Name()
	p = startTerminal(t, args("changed", "--wait", "--timeout", "2m")...)
	p.waitOutput(t, "Run this plan? [y/N]: ")
	node := &corev1.Node{}
	if err := env.Client.Get(context.Background(), client.ObjectKey{Name: w2}, node); err != nil {
		t.Fatal(err)
	}
	before := node.DeepCopy()
	if node.Annotations == nil {
		node.Annotations = map[string]string{}
	}
	node.Annotations[ichorv1.UpgradeHoldAnnotation] = "a disk"
	if err := env.Client.Patch(context.Background(), node, client.MergeFrom(before)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "the controller to plan "+w2+" held", func(context.Context) (bool, error) {
		m := getOp(t, ns, "changed").Status.Machines
		return len(m) == 3 && m[2].Phase == ichorv1.MachineSkipped, nil
	})
	p.typeKeys(t, "y\r")
	p.waitOutput(t, "The plan changed since it was printed (the cluster changed); the new plan:")
	if upgraded() {
		t.Fatal("a yes to a plan that changed ran it")
	}
	p.typeKeys(t, "y\r")
	if code := p.wait(t); code != 0 {
		t.Fatalf("yes to the new plan: exit %d\n%s", code, p.stdout())
	}
	if v := fleet.Machine(w2).Version(); v == "v1.13.7" {
		t.Errorf("the held %s was upgraded", w2)
	}

	// --yes runs it without asking.
	if err := env.Client.Get(context.Background(), client.ObjectKey{Name: w2}, node); err != nil {
		t.Fatal(err)
	}
	before = node.DeepCopy()
	delete(node.Annotations, ichorv1.UpgradeHoldAnnotation)
	if err := env.Client.Patch(context.Background(), node, client.MergeFrom(before)); err != nil {
		t.Fatal(err)
	}
	r = kubectl(t, "", args("yes", "--yes", "--wait", "--timeout", "2m")...)
	if r.code != 0 || !strings.Contains(r.out, "talosoperation.ichor.maesh.dev/yes resumed: it runs the plan above") || fleet.Machine(w2).Version() != "v1.13.7" {
		t.Errorf("--plan --yes: exit %d, %s on %s\nstdout %s\nstderr %s", r.code, w2, fleet.Machine(w2).Version(), r.out, r.err)
	}
}

// TestApprovedPlanChanges: a plan approved with --plan --yes waits for the
// cluster lock; meanwhile a worker is put on hold, so the controller plans
// again and the plan differs. The operation is held (PlanChanged) and does
// not start when the lock comes free, nor keep a newer operation out;
// `operation resume` shows the new plan, refuses without a terminal or
// --yes, and runs it with --yes.
func TestApprovedPlanChanges(t *testing.T) {
	ns, ctrlNS, fleet := withController(t)
	w1, w2 := fleet.Machines()[1].Name(), fleet.Machines()[2].Name()
	release := fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reboot"})
	ok(t, "ichor", "node", "reboot", w1, "--name", "holder", "-n", ns, "--controller-namespace", ctrlNS)
	testenv.Eventually(t, time.Minute, "holder to hold the cluster lock", func(context.Context) (bool, error) {
		return getOp(t, ns, "holder").Status.Lock == ichorv1.LockHeld, nil
	})

	r := kubectl(t, "", "ichor", "upgrade", "talos", "--to", "v1.13.7", "--plan", "--yes", "--name", "approved", "-n", ns, "--controller-namespace", ctrlNS)
	if r.code != 0 || !strings.Contains(r.out, "resumed: it runs the plan above") {
		t.Fatalf("--plan --yes: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	testenv.Eventually(t, time.Minute, "approved to wait for the lock", func(context.Context) (bool, error) {
		return getOp(t, ns, "approved").Status.Reason == ichorv1.ReasonClusterLockHeld, nil
	})
	hold(t, w2, "a disk")
	op := waitReason(t, ns, "approved", ichorv1.ReasonPlanChanged)
	if !strings.Contains(op.Status.Message, "operation resume approved") {
		t.Errorf("the PlanChanged message does not say how to go on: %q", op.Status.Message)
	}

	// The lock comes free: a newer operation takes it, approved does not.
	release()
	testenv.Eventually(t, time.Minute, "holder to succeed", func(context.Context) (bool, error) {
		return getOp(t, ns, "holder").Succeeded(), nil
	})
	if r := kubectl(t, "", "ichor", "node", "reboot", w1, "--name", "newer", "-n", ns, "--controller-namespace", ctrlNS, "--wait", "--timeout", "2m"); r.code != 0 {
		t.Fatalf("a newer operation behind the held one: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	if op := getOp(t, ns, "approved"); op.Status.StartTime != nil || op.Status.Reason != ichorv1.ReasonPlanChanged {
		t.Fatalf("approved started on a plan nobody approved: %s/%s", op.Status.Phase, op.Status.Reason)
	}

	r = kubectl(t, "", "ichor", "operation", "resume", "approved", "-n", ns)
	if r.code == 0 || !strings.Contains(r.out, "the new plan:") || !strings.Contains(r.out, w2) || !strings.Contains(r.err, "resume approved --yes") {
		t.Errorf("resume without a terminal or --yes: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	if op := getOp(t, ns, "approved"); op.Status.StartTime != nil {
		t.Fatal("resume without a terminal or --yes started it")
	}
	r = kubectl(t, "", "ichor", "operation", "resume", "approved", "-n", ns, "--yes", "--wait", "--timeout", "2m")
	if r.code != 0 || !strings.Contains(r.out, "resumed: it runs the plan above") {
		t.Fatalf("resume --yes: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	if v := fleet.Machine(w1).Version(); v != "v1.13.7" {
		t.Errorf("%s runs %s after the new plan ran", w1, v)
	}
	if v := fleet.Machine(w2).Version(); v == "v1.13.7" {
		t.Errorf("the held %s was upgraded", w2)
	}
}

// hold puts a Node on hold (UpgradeHoldAnnotation) for why.
func hold(t *testing.T, node, why string) {
	t.Helper()
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), client.ObjectKey{Name: node}, n); err != nil {
		t.Fatal(err)
	}
	before := n.DeepCopy()
	if n.Annotations == nil {
		n.Annotations = map[string]string{}
	}
	n.Annotations[ichorv1.UpgradeHoldAnnotation] = why
	if err := env.Client.Patch(context.Background(), n, client.MergeFrom(before)); err != nil {
		t.Fatal(err)
	}
}

func waitReason(t *testing.T, ns, name, reason string) *ichorv1.TalosOperation {
	t.Helper()
	var op *ichorv1.TalosOperation
	testenv.Eventually(t, time.Minute, name+" to be "+reason, func(context.Context) (bool, error) {
		op = getOp(t, ns, name)
		return op.Status.Reason == reason, nil
	})
	return op
}
