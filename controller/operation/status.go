package operation

import (
	"slices"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/controller/preflight"
)

// Condition types besides Ready, Progressing and Paused.
const (
	// ConditionTalosAPI is False while there is no usable talosconfig.
	ConditionTalosAPI = "TalosAPIReady"
)

// setPhase moves the operation to a phase with a reason and message and
// keeps the three standard conditions in step with it.
func setPhase(op *ichorv1.TalosOperation, phase ichorv1.Phase, reason, message string) {
	st := &op.Status
	st.Phase, st.Reason, st.Message = phase, reason, message
	gen := op.Generation
	cond := func(t string, ok bool, reason, msg string) {
		s := metav1.ConditionFalse
		if ok {
			s = metav1.ConditionTrue
		}
		if reason == "" {
			reason = string(phase)
		}
		if msg == "" {
			msg = string(phase)
		}
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: t, Status: s, Reason: reason, Message: msg, ObservedGeneration: gen})
	}
	cond(ichorv1.ConditionReady, phase == ichorv1.PhaseSucceeded, "", message)
	cond(ichorv1.ConditionProgressing, phase == ichorv1.PhaseRunning, reason, message)
	cond(ichorv1.ConditionPaused, phase == ichorv1.PhasePaused, reason, message)
	st.ObservedGeneration = gen
}

// Checks of the controller's own, beside preflight's.
const (
	// CheckKindSupported: this controller carries out the kind.
	CheckKindSupported = "KindSupported"
	// CheckActionAllowed: the kind's action makes sense on its machines.
	CheckActionAllowed = "ActionAllowed"
)

func isCheck(conditionType string) bool {
	return conditionType == CheckKindSupported || conditionType == CheckActionAllowed || slices.Contains(preflight.Checks, conditionType)
}

// setChecks records failed preflight checks, one condition each (type: the
// check's name), and drops the conditions of checks that pass now.
func setChecks(op *ichorv1.TalosOperation, failures []preflight.Failure, overridden bool) {
	op.Status.Conditions = slices.DeleteFunc(op.Status.Conditions, func(c metav1.Condition) bool { return isCheck(c.Type) })
	reason := preflight.ConditionReason
	if overridden {
		reason = overriddenReason
	}
	for _, f := range failures {
		meta.SetStatusCondition(&op.Status.Conditions, metav1.Condition{
			Type: f.Check, Status: metav1.ConditionFalse, Reason: reason,
			Message: f.Message, ObservedGeneration: op.Generation,
		})
	}
}

const overriddenReason = "Overridden"

// overrideRecorded reports whether the conditions already record these
// checks as overridden, so the PreflightOverridden Event is left once.
func overrideRecorded(op *ichorv1.TalosOperation, fs []preflight.Failure) bool {
	for _, f := range fs {
		cond := meta.FindStatusCondition(op.Status.Conditions, f.Check)
		if cond == nil || cond.Reason != overriddenReason {
			return false
		}
	}
	return true
}

// summarise refreshes the flat fields the printer columns show.
func summarise(st *ichorv1.TalosOperationStatus) {
	st.Progress = plan.Progress(st.Machines)
	st.Current = plan.Current(st.Machines)
}

// entry returns the status entry of the named machine.
func entry(st *ichorv1.TalosOperationStatus, name string) *ichorv1.MachineStatus {
	for i := range st.Machines {
		if st.Machines[i].Name == name {
			return &st.Machines[i]
		}
	}
	return nil
}

func allDone(ms []ichorv1.MachineStatus) bool {
	for _, m := range ms {
		if !plan.Done(m.Phase) {
			return false
		}
	}
	return true
}
