package operation

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

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

// deriveStatus sets the operation's phase, reason, message and conditions
// (and the summary columns) from its facts, once the turn has decided: the
// machines, the failure, spec.paused, the lock, the checks and the
// talosconfig's condition. why is what the turn learnt that no status field
// holds (whom it waits for, why no machine can start). It is the only code
// that sets them, and now is the turn's time.
func deriveStatus(op *ichorv1.TalosOperation, now metav1.Time, why string) {
	st := &op.Status
	boundMessages(st.Machines)
	st.Phase, st.Reason, st.Message = phaseOf(op, why)
	if inFlight := st.InFlight(); !op.DeletionTimestamp.IsZero() && len(inFlight) > 0 {
		st.Message = "deleted: the steps in flight settle before the cordons are lifted and the cluster lock is let go: " + strings.Join(inFlight, ", ")
	}
	if st.Phase != ichorv1.PhasePaused || st.Reason != ichorv1.ReasonClusterLockHeld {
		st.LockHolder = ""
		if st.Lock == ichorv1.LockWaiting {
			st.Lock = ""
		}
	}
	switch terminal := st.Phase == ichorv1.PhaseSucceeded || st.Phase == ichorv1.PhaseRefused || st.Phase == ichorv1.PhaseCancelled; {
	case terminal && st.CompletionTime == nil:
		st.CompletionTime = &now
	case !terminal:
		st.CompletionTime = nil
	}
	if st.Phase == ichorv1.PhaseSucceeded || st.Phase == ichorv1.PhaseRefused {
		st.Lock = ""
	}
	st.Progress, st.Current = plan.Progress(stageMachines(st)), plan.Current(st.Machines)
	finishStage(st, now)
	st.ObservedGeneration = op.Generation
	setReadyCondition(op)
	setProgressingCondition(op)
	setPausedCondition(op)
	setStalledCondition(op)
	setReconcilingCondition(op)
}

// planChangedMessage says why an approved plan does not run, and what to do.
func planChangedMessage(op *ichorv1.TalosOperation) string {
	return fmt.Sprintf("the plan changed since it was approved (the cluster changed before it started) and nothing has run: "+
		"see the new plan and run it with `kubectl ichor operation resume %s`, or delete the operation", op.Name)
}

const (
	retryWaits  = "; a retry is requested and runs when the operation is resumed"
	pausedByYou = "paused by an operator (spec.paused); `kubectl ichor operation resume` lifts it"
)

// phaseOf says where the operation stands, in order of precedence:
// cancelled, refused, succeeded, paused on a failed step, paused by an
// operator, waiting for the lock, pending (not started), running.
func phaseOf(op *ichorv1.TalosOperation, why string) (ichorv1.Phase, string, string) {
	st := &op.Status
	api := meta.FindStatusCondition(st.Conditions, ConditionTalosAPI)
	switch {
	case cancelRequested(op):
		return ichorv1.PhaseCancelled, "Cancelled", cancelledMessage(op)
	case len(refusals(op)) > 0:
		return ichorv1.PhaseRefused, preflight.ConditionReason, preflight.RefusedMessage(refusals(op))
	case st.StartTime != nil && plan.Finished(st):
		// "talos v1.13.7 done on 5/6 machine(s), 1 held: w-3 (held by ...)"
		ms := stageMachines(st)
		done, left, _ := strings.Cut(plan.Progress(ms), ", ")
		msg := fmt.Sprintf("%s done on %s machine(s)", st.Target, done)
		if left != "" {
			msg += ", " + left + ": " + plan.LeftOut(ms)
		}
		if after := ichorv1.Afterwards(op.Spec); after != "" {
			msg += "; afterwards: " + after
		}
		if m := endedBy(st); m != nil {
			msg = m.Message
		}
		return ichorv1.PhaseSucceeded, "Succeeded", msg
	case op.StepFailed():
		msg := failureMessage(st)
		if op.RetryPending() && op.Spec.Paused && !st.RetryConsumed {
			msg += retryWaits
		}
		if inFlight := st.InFlight(); len(inFlight) > 0 {
			msg += "; nothing new starts, and the steps in flight settle first: " + strings.Join(inFlight, ", ")
		}
		return ichorv1.PhasePaused, ichorv1.ReasonStepFailed, msg
	case op.Spec.Paused:
		msg := pausedByYou
		if inFlight := st.InFlight(); len(inFlight) > 0 {
			msg += "; finishing the steps in flight: " + strings.Join(inFlight, ", ")
		}
		return ichorv1.PhasePaused, ichorv1.ReasonPausedByOperator, msg
	case op.PlanChanged():
		return ichorv1.PhasePaused, ichorv1.ReasonPlanChanged, planChangedMessage(op)
	case st.Lock == ichorv1.LockWaiting:
		if why == "" {
			why = "waiting for the cluster lock, held by " + st.LockHolder
		}
		return ichorv1.PhasePaused, ichorv1.ReasonClusterLockHeld, why
	case api != nil && api.Status == metav1.ConditionFalse:
		phase := ichorv1.PhaseRunning
		if st.StartTime == nil {
			phase = ichorv1.PhasePending
		}
		return phase, api.Reason, api.Message
	case st.StartTime == nil:
		return ichorv1.PhasePending, "", "checking"
	case why != "":
		return ichorv1.PhaseRunning, "", why
	}
	return ichorv1.PhaseRunning, "", "running"
}

// Machine messages are bounded so that 5,000 machines, every one of them
// failed, still fit in one object under 1 MiB: each machine's message is
// cut to maxMessage bytes, and together they take at most messagesBudget,
// failed machines first. A message past the budget is dropped: the
// machine's StepFailed Event has it in full. The message of the step that
// ended the operation by taking the API away is kept whole: it is the
// operation's last word, what to do to bring the cluster back, and no
// Event can be read while the API is gone.
const (
	maxMessage     = ichorv1.MachineMessageMax
	messagesBudget = 32 << 10
)

// boundMessages keeps the machines' messages within their bounds.
func boundMessages(ms []ichorv1.MachineStatus) {
	left := messagesBudget
	for _, failed := range []bool{true, false} {
		for i := range ms {
			m := &ms[i]
			if (m.Phase == ichorv1.MachineFailed) != failed || m.Message == "" || m.Ends() {
				continue
			}
			m.Message = cut(m.Message, maxMessage)
			if len(m.Message) > left {
				m.Message = ""
				continue
			}
			left -= len(m.Message)
		}
	}
}

// cut shortens s to at most n bytes, on a rune boundary, marking the cut.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	s = s[:n-len(mark)]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + mark
}

// cancelledMessage says who cancelled the operation, which machines were
// done, and what it still waits for before it lets go.
func cancelledMessage(op *ichorv1.TalosOperation) string {
	_, who := op.CancelRequested()
	st := &op.Status
	var names []string
	ms := stageMachines(st)
	for _, m := range ms {
		if m.Phase == ichorv1.MachineSucceeded {
			names = append(names, m.Name)
		}
	}
	done, _, _ := strings.Cut(plan.Progress(ms), ", ")
	msg := "cancelled by " + who + "; done on " + done + " machine(s)"
	if st.Stage != "" {
		msg = "cancelled by " + who + " in stage " + st.Stage + "; done there on " + done + " machine(s)"
	}
	if len(names) > 0 {
		msg += ": " + strings.Join(names, ", ")
	}
	if inFlight := st.InFlight(); len(inFlight) > 0 {
		msg += "; the steps in flight settle before the cordons are lifted and the cluster lock is let go: " + strings.Join(inFlight, ", ")
	}
	return msg
}

// failureMessage says which step failed where: the failure's reason, the
// first failed machine and its message, and how many others failed too.
func failureMessage(st *ichorv1.TalosOperationStatus) string {
	var failed []string
	for _, m := range st.Machines {
		if m.Phase == ichorv1.MachineFailed {
			failed = append(failed, m.Name)
		}
	}
	m := st.FailedMachine()
	if m == nil {
		return st.FailureReason
	}
	msg := fmt.Sprintf("%s on %s (%s): %s", st.FailureReason, m.Name, orDash(m.Step), m.Message)
	if len(failed) > 1 {
		msg += fmt.Sprintf("; %d machines failed: %s", len(failed), plan.Current(st.Machines))
	}
	return msg
}

// The three standard conditions: each says one thing of the phase, with
// the phase's reason (or the phase itself) and message.

// setReadyCondition: True once the operation has succeeded.
func setReadyCondition(op *ichorv1.TalosOperation) {
	setCondition(op, ichorv1.ConditionReady, op.Status.Phase == ichorv1.PhaseSucceeded, string(op.Status.Phase))
}

// setProgressingCondition: True while machines are being worked on.
func setProgressingCondition(op *ichorv1.TalosOperation) {
	setCondition(op, ichorv1.ConditionProgressing, op.Status.Phase == ichorv1.PhaseRunning, op.Status.Reason)
}

// setPausedCondition: True while the operation is Paused, for any reason.
func setPausedCondition(op *ichorv1.TalosOperation) {
	setCondition(op, ichorv1.ConditionPaused, op.Status.Phase == ichorv1.PhasePaused, op.Status.Reason)
}

// stalled reports whether only a person can move the operation on, or
// nothing can: it was cancelled and its steps in flight have settled.
func stalled(op *ichorv1.TalosOperation) bool {
	switch op.Status.Phase {
	case ichorv1.PhaseRefused:
		return true
	case ichorv1.PhaseCancelled:
		return op.Settled()
	}
	return op.Status.Phase == ichorv1.PhasePaused && op.FailedAndSettled()
}

// setStalledCondition: True when refused, paused on a failed step or
// cancelled, once the steps in flight have settled, with the failure's
// reason (a cancelled operation's: Cancelled).
func setStalledCondition(op *ichorv1.TalosOperation) {
	reason := op.Status.Reason
	if op.Status.FailureReason != "" && op.Status.Phase != ichorv1.PhaseCancelled {
		reason = op.Status.FailureReason
	}
	setCondition(op, ichorv1.ConditionStalled, stalled(op), reason)
}

// setReconcilingCondition: True while the operation still moves by itself
// (neither succeeded nor stalled).
func setReconcilingCondition(op *ichorv1.TalosOperation) {
	setCondition(op, ichorv1.ConditionReconciling, op.Status.Phase != ichorv1.PhaseSucceeded && !stalled(op), op.Status.Reason)
}

func setCondition(op *ichorv1.TalosOperation, conditionType string, ok bool, reason string) {
	st := &op.Status
	status := metav1.ConditionFalse
	if ok {
		status = metav1.ConditionTrue
	}
	if reason == "" {
		reason = string(st.Phase)
	}
	msg := st.Message
	if msg == "" {
		msg = string(st.Phase)
	}
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: conditionType, Status: status, Reason: reason, Message: msg, ObservedGeneration: op.Generation})
}

// Checks of the controller's own, beside preflight's.
const (
	// CheckKindSupported: this controller carries out the kind.
	CheckKindSupported = ichorv1.CheckKindSupported
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

// refusals are the failed checks that refuse the operation: those not overridden.
func refusals(op *ichorv1.TalosOperation) []preflight.Failure {
	var out []preflight.Failure
	for _, c := range op.Status.Conditions {
		if isCheck(c.Type) && c.Status == metav1.ConditionFalse && c.Reason == preflight.ConditionReason {
			out = append(out, preflight.Failure{Check: c.Type, Message: c.Message})
		}
	}
	return out
}

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

// entry returns the status entry of the named machine.
func entry(st *ichorv1.TalosOperationStatus, name string) *ichorv1.MachineStatus {
	for i := range st.Machines {
		if st.Machines[i].Name == name {
			return &st.Machines[i]
		}
	}
	return nil
}

// stageMachines are the machines of the stage in progress (every machine,
// for a kind without stages).
func stageMachines(st *ichorv1.TalosOperationStatus) []ichorv1.MachineStatus {
	s, _ := plan.Stage(st)
	ms, _ := plan.InStage(st.Machines, s)
	return ms
}

// finishStage records the end of the stage in progress once every machine
// of it is done: the next turn begins the next stage (advanceStage).
func finishStage(st *ichorv1.TalosOperationStatus, now metav1.Time) {
	s, _ := plan.Stage(st)
	if s == nil || s.StartedAt == nil || s.FinishedAt != nil {
		return
	}
	if ms := stageMachines(st); plan.AllDone(ms) {
		s.FinishedAt, s.Progress = &now, plan.Progress(ms)
	}
}
