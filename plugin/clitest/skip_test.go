package clitest

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestSkipAgainstTheAPIServer skips a failed machine through the real
// kubectl: what cannot be skipped (a machine the operation does not have,
// one with a step in flight, one that has not started) exits 1 and changes
// nothing; the skip of the failed machine writes the annotations naming the
// requester the API server knows, a second skip changes nothing; once the
// controller has acted, watch shows the machine skipped and the operation
// done on 3/4, and skip refuses an operation that has succeeded.
func TestSkipAgainstTheAPIServer(t *testing.T) {
	ns := env.Namespace(t)
	op := createOp(t, ns, "op")
	setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, Lock: ichorv1.LockHeld,
		FailureReason: "InstallFailed", Message: "InstallFailed on w-1 (install): no disk", Progress: "1/4",
		Machines: []ichorv1.MachineStatus{
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded},
			{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineFailed, Step: "install", Message: "no disk"},
			{Name: "w-2", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "wait-rebooted"},
			{Name: "w-3", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending},
		}})
	tr := &transcript{t: t, ns: ns}

	rv := getOp(t, ns, "op").ResourceVersion
	for _, m := range []string{"w-9", "w-2", "w-3"} {
		if r := tr.run("ichor", "operation", "skip", "op", m); r.code != 1 {
			t.Errorf("skip %s: exit %d, want 1", m, r.code)
		}
	}
	if getOp(t, ns, "op").ResourceVersion != rv {
		t.Error("a refused skip changed the object")
	}

	tr.run("ichor", "operation", "skip", "op", "w-1", "--uncordon")
	got := getOp(t, ns, "op")
	req, ok := got.SkipRequested()
	if want := (ichorv1.SkipRequest{Machine: "w-1", By: "ichor-test-admin", Uncordon: true}); !ok || req != want {
		t.Errorf("skip left annotations %v, want a request %+v", got.Annotations, want)
	}
	rv = got.ResourceVersion
	tr.run("ichor", "operation", "skip", "op", "w-1")
	if getOp(t, ns, "op").ResourceVersion != rv {
		t.Error("a second skip changed the object")
	}

	// The controller's part: the skip acted on, its annotations removed,
	// the other machines done.
	for _, a := range []string{ichorv1.SkipAnnotation, ichorv1.SkipByAnnotation, ichorv1.SkipUncordonAnnotation} {
		delete(got.Annotations, a)
	}
	if err := env.Client.Update(t.Context(), got); err != nil {
		t.Fatal(err)
	}
	st := got.Status
	st.Phase, st.Reason, st.FailureReason, st.Lock = ichorv1.PhaseSucceeded, "Succeeded", "", ""
	st.Machines[1].Phase, st.Machines[1].Message = ichorv1.MachineSkipped, "skipped by ichor-test-admin after its step install failed: no disk"
	st.Machines[2].Phase, st.Machines[2].Step = ichorv1.MachineSucceeded, ""
	st.Machines[3].Phase = ichorv1.MachineSucceeded
	st.Progress = "3/4, 1 skipped"
	st.Message = "talos v1.13.7 done on 3/4 machine(s), 1 skipped: w-1 (skipped by ichor-test-admin after its step install failed: no disk)"
	started := metav1.NewTime(time.Now().Add(-90 * time.Second))
	completed := metav1.NewTime(started.Add(90 * time.Second))
	st.StartTime, st.CompletionTime = &started, &completed
	setStatus(t, got, st)
	tr.run("ichor", "watch", "op", "--timeout", "1m")
	tr.run("ichor", "operation", "skip", "op", "w-1")
	golden(t, "testdata/skip.golden", tr.b.String())
}
