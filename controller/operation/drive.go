package operation

import (
	"context"
	"errors"
	"fmt"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"

	corev1 "k8s.io/api/core/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

// collect applies the results of steps that finished since the last turn,
// and the progress of those still running.
func (t *turn) collect() {
	st := &t.op.Status
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress {
			continue
		}
		k := t.key(m.Name)
		res, ok := t.r.runner.take(k, m.Step, m.Attempts)
		if !ok {
			if step, recorded, ok := t.r.runner.runningStep(k, m.Step, m.Attempts); ok {
				t.moveTo(m, step, recorded) // a Chained step runs now
			}
			if msg, ok := t.r.runner.progress(k, m.Step, m.Attempts); ok {
				m.Message = msg // what the running step says it is doing
			}
			continue
		}
		done := res.ran
		if res.err != nil {
			done = done[:len(done)-1] // the duration metric is of steps that succeeded
		}
		for _, s := range done {
			observeStep(t.op.Spec.Kind, s.name, s.took)
		}
		if res.err != nil {
			t.moveTo(m, res.last(), res.outcome)
			t.fail(m, m.Step, res.err)
			continue
		}
		t.moveTo(m, res.last(), executor.Outcome{})
		t.finishStep(m, res.outcome)
	}
}

// moveTo records that the machine's run has reached step, a Chained step
// after the one status records, with what the steps before it recorded
// (the steps after inspect depend on its boot ID, say).
func (t *turn) moveTo(m *ichorv1.MachineStatus, step string, recorded executor.Outcome) {
	if step == m.Step {
		return
	}
	record(m, recorded)
	m.Step, m.Message = step, ""
	t.event(corev1.EventTypeNormal, "Step", "%s: %s", m.Name, step)
}

// record keeps what a step's outcome says of the machine.
func record(m *ichorv1.MachineStatus, out executor.Outcome) {
	if out.From != "" {
		m.From = out.From
	}
	if out.To != "" {
		m.To = out.To
	}
	if out.BootID != "" {
		m.BootID = out.BootID
	}
}

// finishStep records a step's outcome and moves the machine to its next
// step, or to Succeeded after its last one.
func (t *turn) finishStep(m *ichorv1.MachineStatus, out executor.Outcome) {
	record(m, out)
	m.Message, m.Calls = out.Message, 0
	next := ""
	if !out.Done {
		next = stepAfter(t.exec.Steps(t.op, m), m.Step, out)
	}
	if next == "" {
		// No message unless the step left one: from and to say it, and
		// 5,000 machines must fit in one object.
		m.Phase, m.Step, m.FinishedAt, m.BootID = ichorv1.MachineSucceeded, "", &t.now, ""
		t.event(corev1.EventTypeNormal, "MachineSucceeded", "%s: done (%s -> %s)", m.Name, orDash(m.From), orDash(m.To))
		return
	}
	m.Step = next
	t.event(corev1.EventTypeNormal, "Step", "%s: %s", m.Name, next)
}

// stepAfter names the step a machine goes to once current ended with out
// (not done): the one out jumps to, or the next in order ("" after the last).
func stepAfter(steps []executor.Step, current string, out executor.Outcome) string {
	if out.Next != "" {
		return out.Next
	}
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
	m.Phase, m.FinishedAt, m.Message, m.Calls = ichorv1.MachineFailed, &t.now, err.Error(), 0
	if st := &t.op.Status; st.FailureReason == "" {
		st.FailureReason = reason
	}
	t.event(corev1.EventTypeWarning, "StepFailed", "%s: %s failed: %v", m.Name, step, err)
}

// checkWaits evaluates the Wait steps that persisted status records, and
// returns when to look again for the soonest timeout or recheck.
func (t *turn) checkWaits(ctx context.Context) time.Duration {
	st := &t.op.Status
	var requeue time.Duration
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress || m.Stopped {
			continue
		}
		step, ok := findStep(t.exec.Steps(t.op, m), m.Step)
		if !ok || step.Wait == nil || !t.persistedAt(m) {
			continue
		}
		if after := t.check(ctx, m, step); after > 0 && (requeue == 0 || after < requeue) {
			requeue = after
		}
	}
	return requeue
}

// stopBetweenSteps stops the machines whose step ended this turn before
// their next step, when that is a Run step: a stopping operation launches
// nothing new. A Wait step is no launch: a reboot under way is watched
// until it has finished.
func (t *turn) stopBetweenSteps() {
	t.r.runner.halt(t.op.UID)
	st := &t.op.Status
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress || m.Stopped || t.persistedAt(m) {
			continue
		}
		if step, ok := findStep(t.exec.Steps(t.op, m), m.Step); !ok || step.Run != nil {
			m.Stopped = true
		}
	}
}

// startMachine records that work on the machine begins, at its first step.
func (t *turn) startMachine(m *ichorv1.MachineStatus) {
	steps := t.exec.Steps(t.op, m)
	m.Phase, m.StartedAt, m.Step, m.Attempts, m.Message = ichorv1.MachineInProgress, &t.now, steps[0].Name, 1, ""
	t.event(corev1.EventTypeNormal, "MachineStarted", "%s: %s", m.Name, m.Step)
}

// persistedAt reports whether the persisted status has the machine at the
// same step and attempt as the working copy: only then may the step act.
func (t *turn) persistedAt(m *ichorv1.MachineStatus) bool {
	p := entry(&t.persisted.Status, m.Name)
	return p != nil && p.Phase == ichorv1.MachineInProgress && p.Step == m.Step && p.Attempts == m.Attempts
}

// check evaluates a Wait step and returns when to look again for its timeout.
func (t *turn) check(ctx context.Context, m *ichorv1.MachineStatus, step executor.Step) time.Duration {
	timeout := t.r.timeout(step)
	deadline := t.r.runner.waitDeadline(stepKey{t.key(m.Name), m.Step, m.Attempts}, t.now.Time, timeout)
	done, out, err := step.Wait(ctx, t.stepEnv(*m))
	if err != nil {
		t.fail(m, step.Name, err)
		return 0
	}
	if done {
		t.finishStep(m, out)
		return 0
	}
	left := deadline.Sub(t.now.Time)
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

// countCalls counts, before status is written, each run of an Irreversible
// step that this turn may launch (MachineStatus.Calls): a run this
// controller has not counted yet is one more. A new leader that runs the
// step again so writes 2 or more, and the step knows that an earlier run
// may have made its call.
func (t *turn) countCalls() {
	if !t.canLaunch {
		return
	}
	st := &t.op.Status
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineInProgress || m.Stopped {
			continue
		}
		step, ok := findStep(t.exec.Steps(t.op, m), m.Step)
		k := stepKey{t.key(m.Name), m.Step, m.Attempts}
		if !ok || !step.Irreversible || t.r.runner.busy(k.machineKey, m.Step, m.Attempts) || t.r.runner.counted(k) == m.Calls && m.Calls > 0 {
			continue
		}
		m.Calls++
		t.r.runner.count(k, m.Calls)
		if step.Ends != "" {
			t.end(m, step)
		}
	}
}

// launch starts the Run steps that persisted status (as read, or as this
// turn wrote it) records as in progress and that are not running or done
// already, once check (or, without one, its own Confirm) says that the
// cluster lock is still this operation's. A step it cannot start is
// reported (a log line and a Warning Event), never silently dropped, and
// again says to look again soon.
func (t *turn) launch(ctx context.Context, check *lockCheck) (again bool, err error) {
	if !t.canLaunch {
		return false, nil
	}
	confirmed := false
	op := t.persisted
	for _, m := range op.Status.Machines {
		if m.Phase != ichorv1.MachineInProgress || m.Stopped {
			continue
		}
		wm := entry(&t.op.Status, m.Name)
		if wm == nil || wm.Phase != ichorv1.MachineInProgress || wm.Step != m.Step || wm.Attempts != m.Attempts {
			continue // this turn moved it on; the next turn starts what it wrote
		}
		step, ok := findStep(t.exec.Steps(op, &m), m.Step)
		if !ok {
			t.notStarted(m, fmt.Errorf("it is not a step of the %s kind in this controller's version", op.Spec.Kind))
			continue
		}
		if !t.startable(m, step) {
			continue
		}
		if !confirmed {
			// The cache this turn read may be behind a takeover.
			if check == nil {
				check = t.checkLock(ctx)
			}
			if err := check.wait(); err != nil {
				return again, fmt.Errorf("not starting %s on %s: %w", m.Step, m.Name, err)
			}
			confirmed = true
		}
		if err := t.run(m, step); err != nil {
			t.notStarted(m, err)
			again = true
		}
	}
	return again, nil
}

// run runs the machine's step, and the Chained steps after it, in the
// runner, on the operation as persisted status has it.
func (t *turn) run(m ichorv1.MachineStatus, step executor.Step) error {
	env := t.stepEnv(m)
	env.Log = t.log.WithValues("machine", m.Name, "step", m.Step, "attempt", m.Attempts)
	return t.r.runner.launch(env.Op, t.key(m.Name), step, m.Attempts, t.r.timeout(step), env, t.talos.Another(), t.follower(env))
}

// launchChained starts, beside the status write that records them, the
// Chained steps this turn moved machines to: on from the step persisted
// status records (the verify after a reboot's Wait, say), or a machine's
// first step as the turn starts it (the Talos upgrade's inspect, a read).
// As in a run, a Chained step needs no status write before it begins, and
// waiting for that write would put its round trip on the machine's path.
// A step that Cordons is left to launch, after the write and a Confirm.
// When the write fails, the next turn moves the machine to the step again
// and finds it running, or its result.
func (t *turn) launchChained() {
	if !t.canLaunch {
		return
	}
	for _, m := range t.op.Status.Machines {
		if m.Phase != ichorv1.MachineInProgress || m.Stopped {
			continue
		}
		steps := t.exec.Steps(t.op, &m)
		if !t.movedOn(m) && !t.startedAt(m, steps) {
			continue
		}
		step, ok := findStep(steps, m.Step)
		if !ok || !chainable(step) || step.Cordons || t.r.runner.busy(t.key(m.Name), m.Step, m.Attempts) {
			continue
		}
		if err := t.run(m, step); err != nil {
			t.log.V(1).Info("Chained step not started beside the write; launch starts it after", "machine", m.Name, "step", m.Step, "why", err.Error())
		}
	}
}

// movedOn says whether persisted status has the machine in progress at an
// earlier step of this attempt: this turn moved it on.
func (t *turn) movedOn(m ichorv1.MachineStatus) bool {
	p := entry(&t.persisted.Status, m.Name)
	return p != nil && p.Phase == ichorv1.MachineInProgress && p.Attempts == m.Attempts && p.Step != m.Step
}

// startedAt says whether this turn starts the machine at its first step:
// persisted status has it not started, in the same stage (a stage's start
// waits for the write that records the stage).
func (t *turn) startedAt(m ichorv1.MachineStatus, steps []executor.Step) bool {
	if len(steps) == 0 || m.Step != steps[0].Name || m.Attempts != 1 || t.persisted.Status.Stage != t.op.Status.Stage {
		return false
	}
	p := entry(&t.persisted.Status, m.Name)
	return p == nil || p.Phase == ichorv1.MachinePending
}

// follower gives the Chained step that follows a step of a run on env's
// machine, with what the run's steps recorded so far (its boot ID, say,
// which decides the steps after inspect), and, before a step that Cordons
// (unless the step before it did), once a Confirm says that the cluster
// lock is still the operation's: a cordon after a takeover would overlap
// another holder's disruption. It runs in the run's goroutine and changes
// only env, which is the run's own.
func (t *turn) follower(env *executor.Env) follower {
	exec, log, r := t.exec, t.log, t.r
	return func(ctx context.Context, current string, out executor.Outcome) (executor.Step, time.Duration, bool) {
		if out.Done {
			return executor.Step{}, 0, false
		}
		m := &env.Machine
		record(m, out)
		steps := exec.Steps(env.Op, m)
		next, ok := findStep(steps, stepAfter(steps, current, out))
		if !ok || !chainable(next) {
			return executor.Step{}, 0, false
		}
		if next.Cordons && !cordoned(steps, current) {
			if err := env.Lock.Confirm(ctx, env.Holder); err != nil {
				env.Log.Info("not going on to the next step in this run", "next", next.Name, "why", err.Error())
				return executor.Step{}, 0, false
			}
		}
		m.Step, m.Message = next.Name, out.Message
		env.Log = log.WithValues("machine", m.Name, "step", next.Name, "attempt", m.Attempts)
		return next, r.timeout(next), true
	}
}

// cordoned says whether the step named current Cordons: the Confirm made
// before it covers the one that follows it in the same run (the drain after
// its cordon), as the one before config's cordon and drain, a single step,
// covers both. A takeover in between would need the operation stale, and
// an operation with a run in flight is not (lock.ClusterJudge).
func cordoned(steps []executor.Step, current string) bool {
	s, ok := findStep(steps, current)
	return ok && s.Cordons
}

// chainable says whether step may start without a status write of its
// own: a Chained Run step that makes no irreversible call.
func chainable(step executor.Step) bool {
	return step.Chained && step.Run != nil && !step.Irreversible
}

// timeout bounds step: its own timeout, or the reconciler's default.
func (r *Reconciler) timeout(step executor.Step) time.Duration {
	if step.Timeout == 0 {
		return r.StepTimeout
	}
	return step.Timeout
}

// startable says whether launch starts the machine's step (in progress,
// not stopped): a Run step that is not running, and, when irreversible,
// whose run persisted status counts (countCalls).
func (t *turn) startable(m ichorv1.MachineStatus, step executor.Step) bool {
	k := t.key(m.Name)
	if step.Run == nil || t.r.runner.busy(k, m.Step, m.Attempts) {
		return false
	}
	return !step.Irreversible || m.Calls > 0 && t.r.runner.counted(stepKey{k, m.Step, m.Attempts}) == m.Calls
}

// lockCheck is a Confirm of the cluster lock under way.
type lockCheck struct {
	done chan struct{}
	err  error
}

// checkLock starts a Confirm of the cluster lock: a guarded write of the
// Lease as acquire saw it.
func (t *turn) checkLock(ctx context.Context) *lockCheck {
	c := &lockCheck{done: make(chan struct{})}
	h, seen := t.holder(), t.lockSeen
	go func() {
		defer close(c.done)
		c.err = t.r.Lock.ConfirmSeen(ctx, h, seen)
	}()
	return c
}

// wait returns the Confirm's answer once it has come.
func (c *lockCheck) wait() error {
	if c == nil {
		return nil
	}
	<-c.done
	return c.err
}

// checkLockBeside starts the Confirm that launch needs when the status
// about to be written starts a step, so that it runs beside the status
// write rather than after it: the two are independent, and a step starts
// only once both have answered. Nil when no step will start.
func (t *turn) checkLockBeside(ctx context.Context) *lockCheck {
	if !t.canLaunch {
		return nil
	}
	for _, m := range t.op.Status.Machines {
		if m.Phase != ichorv1.MachineInProgress || m.Stopped {
			continue
		}
		if step, ok := findStep(t.exec.Steps(t.op, &m), m.Step); ok && t.startable(m, step) {
			return t.checkLock(ctx)
		}
	}
	return nil
}

// notStarted reports a step that persisted status records as in progress
// and that launch could not start.
func (t *turn) notStarted(m ichorv1.MachineStatus, why error) {
	t.log.Info("step not started", "machine", m.Name, "step", m.Step, "attempt", m.Attempts, "why", why.Error())
	t.r.Recorder.Eventf(t.persisted, nil, corev1.EventTypeWarning, "StepNotStarted", "StepNotStarted", "%s: %s not started: %v", m.Name, m.Step, why)
}

// soon is when a turn whose steps could not all start looks again.
const soon = time.Second

// lookAgainSoon makes result look again within soon.
func lookAgainSoon(result ctrl.Result) ctrl.Result {
	if result.RequeueAfter == 0 || result.RequeueAfter > soon {
		result.RequeueAfter = soon
	}
	return result
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
