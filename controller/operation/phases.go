package operation

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	ctrl "sigs.k8s.io/controller-runtime/pkg/reconcile"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/controller/preflight"
)

// decide runs the phase the operation is in. Each phase changes only the
// operation's facts (machines, failure, lock, checks, startTime) and returns
// when to look again; deriveStatus then says what the facts mean.
func (t *turn) decide(ctx context.Context) (ctrl.Result, error) {
	if decided, err := t.prepare(ctx); decided || err != nil {
		return ctrl.Result{}, err
	}
	t.collect()
	if err := t.actOnSkip(ctx); err != nil {
		return ctrl.Result{}, err
	}
	if !t.started() {
		// Refused, or planned differently and held for a person, without the lock.
		if passed, err := t.checksPass(ctx, ""); !passed || err != nil {
			return ctrl.Result{}, err
		}
	}
	if result, stopped := t.reconcileStopped(ctx); stopped {
		return result, nil
	}
	held, err := t.acquire(ctx)
	if err != nil || !held {
		return ctrl.Result{}, err
	}
	if !t.started() {
		if ok, err := t.checkOnceHeld(ctx); !ok || err != nil {
			return ctrl.Result{}, err
		}
		t.start()
	}
	return t.reconcileRunning(ctx)
}

// checksPass runs the checks (preflight, when says at which point) and
// reports whether they passed with the plan unchanged; then it notes when
// they began their reads (checkedAt).
func (t *turn) checksPass(ctx context.Context, when string) (bool, error) {
	at := time.Now()
	if ok, err := t.preflight(ctx, when); !ok || err != nil {
		return false, err
	}
	if t.op.PlanChanged() {
		return false, nil
	}
	t.checkedAt = at
	return true, nil
}

// checkOnceHeld runs the checks again now that the lock is held: a holder
// may have changed the cluster since they ran before the lock (a
// Kubernetes upgrade that ended meanwhile). The checks before the lock
// count as these when they read the cluster after the moment the lock
// was last known free (lock.Result.FreeAt): the take, a write guarded by
// that free Lease, proves that no holder came between. That is the turn
// that a release by this controller wakes (its Lock takes the lock on the
// Lease the release wrote), which so starts one round trip sooner; and
// the turn whose checks ran after the holder it waited for went idle, or
// ran again while it waited for that holder's release (checkWhileEnding):
// a take on that release is free from the moment the holder went idle.
// The Nodes, which the turn lists from the cache as it begins, are the
// same for both runs of the checks.
func (t *turn) checkOnceHeld(ctx context.Context) (bool, error) {
	if !t.checkedAt.IsZero() && !t.freeAt.IsZero() && t.checkedAt.After(t.freeAt) {
		return true, nil
	}
	if ok, err := t.preflight(ctx, "once the cluster lock was held"); !ok || err != nil {
		return false, err
	}
	if t.op.PlanChanged() {
		// Planned differently since the check before the lock: held for
		// a person, and the lock goes to the next in line meanwhile.
		t.op.Status.Lock = ""
		return false, t.r.release(ctx, t.persisted)
	}
	return true, nil
}

// start records that the operation starts running: its machines are fixed.
// It starts when the turn has the cluster lock, not when the turn began:
// acquire may have waited meanwhile (a takeover reads its holder from the
// API server first), so the turn's clock is read again, and what the turn
// records from here on is this later instant. A start taken over from a
// holder that completed then never predates that holder's completion.
func (t *turn) start() {
	t.now = metav1.NewTime(t.r.now())
	t.op.Status.StartTime = &t.now
	t.event(corev1.EventTypeNormal, "Started", "started %s on %d machine(s)", t.op.Status.Target, len(t.op.Status.Machines))
	// The plan skipped held machines before the start; each leaves an
	// Event, as one held later does (skipHeld).
	for _, m := range t.op.Status.Machines {
		if m.Phase == ichorv1.MachineSkipped {
			t.event(corev1.EventTypeNormal, "MachineSkipped", "%s: %s", m.Name, m.Message)
		}
	}
	if len(t.op.Status.Stages) > 0 {
		t.beginStage(0)
	}
}

// advanceStage begins the next stage once the persisted status records
// the stage in progress as finished (deriveStatus sets its finishedAt when
// its last machine is done): the runner then holds nothing of its steps
// (settle dropped their results, waits and call counts), so the next stage
// may use the same step names.
func (t *turn) advanceStage() {
	p, i := plan.Stage(&t.persisted.Status)
	if p == nil || p.FinishedAt == nil || i+1 >= len(t.op.Status.Stages) {
		return
	}
	t.event(corev1.EventTypeNormal, "StageSucceeded", "stage %s done on %s machine(s)", p.Name, p.Progress)
	t.beginStage(i + 1)
}

// beginStage makes stage i the one in progress: its machines begin again
// at Pending, held ones are skipped (a skipped machine stays skipped), and
// a Once stage's first machine that is not skipped is the one that runs it.
func (t *turn) beginStage(i int) {
	st := &t.op.Status
	s := &st.Stages[i]
	st.Stage, s.StartedAt, s.FinishedAt, s.Progress = s.Name, &t.now, nil, ""
	all := *s
	all.Order = ichorv1.StageRolling // every machine of its roles, for the holds
	_, idx := plan.InStage(st.Machines, &all)
	lead := false
	for _, j := range idx {
		m := &st.Machines[j]
		if m.Phase == ichorv1.MachineSkipped || (s.Order == ichorv1.StageOnce && lead) {
			continue
		}
		if held, why := t.held(m.Name); held {
			m.Phase, m.Message, m.FinishedAt = ichorv1.MachineSkipped, why, &t.now
			t.event(corev1.EventTypeNormal, "MachineSkipped", "%s: %s", m.Name, why)
			continue
		}
		*m = ichorv1.MachineStatus{Name: m.Name, Role: m.Role, Phase: ichorv1.MachinePending, From: m.From, To: m.To}
		lead = true
	}
	t.event(corev1.EventTypeNormal, "StageStarted", "stage %s (%d of %d)", s.Name, i+1, len(st.Stages))
}

// refuse records failed checks: deriveStatus makes the operation Refused,
// terminal, nothing ran and no lock kept.
func (t *turn) refuse(failures []preflight.Failure) { setChecks(t.op, failures, false) }

// preflight runs the version checks and the kind's own. It returns false
// when the operation was refused. when says at which point it ran.
func (t *turn) preflight(ctx context.Context, when string) (bool, error) {
	op := t.op
	facts, err := t.facts(ctx)
	if err != nil {
		return false, err
	}
	failures := preflight.Check(op.Spec, facts, t.r.Compat)
	if actions := t.kindChecks(ctx); len(actions) > 0 {
		failures = append(failures, preflight.Failure{Check: CheckActionAllowed, Message: strings.Join(actions, "; ")})
	}
	if len(failures) == 0 {
		setChecks(op, nil, false)
		return true, nil
	}
	if op.Spec.Override && preflight.Overridable(failures) {
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

// kindChecks runs the kind's own checks on every machine in scope, a few
// machines at a time, and returns the refusals, each once. A Planner's plan
// becomes each Pending machine's message.
func (t *turn) kindChecks(ctx context.Context) []string {
	ms := t.op.Status.Machines
	planner, _ := t.exec.(executor.Planner)
	plans, refusals := make([]string, len(ms)), make([][]string, len(ms))
	var wg sync.WaitGroup
	slots := make(chan struct{}, kindCheckers)
	for i := range ms {
		if ms[i].Phase == ichorv1.MachineSkipped {
			continue
		}
		// The checks see the machines this turn put in scope, which the
		// persisted status of a new operation does not hold yet.
		env := t.env(ms[i])
		env.Op = t.op
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if planner != nil {
				plans[i], refusals[i] = planner.Plan(ctx, env)
			} else {
				refusals[i] = t.exec.Check(ctx, env)
			}
		})
	}
	wg.Wait()
	// Each refusal once; a Planner's name no machine, so they say which.
	var out []string
	machines := map[string][]string{}
	for i := range ms {
		if planner != nil && ms[i].Phase == ichorv1.MachinePending {
			ms[i].Message = plans[i]
		}
		for _, r := range refusals[i] {
			if _, seen := machines[r]; !seen {
				out = append(out, r)
			}
			machines[r] = append(machines[r], ms[i].Name)
		}
	}
	if planner != nil {
		for i, r := range out {
			out[i] = machineList(machines[r]) + ": " + r
		}
	}
	return out
}

// machineList names machines, the first few of a long list.
func machineList(names []string) string {
	const shown = 5
	if len(names) <= shown {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:shown], ", "), len(names)-shown)
}

// kindCheckers bounds the machines checked at once: each check may make
// Talos API calls.
const kindCheckers = 16

// reconcileStopped acts on a retry request and runs the phase of an
// operation that does not advance this turn (a failed step, an operator's
// pause); stopped says it does not.
func (t *turn) reconcileStopped(ctx context.Context) (ctrl.Result, bool) {
	t.forgetConsumedRetry()
	switch {
	case t.op.StepFailed() && t.retryRuns():
		t.retry()
	case t.op.StepFailed():
		return t.reconcileFailed(ctx), true
	case t.newRetryRequest():
		// Nothing failed: a retry now would pre-approve a future failure.
		t.ignoreRetry("no step has failed, so there is nothing to run again")
	}
	if t.op.Spec.Paused {
		return t.reconcilePaused(ctx), true
	}
	return ctrl.Result{}, false
}

// reconcileFailed keeps an operation whose step failed where it is: it is
// never retried by itself, nothing is rolled back and nothing new starts,
// but the steps in flight settle.
func (t *turn) reconcileFailed(ctx context.Context) ctrl.Result { return t.settle(ctx) }

// settle lets the steps in flight end and starts nothing new. Run steps in
// flight run to their end (collect records it, and one a restart
// interrupted runs again), Wait steps are still checked (a reboot under way
// finishes), and a machine whose step has ended stops before its next Run
// step, to begin it on resume or retry.
func (t *turn) settle(ctx context.Context) ctrl.Result {
	requeue := t.checkWaits(ctx)
	t.stopBetweenSteps()
	t.canLaunch = true
	return ctrl.Result{RequeueAfter: requeue}
}

// newRetryRequest reports whether a retry annotation asks for a retry that
// has not been acted on.
func (t *turn) newRetryRequest() bool { return t.op.RetryPending() && !t.op.Status.RetryConsumed }

// retryRuns reports whether a retry request runs now: a new one is pending
// and no operator pause holds it back (resuming then runs it).
func (t *turn) retryRuns() bool { return t.newRetryRequest() && !t.op.Spec.Paused }

// forgetConsumedRetry finishes with a retry request already acted on: its
// annotation, if still there (its removal failed), is removed again and
// never acted on; once it is gone a new request may come.
func (t *turn) forgetConsumedRetry() {
	if !t.op.Status.RetryConsumed {
		return
	}
	if t.op.RetryPending() {
		t.dropRetry = true
		return
	}
	t.op.Status.RetryConsumed = false
}

// retry acts on a retry request: records it, clears the failure and runs
// the failed steps again (completed machines stay completed).
func (t *turn) retry() {
	st := &t.op.Status
	st.LastRetry = &t.now
	st.RetryCount++
	var again []string
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachineFailed {
			continue
		}
		if m.StartedAt == nil {
			// It failed before it started: it waits for its turn again.
			m.Phase, m.FinishedAt, m.Message = ichorv1.MachinePending, nil, ""
			again = append(again, m.Name+": "+stepStart)
			continue
		}
		m.Phase, m.FinishedAt, m.Message = ichorv1.MachineInProgress, nil, "retrying"
		m.Attempts++
		again = append(again, m.Name+": "+m.Step)
	}
	st.FailureReason, st.RetryConsumed = "", true
	t.dropRetry = true
	t.event(corev1.EventTypeNormal, "Retrying", "retry %d requested: running %s again", st.RetryCount, strings.Join(again, ", "))
}

// ignoreRetry removes a retry request that has nothing to act on, and says why.
func (t *turn) ignoreRetry(why string) {
	t.dropRetry = true
	t.event(corev1.EventTypeNormal, "RetryIgnored", "%s=true removed: %s", ichorv1.RetryAnnotation, why)
}

// reconcilePaused stops an operator-paused operation between steps: the
// steps in flight settle. It keeps the cluster lock if it holds it.
func (t *turn) reconcilePaused(ctx context.Context) ctrl.Result { return t.settle(ctx) }

// reconcileRunning evaluates Wait steps and starts the machines the plan
// allows. deriveStatus finds the operation Succeeded once every machine is done.
func (t *turn) reconcileRunning(ctx context.Context) (ctrl.Result, error) {
	op := t.op
	st := &op.Status
	requeue := t.checkWaits(ctx)
	if op.StepFailed() {
		t.stopBetweenSteps()
		t.canLaunch = true
		return ctrl.Result{RequeueAfter: requeue}, nil
	}
	for i := range st.Machines {
		st.Machines[i].Stopped = false // resumed, or retried
	}
	t.advanceStage()
	t.skipHeld()
	s, _ := plan.Stage(st)
	view, idx := plan.InStage(st.Machines, s)
	start, wait := plan.Next(view, t.outOfService(ctx), plan.Budget(s, int(op.Spec.MaxUnavailable)))
	for _, i := range start {
		t.startMachine(&st.Machines[plan.Index(idx, i)])
	}
	t.why = wait.String()
	if wait.Stuck() && op.Settled() {
		t.failStuck(view, idx, wait)
	}
	t.canLaunch = true
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// outOfService are the cluster's workers that count against
// maxUnavailable whatever this operation does: those that are down
// (NotReady), which may come back by themselves, and those that another
// Ichor holder cordoned and left so when its step failed, which stay out
// of service until that holder is retried or deleted: it cannot run while
// this operation holds the cluster lock. A Ready worker that an operator
// cordoned, or that an operation which has ended left cordoned (a reset
// or a shutdown does so on purpose), is in service.
func (t *turn) outOfService(ctx context.Context) map[string]plan.Out {
	own := ichorv1.OperationIdentity(t.op.Namespace, t.op.Name)
	// The machines this operation stopped on purpose, as a set: looking
	// each Node up in status would cost a turn of 1,000 machines a million
	// comparisons.
	var stoppedHere map[string]bool
	if s, ok := t.exec.(executor.StopsMachines); ok && s.StopsMachines() {
		stoppedHere = map[string]bool{}
		for _, m := range t.op.Status.Machines {
			if m.Phase == ichorv1.MachineSucceeded {
				stoppedHere[m.Name] = true
			}
		}
	}
	out := map[string]plan.Out{}
	for _, n := range t.nodes {
		if machine.Role(n) != ichorv1.RoleWorker || stoppedHere[n.Name] {
			continue
		}
		by := n.Annotations[executor.CordonedByAnnotation]
		switch {
		case n.Spec.Unschedulable && by != "" && by != own && t.stopped(ctx, by):
			out[n.Name] = plan.Out{Why: "cordoned by " + by + ", which has stopped", Stuck: true}
		case !machine.Ready(n):
			out[n.Name] = plan.Out{Why: "NotReady"}
		}
	}
	return out
}

// stopped says whether the Ichor holder that a cordon names is an
// operation that is still there and has not ended: one stopped on a failed
// step (or paused), which may yet work on the machine it cordoned. One that
// succeeded, was cancelled or is gone has left nothing but its cordon. A
// cache read: the holder's end only makes more workers count as in
// service, and the lock this turn holds keeps that holder from starting.
func (t *turn) stopped(ctx context.Context, identity string) bool {
	id, err := ichorv1.ParseLockHolder(identity)
	if err != nil || id.Kind != ichorv1.HolderOperation {
		return true // not an operation's: kept out of service, as before
	}
	other := &ichorv1.TalosOperation{}
	if err := t.r.Client.Get(ctx, client.ObjectKey{Namespace: id.Namespace, Name: id.Name}, other); err != nil {
		return !apierrors.IsNotFound(err)
	}
	return !other.Succeeded() && !(other.Cancelled() && other.Settled())
}

// failStuck fails the next worker when workers that only a person brings
// back use up the budget: waiting would hold the cluster lock forever, and
// the holder that left them cordoned needs it to finish. Nothing of this
// operation is in flight, so the lock goes; a retry checks the budget again.
func (t *turn) failStuck(view []ichorv1.MachineStatus, idx []int, wait plan.Wait) {
	for i, m := range view {
		if m.Role == ichorv1.RoleWorker && m.Phase == ichorv1.MachinePending {
			t.fail(&t.op.Status.Machines[plan.Index(idx, i)], stepStart, executor.Fail(ReasonWorkersUnavailable, "%s", wait))
			return
		}
	}
}

// stepStart names, in failures, the start of work on a machine: the
// machine failed before its first step.
const stepStart = "start"

// ReasonWorkersUnavailable is the failureReason of a worker that could not
// start because workers that only a person brings back use up maxUnavailable.
const ReasonWorkersUnavailable = "WorkersUnavailable"

// skipHeld skips the machines that have not started and whose Node has
// been put on hold since the operation started (before, plan did). In a
// Once stage it skips none: its holds were honoured when it began
// (beginStage), and skipping the machine that runs it would hand its
// cluster-wide steps to one that is done already.
func (t *turn) skipHeld() {
	if s, _ := plan.Stage(&t.op.Status); s != nil && s.Order == ichorv1.StageOnce {
		return
	}
	st := &t.op.Status
	for i := range st.Machines {
		m := &st.Machines[i]
		if m.Phase != ichorv1.MachinePending {
			continue
		}
		if held, why := t.held(m.Name); held {
			m.Phase, m.Message, m.FinishedAt = ichorv1.MachineSkipped, why, &t.now
			t.event(corev1.EventTypeNormal, "MachineSkipped", "%s: %s", m.Name, why)
		}
	}
}

// held says whether the kind honours holds and the machine's Node carries
// one, and why.
func (t *turn) held(name string) (bool, string) {
	n := t.node(name)
	if !t.exec.HonourHold() || n == nil {
		return false, ""
	}
	return plan.Held(plan.Machine{Annotations: n.Annotations})
}

// reconcileOver is the turn of an operation that has ended: it lets go of
// the cluster lock if it still holds it, and removes a retry or skip
// request (there is nothing to run again or to skip).
func (t *turn) reconcileOver(ctx context.Context) (ctrl.Result, error) {
	if err := t.r.release(ctx, t.op); err != nil {
		return ctrl.Result{}, err
	}
	if endPending(t.op) {
		return t.reconcileEnded(ctx)
	}
	if err := t.actOnSkip(ctx); err != nil {
		return ctrl.Result{}, err
	}
	retry := t.op.RetryPending() || t.op.Status.RetryConsumed
	if !retry && !t.dropSkip {
		return ctrl.Result{}, nil
	}
	switch {
	case !retry:
	case t.newRetryRequest():
		why := "the operation has succeeded"
		if t.op.Refused() {
			why = "the operation was refused and nothing ran; a retry does not check it again: fix what its failed checks say and create a new operation"
			if preflight.Overridable(refusals(t.op)) {
				why += ", or " + ichorv1.OverrideHint
			}
		}
		t.ignoreRetry(why)
	default:
		t.forgetConsumedRetry()
	}
	if err := t.write(ctx); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, t.removeRequests(ctx)
}

// reconcileDelete lets a deleted operation go once nothing of it is in
// flight: its steps settle as after a failure (a machine mid-reboot comes
// back first), then the cordons it made are lifted, and only then is the
// cluster lock let go and the finalizer removed.
func (t *turn) reconcileDelete(ctx context.Context) (ctrl.Result, error) {
	op, r := t.persisted, t.r
	if !controllerutil.ContainsFinalizer(op, ichorv1.Finalizer) {
		return ctrl.Result{}, nil
	}
	if !op.Settled() {
		result, err := t.settleEnding(ctx)
		if err != nil {
			return ctrl.Result{}, err
		}
		deriveStatus(t.op, t.now, "")
		if err := t.write(ctx); err != nil {
			return ctrl.Result{}, client.IgnoreNotFound(err)
		}
		again, err := t.launch(ctx, nil)
		if err != nil {
			return ctrl.Result{}, err
		}
		if again {
			result = lookAgainSoon(result)
		}
		if !t.op.Settled() {
			// A step's end, a Node event or the requeue brings this back.
			return result, nil
		}
	}
	if err := t.uncordon(ctx, "the operation was deleted"); err != nil {
		return ctrl.Result{}, err
	}
	if err := r.release(ctx, op); err != nil {
		return ctrl.Result{}, err
	}
	r.runner.forget(op.UID)
	r.written.forget(op.UID)
	op = t.op.DeepCopy()
	controllerutil.RemoveFinalizer(op, ichorv1.Finalizer)
	return ctrl.Result{}, client.IgnoreNotFound(r.Client.Update(ctx, op))
}

// reconcileCancel stops a cancelled operation for good and keeps its
// record: as on delete, the steps in flight settle (nothing new starts),
// then the cordons it made are lifted and the cluster lock goes to the next
// waiter; the phase is Cancelled throughout.
func (t *turn) reconcileCancel(ctx context.Context) (ctrl.Result, error) {
	var result ctrl.Result
	if req, ok := t.op.SkipRequested(); ok {
		t.ignoreSkip(req, "the operation was cancelled")
	}
	if !t.op.Settled() {
		var err error
		if result, err = t.settleEnding(ctx); err != nil {
			return ctrl.Result{}, err
		}
	}
	if t.op.Settled() {
		if err := t.uncordon(ctx, "the operation was cancelled"); err != nil {
			return ctrl.Result{}, err
		}
		if err := t.r.release(ctx, t.op); err != nil {
			return ctrl.Result{}, err
		}
		t.op.Status.Lock = ""
	}
	deriveStatus(t.op, t.now, "")
	t.announce()
	if err := t.write(ctx); err != nil {
		return ctrl.Result{}, err
	}
	again, err := t.launch(ctx, nil)
	if again {
		result = lookAgainSoon(result)
	}
	return result, errors.Join(err, t.removeRequests(ctx))
}

// settleEnding lets the steps in flight of a deleted or cancelled operation
// settle as settle does, and counts the runs of irreversible steps it may
// launch as every turn does before its status write. A step that a killed
// controller left in flight, whose run no live controller has counted, so
// runs again now (knowing an earlier run may have made its call) instead of
// waiting for an event that may already have happened.
func (t *turn) settleEnding(ctx context.Context) (ctrl.Result, error) {
	if _, err := t.prepare(ctx); err != nil {
		return ctrl.Result{}, err
	}
	if t.exec == nil || t.talos == nil {
		return ctrl.Result{}, nil // no usable talosconfig: its Secret's change brings this back
	}
	t.collect()
	result := t.settle(ctx)
	t.countCalls()
	return result, nil
}

// uncordon lifts the cordons the operation made (its identity marks them),
// with its kind's own uncordon step: nothing else of it is rolled back.
func (t *turn) uncordon(ctx context.Context, why string) error {
	if t.exec == nil {
		t.exec = t.r.Executors[t.op.Spec.Kind]
	}
	if t.exec == nil {
		return nil
	}
	if err := t.loadNodes(ctx); err != nil {
		return err
	}
	for _, m := range t.op.Status.Machines {
		if err := t.uncordonMachine(ctx, m, why); err != nil {
			return err
		}
	}
	for _, e := range t.events {
		e()
	}
	t.events = nil
	return nil
}
