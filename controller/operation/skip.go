package operation

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

// skipAnnotations are the annotations of a skip request, removed together
// once the request has been acted on.
var skipAnnotations = []string{ichorv1.SkipAnnotation, ichorv1.SkipByAnnotation, ichorv1.SkipUncordonAnnotation}

// actOnSkip acts on a skip request (ichorv1.SkipAnnotation) once, like a
// retry request: the machine's Skipped phase in status is the record that
// it was acted on, so a request whose annotation is still there (its
// removal failed) names a Skipped machine and is only removed again. A
// request the operation cannot act on is removed with an Event saying why
// (ichorv1.CannotSkip: a step in flight is never skipped under an
// irreversible call). Ichor's cordon is lifted first, when asked, so that a
// failed uncordon leaves the request to the next turn with nothing recorded.
func (t *turn) actOnSkip(ctx context.Context) error {
	req, ok := t.op.SkipRequested()
	if !ok {
		return nil
	}
	t.dropSkip = true
	m := t.op.Status.Machine(req.Machine)
	if m != nil && m.Phase == ichorv1.MachineSkipped {
		return nil
	}
	if why := t.op.CannotSkip(req.Machine); why != "" {
		t.ignoreSkip(req, why)
		return nil
	}
	cordon := "Ichor's cordon, if any, stays"
	if req.Uncordon {
		if err := t.uncordonMachine(ctx, *m, "skipped by "+req.By); err != nil {
			t.dropSkip = false
			return err
		}
		cordon = "Ichor's cordon lifted"
	}
	t.skip(m, req.By)
	t.event(corev1.EventTypeNormal, "MachineSkipped", "%s: %s; %s", m.Name, m.Message, cordon)
	return nil
}

// ignoreSkip removes a skip request that cannot be acted on, and says why.
func (t *turn) ignoreSkip(req ichorv1.SkipRequest, why string) {
	t.dropSkip = true
	t.event(corev1.EventTypeNormal, "SkipIgnored", "%s=%s removed: %s", ichorv1.SkipAnnotation, req.Machine, why)
}

// skip gives up on a failed machine: it is Skipped, no longer counts as
// this operation's disruption against maxUnavailable, and the operation
// goes on with the rest once no other machine's step has failed.
func (t *turn) skip(m *ichorv1.MachineStatus, by string) {
	m.Message = fmt.Sprintf("skipped by %s after its step %s failed: %s", by, orDash(m.Step), m.Message)
	m.Phase, m.FinishedAt, m.Stopped, m.Calls, m.BootID = ichorv1.MachineSkipped, &t.now, false, 0, ""
	if t.op.Status.FailedMachine() == nil {
		t.op.Status.FailureReason = ""
	}
}

// uncordonMachine lifts the cordon the operation made on one machine (its
// identity marks it), with its kind's own uncordon step; a Node that is gone
// or that the operation did not cordon is left alone.
func (t *turn) uncordonMachine(ctx context.Context, m ichorv1.MachineStatus, why string) error {
	n := t.node(m.Name)
	if n == nil || n.Annotations[executor.CordonedByAnnotation] != ichorv1.OperationIdentity(t.op.Namespace, t.op.Name) {
		return nil
	}
	step, ok := findStep(t.exec.Steps(t.op, &m), executor.StepUncordon)
	if !ok || step.Run == nil {
		// A kind that lifts its cordon inside another step (config's
		// verify) has none of its own: the cordon is this operation's
		// all the same.
		step = executor.Uncordon()
	}
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := step.Run(sctx, t.stepEnv(m)); err != nil {
		return fmt.Errorf("lift the cordon of %s: %w", m.Name, err)
	}
	t.event(corev1.EventTypeNormal, "Uncordoned", "%s: cordon lifted (%s)", m.Name, why)
	return nil
}
