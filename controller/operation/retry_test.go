package operation_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// TestFailureAndRetry: a failed step pauses the operation with a
// failureReason and nothing runs by itself; retry=yes is ignored; retry=true
// while spec.paused waits untouched; resuming runs only the failed step
// again, records lastRetry and removes the annotation.
func TestFailureAndRetry(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	c.fleet.Machine(w(2)).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))

	op := c.waitFor("upgrade", "to fail on "+w(2), time.Minute, (*ichorv1.TalosOperation).StepFailed)
	if op.Status.Phase != ichorv1.PhasePaused || op.Status.Reason != ichorv1.ReasonStepFailed || op.Status.FailureReason != "InstallFailed" {
		t.Fatalf("phase %s reason %s failureReason %q", op.Status.Phase, op.Status.Reason, op.Status.FailureReason)
	}
	failed := op.Status.FailedMachine()
	if failed == nil || failed.Name != w(2) || failed.Step != "install" || !strings.Contains(failed.Message, "Internal") {
		t.Fatalf("failed machine: %+v", failed)
	}
	if m := entryOf(op, w(1)); m.Phase != ichorv1.MachineSucceeded {
		t.Fatalf("%s is %s", w(1), m.Phase)
	}
	calls := c.fleet.Recorder().CallCounts()

	// Any other value than "true" is ignored, and left alone.
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=yes")
	c.patchSpec("upgrade", `{"paused":true}`)
	op = c.waitFor("upgrade", "to observe the pause", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.ObservedGeneration == op.Generation
	})
	if op.Status.RetryCount != 0 || op.Annotations[ichorv1.RetryAnnotation] != "yes" || !op.StepFailed() {
		t.Fatalf("retry=yes was acted on: retryCount %d annotation %q failure %q", op.Status.RetryCount, op.Annotations[ichorv1.RetryAnnotation], op.Status.FailureReason)
	}

	// retry=true while spec.paused waits untouched.
	c.kubectl("annotate", "--overwrite", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	op = c.waitFor("upgrade", "to see the retry request", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return strings.Contains(op.Status.Message, "a retry is requested and runs when the operation is resumed")
	})
	if op.Status.RetryCount != 0 || op.Status.LastRetry != nil || !op.RetryPending() || !op.StepFailed() {
		t.Fatalf("the retry ran while paused: retryCount %d lastRetry %v pending %v", op.Status.RetryCount, op.Status.LastRetry, op.RetryPending())
	}
	if now := c.fleet.Recorder().CallCounts(); !reflect.DeepEqual(now, calls) {
		t.Fatalf("machines were called while the operation was paused on its failure:\nbefore %v\nafter  %v", calls, now)
	}

	// Fix the cause, then resume: the retry runs the failed step once.
	c.fleet.Machine(w(2)).ClearFaults()
	c.patchSpec("upgrade", `{"paused":false}`)
	op = c.waitSucceeded("upgrade", time.Minute)
	if op.Status.RetryCount != 1 || op.Status.LastRetry == nil || op.RetryPending() {
		t.Errorf("retryCount %d lastRetry %v annotation %q", op.Status.RetryCount, op.Status.LastRetry, op.Annotations[ichorv1.RetryAnnotation])
	}
	if _, ok := op.Annotations[ichorv1.RetryAnnotation]; ok {
		t.Errorf("the retry annotation was not removed")
	}
	rec := c.fleet.Recorder()
	for i, want := range map[int]int{1: 1, 2: 2, 3: 1} {
		if n := rec.Calls(w(i), "MachineService/Upgrade"); n != want {
			t.Errorf("%s: %d upgrade calls, want %d", w(i), n, want)
		}
		if n := rec.UpgradesApplied(w(i)); n != 1 {
			t.Errorf("%s: %d upgrades took effect, want 1", w(i), n)
		}
	}
	if m := entryOf(op, w(2)); m.Attempts != 2 {
		t.Errorf("%s attempts %d, want 2", w(2), m.Attempts)
	}

	// A retry request on an operation with nothing failed is removed, not kept for later.
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	found := false
	for _, e := range c.events("upgrade") {
		found = found || e.Reason == "Retrying"
	}
	if !found {
		t.Errorf("no Retrying Event")
	}
	checkMetrics(t)
}

// TestRetryWithKubectlAnnotate is the specification's own recipe, with
// the real kubectl and nothing else.
func TestRetryWithKubectlAnnotate(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal, Once: true})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to fail", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	c.kubectl("annotate", "talosoperation", "upgrade", "ichor.maesh.dev/retry=true")
	op := c.waitSucceeded("upgrade", time.Minute)
	if op.Status.RetryCount != 1 || op.Status.LastRetry == nil || op.RetryPending() {
		t.Errorf("retryCount %d lastRetry %v pending %v", op.Status.RetryCount, op.Status.LastRetry, op.RetryPending())
	}
}
