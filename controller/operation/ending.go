package operation

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	ctrl "sigs.k8s.io/controller-runtime/pkg/reconcile"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

// An operation ends with a step that takes the API away (Step.Ends: every
// control plane shut down together) thus: the turn that counts the step's
// run (countCalls) records the machine Succeeded with its step still named,
// and the operation Succeeded with the step's message, in the same status
// write; only once that write is on the API server does the controller that
// wrote it run the step (launchEnd). Nothing can record the step's result
// afterwards, and nothing has to: the final status is already there. A
// controller that finds an operation so ended (reconcileEnded) never runs
// the step on its own; it asks the kind (EndRecorder) what the machines
// show: the cluster going down, back again, or (a controller stopped
// between the write and the call) still up as before, when the step runs
// again, counted, and decides from the machine.

// endedBy returns the machine whose step ended the operation (see
// TalosOperationStatus.EndingMachine), or nil.
func endedBy(st *ichorv1.TalosOperationStatus) *ichorv1.MachineStatus { return st.EndingMachine() }

// working says whether the runner keeps the machine's results and counts:
// its step is in progress, or ended the operation.
func working(m ichorv1.MachineStatus) bool {
	return m.Phase == ichorv1.MachineInProgress || m.Ends()
}

// endPending reports whether the operation was ended by a step that took
// the API away and the cluster has not come back whole yet: Node events
// wake it, and each turn asks the kind what the machines show.
func endPending(op *ichorv1.TalosOperation) bool {
	if !op.Succeeded() || endedBy(&op.Status) == nil {
		return false
	}
	c := meta.FindStatusCondition(op.Status.Conditions, ichorv1.ConditionClusterBack)
	return c == nil || c.Reason != executor.ReasonAllMachinesBack
}

// inTheCall is the message of the machines that the ending step's call
// covers besides its own (a Once stage's other control planes).
func inTheCall(lead string) string { return "in the call made from " + lead }

// end records, in the turn's working copy, that the machine's step ends
// the operation: it and the machines still pending (the step's call covers
// them) Succeeded; deriveStatus then finds the operation Succeeded, with
// the step's message.
func (t *turn) end(m *ichorv1.MachineStatus, step executor.Step) {
	m.Phase, m.FinishedAt, m.Message = ichorv1.MachineSucceeded, &t.now, step.Ends
	st := &t.op.Status
	for i := range st.Machines {
		o := &st.Machines[i]
		if o.Phase == ichorv1.MachinePending {
			o.Phase, o.FinishedAt, o.Message = ichorv1.MachineSucceeded, &t.now, inTheCall(m.Name)
			// The boot it runs before the call, as its Node reports it: the
			// kind tells from it afterwards whether the call reached the
			// machine (EndRecorder), which a relaunch must not call again.
			if n := t.node(o.Name); n != nil {
				o.BootID = n.Status.NodeInfo.BootID
			}
		}
	}
	t.event(corev1.EventTypeNormal, "Ending", "%s: %s: %s", m.Name, step.Name, step.Ends)
}

// unend takes back an end whose step failed while the API was still there
// to say so: the machine in progress again (fail then records the
// failure), the machines its call covered pending again.
func (t *turn) unend(m *ichorv1.MachineStatus) {
	st := &t.op.Status
	for i := range st.Machines {
		o := &st.Machines[i]
		if o.Phase == ichorv1.MachineSucceeded && o.Message == inTheCall(m.Name) {
			o.Phase, o.FinishedAt, o.Message, o.BootID = ichorv1.MachinePending, nil, "", ""
		}
	}
	m.Phase, m.FinishedAt = ichorv1.MachineInProgress, nil
}

// endingStep is the step that ended the operation, and its run's key.
func (t *turn) endingStep(m *ichorv1.MachineStatus) (executor.Step, stepKey, bool) {
	k := stepKey{t.key(m.Name), m.Step, m.Attempts}
	step, ok := findStep(t.exec.Steps(t.op, m), m.Step)
	return step, k, ok && step.Ends != "" && step.Run != nil
}

// launchEnd runs the step that ended the operation, once the status write
// that records the end is on the API server, and only in the controller
// that wrote its run's count: any other decides from the machines
// (reconcileEnded).
func (t *turn) launchEnd(ctx context.Context) error {
	m := endedBy(&t.persisted.Status)
	if m == nil || t.exec == nil || !t.canLaunch {
		return nil
	}
	step, k, ok := t.endingStep(m)
	if !ok || t.r.runner.busy(k.machineKey, m.Step, m.Attempts) || t.r.runner.counted(k) != m.Calls {
		return nil
	}
	if err := t.checkLock(ctx).wait(); err != nil {
		return fmt.Errorf("not starting %s on %s: %w", m.Step, m.Name, err)
	}
	if err := t.run(*m, step); err != nil {
		t.notStarted(*m, err)
		return err
	}
	return nil
}

// reconcileEnded is the turn of an operation that a step taking the API
// away ended: a failure of that step, reported while the API was still
// there, is recorded (the operation is no longer over); otherwise the
// kind says what the machines show, which is recorded (ClusterBack), and
// the cordons are lifted once the cluster is back.
func (t *turn) reconcileEnded(ctx context.Context) (ctrl.Result, error) {
	if decided, err := t.prepare(ctx); decided || err != nil {
		return ctrl.Result{}, err
	}
	m := endedBy(&t.op.Status)
	step, k, ok := t.endingStep(m)
	rec, isRec := t.exec.(executor.EndRecorder)
	if !ok || !isRec {
		return ctrl.Result{}, nil
	}
	res, done := t.r.runner.take(k.machineKey, m.Step, m.Attempts)
	switch {
	case done && res.err != nil:
		t.unend(m)
		t.fail(m, m.Step, res.err)
		deriveStatus(t.op, t.now, "")
		t.announce()
		return ctrl.Result{}, t.write(ctx)
	case !done && t.r.runner.busy(k.machineKey, m.Step, m.Attempts):
		return ctrl.Result{}, nil // its end wakes the operation
	}
	found, err := rec.Ended(ctx, t.env(*m))
	if err != nil {
		return ctrl.Result{}, err
	}
	if found.Condition != nil {
		meta.SetStatusCondition(&t.op.Status.Conditions, *found.Condition)
	}
	if found.Uncordon {
		if err := t.uncordon(ctx, "the cluster came back"); err != nil {
			return ctrl.Result{}, err
		}
	}
	relaunch := found.Relaunch && !done && t.r.runner.counted(k) != m.Calls
	if relaunch {
		// The controller that wrote the end did not run its step here, or
		// may not have: run it again, counted first, to decide from the machine.
		m.Calls++
		t.r.runner.count(stepKey{k.machineKey, m.Step, m.Attempts}, m.Calls)
	}
	if err := t.write(ctx); err != nil {
		return ctrl.Result{}, err
	}
	if relaunch {
		if err := t.run(*endedBy(&t.persisted.Status), step); err != nil {
			t.notStarted(*m, err)
		}
	}
	return ctrl.Result{RequeueAfter: found.Recheck}, nil
}
