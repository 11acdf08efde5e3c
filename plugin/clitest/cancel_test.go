package clitest

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// transcript runs kubectl steps one after another and writes what each
// printed and its exit code, as a person would see them in a terminal; the
// namespace reads NS and timestamps TIME, so the transcript can be golden.
type transcript struct {
	t  *testing.T
	ns string
	b  strings.Builder
}

var timestamp = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`)

func (tr *transcript) run(args ...string) result {
	tr.t.Helper()
	r := kubectl(tr.t, "", append(args, "-n", tr.ns)...)
	clean := func(s string) string { return timestamp.ReplaceAllString(strings.ReplaceAll(s, tr.ns, "NS"), "TIME") }
	fmt.Fprintf(&tr.b, "$ kubectl %s\n", strings.Join(args, " "))
	tr.b.WriteString(clean(r.out))
	for _, l := range strings.SplitAfter(clean(r.err), "\n") {
		if l != "" {
			tr.b.WriteString("stderr: " + l)
		}
	}
	fmt.Fprintf(&tr.b, "(exit %d)\n\n", r.code)
	return r
}

// TestCancelAgainstTheAPIServer cancels through the real kubectl: the
// annotation names the requester the API server knows (a SelfSubjectReview),
// a second cancel changes nothing, and once the controller has written
// Cancelled, watch ends with exit 2 and the message, and cancel and resume
// refuse, saying to create a new operation.
func TestCancelAgainstTheAPIServer(t *testing.T) {
	ns := env.Namespace(t)
	op := createOp(t, ns, "op")
	setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Progress: "0/2",
		Machines: []ichorv1.MachineStatus{
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: "install"},
			{Name: "worker-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending},
		}})
	tr := &transcript{t: t, ns: ns}

	tr.run("ichor", "operation", "cancel", "op")
	got := getOp(t, ns, "op")
	asked, who := got.CancelRequested()
	if !asked || who == "an operator" {
		t.Errorf("cancel left annotations %v, want %s naming the requester", got.Annotations, ichorv1.CancelAnnotation)
	}
	rv := got.ResourceVersion
	tr.run("ichor", "operation", "cancel", "op")
	if getOp(t, ns, "op").ResourceVersion != rv {
		t.Error("a second cancel changed the object")
	}

	// The controller's part: the install settled, the lock let go.
	got.Status.Phase, got.Status.Reason, got.Status.Lock = ichorv1.PhaseCancelled, "Cancelled", ""
	got.Status.Machines[0].Phase, got.Status.Machines[0].Step, got.Status.Progress = ichorv1.MachineSucceeded, "", "1/2"
	got.Status.Message = "cancelled by " + who + "; done on 1/2 machine(s): cp-1"
	setStatus(t, got, got.Status)
	tr.run("ichor", "watch", "op", "--timeout", "1m")
	tr.run("ichor", "operation", "cancel", "op")
	tr.run("ichor", "operation", "resume", "op")
	golden(t, "testdata/cancel.golden", tr.b.String())
}
