package operation

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrl "sigs.k8s.io/controller-runtime/pkg/reconcile"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/controller/preflight"
)

// plan (re)builds the machine list of an operation that has not started, so
// that Nodes joining or holds added while it waits are taken into account.
func (t *turn) plan() error {
	op := t.op
	selected, err := t.selected()
	if err != nil {
		return err
	}
	inScope, err := t.exec.Scope(op, selected)
	if err != nil {
		return err
	}
	if len(inScope) == 0 {
		if op.Spec.Machines != nil {
			return errors.New("spec.machines selects no Node: check the selector against `kubectl get nodes --show-labels`")
		}
		return errors.New("the cluster has no Nodes")
	}
	ms := make([]plan.Machine, 0, len(inScope))
	for i := range inScope {
		n := &inScope[i]
		ms = append(ms, plan.Machine{Name: n.Name, Role: machine.Role(n), Labels: n.Labels, Annotations: n.Annotations, Version: machine.TalosVersion(n)})
	}
	summary, to := t.exec.Target(op)
	op.Status.Target = summary
	op.Status.Machines = plan.Initial(ms, to, t.exec.HonourHold())
	if op.Status.Phase == "" {
		setPhase(op, ichorv1.PhasePending, "", "checking")
	}
	return nil
}

func (t *turn) selected() ([]corev1.Node, error) {
	if t.op.Spec.Machines == nil {
		return t.nodes, nil
	}
	sel, err := metav1.LabelSelectorAsSelector(t.op.Spec.Machines)
	if err != nil {
		return nil, fmt.Errorf("spec.machines: %w", err)
	}
	var out []corev1.Node
	for _, n := range t.nodes {
		if sel.Matches(labels.Set(n.Labels)) {
			out = append(out, n)
		}
	}
	return out, nil
}

// node returns the machine's Node (nil if gone), from an index built once per turn.
func (t *turn) node(name string) *corev1.Node {
	if t.byName == nil {
		t.byName = make(map[string]*corev1.Node, len(t.nodes))
		for i := range t.nodes {
			t.byName[t.nodes[i].Name] = &t.nodes[i]
		}
	}
	return t.byName[name]
}

// controlPlanes are the Talos addresses of every control plane, computed once per turn.
func (t *turn) controlPlanes() []string {
	if t.cps != nil {
		return t.cps
	}
	t.cps = []string{}
	for i := range t.nodes {
		if machine.Role(&t.nodes[i]) == ichorv1.RoleControlPlane {
			if a := machine.Address(&t.nodes[i]); a != "" {
				t.cps = append(t.cps, a)
			}
		}
	}
	sort.Strings(t.cps)
	return t.cps
}

// preflight runs the version checks and the kind's own. It returns false
// when the operation was refused. when says at which point it ran.
func (t *turn) preflight(ctx context.Context, when string) (bool, error) {
	op := t.op
	facts, err := t.facts(ctx)
	if err != nil {
		return false, err
	}
	failures := preflight.Check(op.Spec, facts, t.r.Compat)
	var actions []string
	for _, m := range op.Status.Machines {
		if m.Phase != ichorv1.MachineSkipped {
			actions = append(actions, t.exec.Check(ctx, t.env(m))...)
		}
	}
	if len(actions) > 0 {
		failures = append(failures, preflight.Failure{Check: CheckActionAllowed, Message: strings.Join(actions, "; ")})
	}
	if len(failures) == 0 {
		setChecks(op, nil, false)
		return true, nil
	}
	if op.Spec.Override && overridable(failures) {
		if !overrideRecorded(op, failures) {
			t.event(corev1.EventTypeWarning, preflight.EventOverridden, "%s", preflight.OverriddenMessage(failures))
		}
		setChecks(op, failures, true)
		return true, nil
	}
	if when != "" {
		for i := range failures {
			failures[i].Message += " (" + when + ")"
		}
	}
	t.refuse(failures)
	return false, nil
}

// collect applies the results of steps that finished since the last turn.
func (t *turn) collect() {
	st := &t.op.Status
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress {
			continue
		}
		res, ok := t.r.runner.take(t.key(m.Name), m.Step, m.Attempts)
		if !ok {
			continue
		}
		if res.err != nil {
			t.fail(m, res.step, res.err)
			continue
		}
		observeStep(t.op.Spec.Kind, res.step, res.took)
		t.finishStep(m, res.outcome)
	}
}

// finishStep records a step's outcome and moves the machine to its next
// step, or to Succeeded after its last one.
func (t *turn) finishStep(m *ichorv1.MachineStatus, out executor.Outcome) {
	if out.From != "" {
		m.From = out.From
	}
	if out.BootID != "" {
		m.BootID = out.BootID
	}
	m.Message = out.Message
	next := ""
	if !out.Done {
		next = out.Next
		if next == "" {
			next = nextStep(t.exec.Steps(t.op, m), m.Step)
		}
	}
	if next == "" {
		now := metav1.NewTime(t.r.now())
		// No message unless the step left one: from and to say it, and
		// 5,000 machines must fit in one object.
		m.Phase, m.Step, m.FinishedAt, m.BootID = ichorv1.MachineSucceeded, "", &now, ""
		t.event(corev1.EventTypeNormal, "MachineSucceeded", "%s: done (%s -> %s)", m.Name, orDash(m.From), orDash(m.To))
		return
	}
	m.Step = next
	t.event(corev1.EventTypeNormal, "Step", "%s: %s", m.Name, next)
}

func nextStep(steps []executor.Step, current string) string {
	for i, s := range steps {
		if s.Name == current && i+1 < len(steps) {
			return steps[i+1].Name
		}
	}
	return ""
}

func findStep(steps []executor.Step, name string) (executor.Step, bool) {
	for _, s := range steps {
		if s.Name == name {
			return s, true
		}
	}
	return executor.Step{}, false
}

// fail records a failed step: the machine Failed, the operation paused with
// failureReason, never retried by itself, nothing rolled back.
func (t *turn) fail(m *ichorv1.MachineStatus, step string, err error) {
	reason := executor.Reason(step, err)
	stepFailures.WithLabelValues(string(t.op.Spec.Kind), step, reason).Inc()
	var se *executor.StepError
	if errors.As(err, &se) && se.RetryFrom != "" {
		m.Step = se.RetryFrom
	}
	now := metav1.NewTime(t.r.now())
	m.Phase, m.FinishedAt, m.Message = ichorv1.MachineFailed, &now, err.Error()
	st := &t.op.Status
	if st.FailureReason == "" {
		st.FailureReason = reason
		st.Message = fmt.Sprintf("%s failed on %s: %v", step, m.Name, err)
	}
	t.event(corev1.EventTypeWarning, "StepFailed", "%s: %s failed: %v", m.Name, step, err)
}

const retryWaits = "; a retry is requested and runs when the operation is resumed"

// handleFailure keeps an operation with a failed step paused until a retry
// is requested, and acts on the request once. It returns whether the turn
// goes on.
func (t *turn) handleFailure() bool {
	op := t.op
	st := &op.Status
	requested := op.Annotations[ichorv1.RetryAnnotation] == ichorv1.RetryRequested
	if st.FailureReason == "" {
		if requested && !op.Spec.Paused {
			// Nothing failed: a retry now would pre-approve a future failure.
			t.dropRetry = true
			t.event(corev1.EventTypeNormal, "RetryIgnored", "%s=true removed: no step has failed, so there is nothing to run again", ichorv1.RetryAnnotation)
		}
		return true
	}
	if !requested || op.Spec.Paused {
		msg := strings.TrimSuffix(st.Message, retryWaits)
		if requested {
			msg += retryWaits
		}
		t.pause(ichorv1.ReasonStepFailed, msg)
		return false
	}
	now := metav1.NewTime(t.r.now())
	st.LastRetry = &now
	st.RetryCount++
	var again []string
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineFailed {
			continue
		}
		m.Phase, m.FinishedAt, m.Message = ichorv1.MachineInProgress, nil, "retrying"
		m.Attempts++
		again = append(again, m.Name+": "+m.Step)
	}
	st.FailureReason = ""
	t.dropRetry = true
	t.event(corev1.EventTypeNormal, "Retrying", "retry %d requested: running %s again", st.RetryCount, strings.Join(again, ", "))
	return true
}

// handlePause stops an operator-paused operation between steps. It keeps the
// cluster lock if it holds it. It returns whether the turn goes on.
func (t *turn) handlePause() bool {
	if !t.op.Spec.Paused {
		return true
	}
	msg := "paused by an operator (spec.paused); `kubectl ichor operation resume` lifts it"
	if running := t.r.runner.running(t.op.UID); len(running) > 0 {
		msg += "; finishing the steps in flight: " + strings.Join(running, ", ")
	}
	t.pause(ichorv1.ReasonPausedByOperator, msg)
	return false
}

func (t *turn) pause(reason, msg string) {
	st := &t.op.Status
	if st.Phase != ichorv1.PhasePaused || st.Reason != reason {
		t.event(corev1.EventTypeNormal, "Paused", "%s: %s", reason, msg)
	}
	if reason != ichorv1.ReasonClusterLockHeld {
		st.LockHolder = ""
		if st.Lock == ichorv1.LockWaiting {
			st.Lock = ""
		}
	}
	setPhase(t.op, ichorv1.PhasePaused, reason, msg)
}

// acquire takes (or confirms) the cluster lock. Operations take a free lock
// in creation order: a newer one leaves it to an older one that wants it.
func (t *turn) acquire(ctx context.Context) (bool, error) {
	id := t.identity()
	st, err := t.r.Lock.Get(ctx)
	if err != nil {
		return false, err
	}
	if st.Holder != id {
		// Whether the lock is free, held, or held by someone stale: an
		// older operation that wants it too goes first.
		older, err := t.olderInQueue(ctx)
		if err != nil {
			return false, err
		}
		if older != "" {
			holder := st.Holder
			if holder == "" {
				holder = older
			}
			t.wait(holder, "waiting for the cluster lock: the older operation "+older+" goes first")
			return false, nil
		}
	}
	res, err := t.r.Lock.Acquire(ctx, id)
	if err != nil {
		return false, err
	}
	if !res.Acquired {
		t.wait(res.Holder, fmt.Sprintf("waiting for the cluster lock, held by %s since %s", res.Holder, res.Since.UTC().Format(time.RFC3339)))
		return false, nil
	}
	status := &t.op.Status
	if status.Lock != ichorv1.LockHeld {
		lockHeld.Set(1)
		if res.TookOver != "" {
			t.event(corev1.EventTypeNormal, "LockTakenOver", "took the cluster lock over from %s", res.TookOver)
		} else {
			t.event(corev1.EventTypeNormal, "LockAcquired", "holds the cluster lock as %s", id)
		}
	}
	status.Lock, status.LockHolder = ichorv1.LockHeld, ""
	return true, nil
}

func (t *turn) wait(holder, msg string) {
	st := &t.op.Status
	if st.Lock != ichorv1.LockWaiting || st.LockHolder != holder {
		t.event(corev1.EventTypeNormal, "WaitingForLock", "%s", msg)
	}
	st.Lock, st.LockHolder = ichorv1.LockWaiting, holder
	setPhase(t.op, ichorv1.PhasePaused, ichorv1.ReasonClusterLockHeld, msg)
}

// identity is the lock identity: the operation's own, or the machine's for
// a control-plane removal.
func (t *turn) identity() string {
	if li, ok := t.exec.(executor.LockIdentifier); ok && len(t.op.Status.Machines) == 1 {
		if id := li.LockIdentity(t.op, t.op.Status.Machines[0].Role); id != "" {
			return id
		}
	}
	return ichorv1.OperationIdentity(t.op.Namespace, t.op.Name)
}

// olderInQueue names the oldest operation created before this one that
// wants the lock too: not finished, failed, deleted or paused by an operator.
func (t *turn) olderInQueue(ctx context.Context) (string, error) {
	var ops ichorv1.TalosOperationList
	if err := t.r.Client.List(ctx, &ops, client.UnsafeDisableDeepCopy); err != nil {
		return "", fmt.Errorf("list operations: %w", err)
	}
	me := t.persisted
	older := func(o *ichorv1.TalosOperation) bool {
		if o.CreationTimestamp.Equal(&me.CreationTimestamp) {
			return o.Namespace+"/"+o.Name < me.Namespace+"/"+me.Name
		}
		return o.CreationTimestamp.Before(&me.CreationTimestamp)
	}
	var first *ichorv1.TalosOperation
	for i := range ops.Items {
		o := &ops.Items[i]
		if o.UID == me.UID || !older(o) || !o.DeletionTimestamp.IsZero() || o.Spec.Paused ||
			o.Succeeded() || o.Refused() || o.StepFailed() || t.r.Executors[o.Spec.Kind] == nil {
			continue
		}
		if first == nil || o.CreationTimestamp.Before(&first.CreationTimestamp) {
			first = o
		}
	}
	if first == nil {
		return "", nil
	}
	return ichorv1.OperationIdentity(first.Namespace, first.Name), nil
}

// advance evaluates Wait steps, starts machines the plan allows, and
// finishes the operation when every machine is done.
func (t *turn) advance(ctx context.Context) (ctrl.Result, error) {
	op := t.op
	st := &op.Status
	var requeue time.Duration
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress {
			continue
		}
		step, ok := findStep(t.exec.Steps(op, m), m.Step)
		if !ok || step.Wait == nil || !t.persistedAt(m) {
			continue
		}
		if after := t.check(ctx, m, step); after > 0 && (requeue == 0 || after < requeue) {
			requeue = after
		}
	}
	if st.FailureReason != "" {
		t.pause(ichorv1.ReasonStepFailed, st.Message)
		return ctrl.Result{}, nil
	}
	unavailable := map[string]bool{}
	for i := range t.nodes {
		n := &t.nodes[i]
		if machine.Role(n) == ichorv1.RoleWorker && machine.Unavailable(n) {
			unavailable[n.Name] = true
		}
	}
	start, why := plan.Next(st.Machines, unavailable, int(op.Spec.MaxUnavailable))
	for _, i := range start {
		m := &st.Machines[i]
		now := metav1.NewTime(t.r.now())
		steps := t.exec.Steps(op, m)
		m.Phase, m.StartedAt, m.Step, m.Attempts, m.Message = ichorv1.MachineInProgress, &now, steps[0].Name, 1, ""
		t.event(corev1.EventTypeNormal, "MachineStarted", "%s: %s", m.Name, m.Step)
	}
	if allDone(st.Machines) {
		t.succeed(ctx)
		return ctrl.Result{}, nil
	}
	msg := "running"
	if why != "" {
		msg = why
	}
	setPhase(op, ichorv1.PhaseRunning, "", msg)
	t.canLaunch = true
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// persistedAt reports whether the persisted status has the machine at the
// same step and attempt as the working copy: only then may the step act.
func (t *turn) persistedAt(m *ichorv1.MachineStatus) bool {
	p := entry(&t.persisted.Status, m.Name)
	return p != nil && p.Phase == ichorv1.MachineInProgress && p.Step == m.Step && p.Attempts == m.Attempts
}

// check evaluates a Wait step and returns when to look again for its timeout.
func (t *turn) check(ctx context.Context, m *ichorv1.MachineStatus, step executor.Step) time.Duration {
	timeout := step.Timeout
	if timeout == 0 {
		timeout = t.r.StepTimeout
	}
	deadline := t.r.runner.waitDeadline(stepKey{t.key(m.Name), m.Step, m.Attempts}, timeout)
	done, out, err := step.Wait(ctx, t.env(*m))
	if err != nil {
		t.fail(m, step.Name, err)
		return 0
	}
	if done {
		t.finishStep(m, out)
		return 0
	}
	left := deadline.Sub(t.r.now())
	if left <= 0 {
		err := executor.Fail(executor.FailureReason(step.Name), "%s did not finish within %s: %s", step.Name, timeout, orDash(out.Message))
		t.fail(m, step.Name, err)
		return 0
	}
	m.Message = out.Message
	if out.Recheck > 0 && out.Recheck < left {
		return out.Recheck
	}
	return left
}

func (t *turn) succeed(ctx context.Context) {
	st := &t.op.Status
	now := metav1.NewTime(t.r.now())
	st.CompletionTime = &now
	st.Lock, st.LockHolder = "", ""
	setPhase(t.op, ichorv1.PhaseSucceeded, "Succeeded", fmt.Sprintf("%s done on %s machine(s)", st.Target, plan.Progress(st.Machines)))
	t.event(corev1.EventTypeNormal, "Succeeded", "%s", st.Message)
}

// launch starts the Run steps that persisted status (as read, or as this
// turn wrote it) records as in progress and that are not running or done
// already.
func (t *turn) launch(ctx context.Context) {
	if !t.canLaunch {
		return
	}
	op := t.persisted
	for _, m := range op.Status.Machines {
		if m.Phase != ichorv1.MachineInProgress {
			continue
		}
		wm := entry(&t.op.Status, m.Name)
		if wm == nil || wm.Phase != ichorv1.MachineInProgress || wm.Step != m.Step || wm.Attempts != m.Attempts {
			continue // this turn moved it on; the next turn starts what it wrote
		}
		step, ok := findStep(t.exec.Steps(op, &m), m.Step)
		if !ok || step.Run == nil {
			continue
		}
		k := t.key(m.Name)
		if t.r.runner.busy(k, m.Step, m.Attempts) {
			continue
		}
		timeout := step.Timeout
		if timeout == 0 {
			timeout = t.r.StepTimeout
		}
		env := t.env(m)
		env.Log = t.log.WithValues("machine", m.Name, "step", m.Step, "attempt", m.Attempts)
		t.r.runner.launch(op, k, step, m.Attempts, timeout, env)
	}
}

func (t *turn) key(name string) machineKey { return machineKey{op: t.persisted.UID, machine: name} }

func (t *turn) env(m ichorv1.MachineStatus) *executor.Env {
	n := t.node(m.Name)
	addr := ""
	if n != nil {
		addr = machine.Address(n)
	}
	return &executor.Env{
		Op: t.persisted, Machine: m, Node: n, Address: addr, ControlPlanes: t.controlPlanes(),
		Talos: t.talos, Kube: t.r.Client, Clientset: t.r.Clientset,
		Identity: ichorv1.OperationIdentity(t.op.Namespace, t.op.Name), Log: t.log,
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
