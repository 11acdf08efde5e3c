package operation

import (
	"testing"

	"sigs.k8s.io/controller-runtime/pkg/event"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestTurnChanged: the changes of an operation that wake the operations
// waiting for the lock are those that can change whose turn it is. A step
// of a running holder settling is not one (each of its machines would
// wake every waiter); it is once a step failed or the holder was
// cancelled, since the judge then takes a settled holder over.
func TestTurnChanged(t *testing.T) {
	op := func(phase ichorv1.Phase, failure string, inFlight bool) *ichorv1.TalosOperation {
		m := ichorv1.MachineStatus{Name: "w1", Phase: ichorv1.MachineSucceeded}
		if inFlight {
			m.Phase, m.Step = ichorv1.MachineInProgress, "reboot"
		}
		return &ichorv1.TalosOperation{Status: ichorv1.TalosOperationStatus{Phase: phase, FailureReason: failure,
			Machines: []ichorv1.MachineStatus{m}}}
	}
	paused := func(o *ichorv1.TalosOperation) *ichorv1.TalosOperation { o.Spec.Paused = true; return o }
	for _, tc := range []struct {
		name     string
		old, new *ichorv1.TalosOperation
		want     bool
	}{
		{"a running holder's step settles", op(ichorv1.PhaseRunning, "", true), op(ichorv1.PhaseRunning, "", false), false},
		{"a running holder's next step starts", op(ichorv1.PhaseRunning, "", false), op(ichorv1.PhaseRunning, "", true), false},
		{"the holder completes", op(ichorv1.PhaseRunning, "", false), op(ichorv1.PhaseSucceeded, "", false), true},
		{"a step fails", op(ichorv1.PhasePaused, "", true), op(ichorv1.PhasePaused, "StepFailed", true), true},
		{"a failed holder's last step settles", op(ichorv1.PhasePaused, "StepFailed", true), op(ichorv1.PhasePaused, "StepFailed", false), true},
		{"a cancelled holder's last step settles", op(ichorv1.PhaseCancelled, "", true), op(ichorv1.PhaseCancelled, "", false), true},
		{"an operator pauses", op(ichorv1.PhaseRunning, "", true), paused(op(ichorv1.PhaseRunning, "", true)), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := turnChanged().Update(event.UpdateEvent{ObjectOld: tc.old, ObjectNew: tc.new}); got != tc.want {
				t.Errorf("turnChanged passes it: %v, want %v", got, tc.want)
			}
		})
	}
}
