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
