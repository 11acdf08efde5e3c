package operation

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/event"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/talos"
)

// runner runs the Run steps of machines outside the reconcile loop and keeps
// their results until status has recorded them. It is the only state the
// controller keeps in memory, and it is a cache of work in flight: the step
// each goroutine runs was written to status before it started, so a new
// controller that has none of this memory runs the interrupted step again.
type runner struct {
	mu      sync.Mutex
	base    context.Context
	jobs    map[machineKey]*job
	results map[machineKey]result
	// waits remembers when a Wait step was first seen, for its timeout.
	waits map[stepKey]time.Time
	// calls remembers, per Irreversible step and attempt, the count of runs
	// (MachineStatus.Calls) this controller wrote to status to launch it.
	calls   map[stepKey]int32
	wg      sync.WaitGroup
	trigger chan event.GenericEvent
	now     func() time.Time
	// afterRun is Reconciler.TestHookAfterRun.
	afterRun func(StepRun)
}

// StepRun is a Run step that has just returned, as TestHookAfterRun sees it.
type StepRun struct {
	Operation types.NamespacedName
	UID       types.UID
	Machine   string
	Step      string
	Attempt   int32
	Err       error
}

type machineKey struct {
	op      types.UID
	machine string
}

type stepKey struct {
	machineKey
	step    string
	attempt int32
}

type job struct {
	step    string
	attempt int32
	// chained are the Chained steps begun after step in the same run, in
	// order; the last of them (or step) is the one running.
	chained []string
	// recorded is what the run's steps that ended recorded of the machine
	// (From, To, BootID): the steps after them may depend on it.
	recorded executor.Outcome
	// halted stops the chain before its next step: the operation stops.
	halted bool
	// progress is the running step's latest message (Env.Progress).
	progress string
}

// has reports whether the job ran or runs the named step.
func (j *job) has(step string) bool { return j.step == step || slices.Contains(j.chained, step) }

// current is the step the job runs now.
func (j *job) current() string {
	if n := len(j.chained); n > 0 {
		return j.chained[n-1]
	}
	return j.step
}

// result is what a run ended with: the steps it ran (the one launched,
// then those chained after it), the outcome of the last, with the From,
// To and BootID any of them recorded, and the last one's error.
type result struct {
	attempt int32
	ran     []ranStep
	outcome executor.Outcome
	err     error
}

// ranStep is one step of a run and how long it took.
type ranStep struct {
	name string
	took time.Duration
}

// has reports whether the run ran the named step.
func (r result) has(step string) bool {
	return slices.ContainsFunc(r.ran, func(s ranStep) bool { return s.name == step })
}

// last is the step the run ended with.
func (r result) last() string { return r.ran[len(r.ran)-1].name }

// follower gives, once a step of a run has ended with out, the Chained
// step that follows it in the same run, and its timeout; false ends the run.
type follower func(ctx context.Context, current string, out executor.Outcome) (executor.Step, time.Duration, bool)

func newRunner(now func() time.Time) *runner {
	return &runner{
		jobs:    map[machineKey]*job{},
		results: map[machineKey]result{},
		waits:   map[stepKey]time.Time{},
		calls:   map[stepKey]int32{},
		trigger: make(chan event.GenericEvent, 1024),
		now:     now,
	}
}

// Start implements manager.Runnable: steps run under the manager's context,
// so losing leadership or stopping cancels them.
func (r *runner) Start(ctx context.Context) error {
	r.mu.Lock()
	r.base = ctx
	r.mu.Unlock()
	<-ctx.Done()
	r.wg.Wait()
	return nil
}

// NeedLeaderElection implements manager.LeaderElectionRunnable.
func (r *runner) NeedLeaderElection() bool { return true }

// busy reports whether a step of the machine is running or has a result
// that status has not recorded yet.
func (r *runner) busy(k machineKey, step string, attempt int32) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j, ok := r.jobs[k]; ok && j.has(step) && j.attempt == attempt {
		return true
	}
	res, ok := r.results[k]
	return ok && res.has(step) && res.attempt == attempt
}

// running reports whether any step of the operation is running.
func (r *runner) running(op types.UID) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for k, j := range r.jobs {
		if k.op == op {
			out = append(out, k.machine+": "+j.current())
		}
	}
	return out
}

// launch runs step in a goroutine, then each Chained step that follow
// gives after it, and wakes the operation's reconcile when the run ends.
// The run holds talos, its hold on the Talos client, until then. It says
// why when it cannot start the step now.
func (r *runner) launch(op *ichorv1.TalosOperation, k machineKey, step executor.Step, attempt int32, timeout time.Duration, env *executor.Env, talos *talos.Use, follow follower) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.base == nil || r.base.Err() != nil {
		talos.Release()
		return errors.New("the step runner is not running (the controller is starting or stopping)")
	}
	if j, ok := r.jobs[k]; ok {
		talos.Release()
		return fmt.Errorf("%s (attempt %d) is still running on the machine", j.current(), j.attempt)
	}
	j := &job{step: step.Name, attempt: attempt}
	r.jobs[k] = j
	r.wg.Add(1)
	wake := &ichorv1.TalosOperation{}
	wake.Namespace, wake.Name = op.Namespace, op.Name
	env.Progress = func(msg string) {
		r.mu.Lock()
		j.progress = msg
		r.mu.Unlock()
		r.wake(wake)
	}
	go func() {
		defer r.wg.Done()
		defer talos.Release()
		res := result{attempt: attempt}
		for {
			out, err, stopping := r.run(op, k, step, attempt, timeout, env)
			if stopping {
				return // the manager is stopping: a new leader runs the step again
			}
			res.ran = append(res.ran, ranStep{step.Name, out.took})
			res.outcome, res.err = carry(res.outcome, out.Outcome), err
			if err != nil || follow == nil || !r.chain(j, &step, &timeout, follow, out.Outcome, res.outcome) {
				break
			}
			r.showLater(k, j, step.Name, wake)
		}
		r.mu.Lock()
		delete(r.jobs, k)
		if r.base.Err() == nil {
			r.results[k] = res
		}
		r.mu.Unlock()
		r.wake(wake)
	}()
	return nil
}

// showRunning is how long a Chained step runs before the operation is
// woken to name it in status. Most end sooner (a check, a cordon, a drain
// with nothing to evict), and a status write for each would sit in the
// way of the turn that launches the machine's next step; one that runs on
// (a drain a PodDisruptionBudget holds) is shown while it runs.
const showRunning = 250 * time.Millisecond

// showLater wakes the operation once the job has run step for showRunning,
// if it still runs it then.
func (r *runner) showLater(k machineKey, j *job, step string, op *ichorv1.TalosOperation) {
	time.AfterFunc(showRunning, func() {
		r.mu.Lock()
		still := r.jobs[k] == j && j.current() == step
		r.mu.Unlock()
		if still {
			r.wake(op)
		}
	})
}

// stepRun is what one step of a run returned, and how long it took.
type stepRun struct {
	executor.Outcome
	took time.Duration
}

// run runs one step of a run within its timeout. stopping says that the
// manager stopped under it: its result is nobody's.
func (r *runner) run(op *ichorv1.TalosOperation, k machineKey, step executor.Step, attempt int32, timeout time.Duration, env *executor.Env) (stepRun, error, bool) {
	ctx, cancel := context.WithTimeout(r.base, timeout)
	defer cancel()
	start := r.now()
	env.Log.V(1).Info("step started")
	out, err := step.Run(ctx, env)
	took := r.now().Sub(start)
	env.Log.V(1).Info("step ended", "took", took.String(), "err", err)
	if r.afterRun != nil {
		r.afterRun(StepRun{Operation: types.NamespacedName{Namespace: op.Namespace, Name: op.Name}, UID: op.UID,
			Machine: k.machine, Step: step.Name, Attempt: attempt, Err: err})
	}
	if err == nil && ctx.Err() != nil && r.base.Err() != nil {
		return stepRun{}, nil, true
	}
	if err != nil && ctx.Err() == context.DeadlineExceeded {
		err = executor.Fail(executor.FailureReason(step.Name), "%s did not finish within %s: %w", step.Name, timeout, err)
	}
	return stepRun{out, took}, err, false
}

// chain moves the run on to the Chained step that follows the one that
// ended with out, unless the operation has stopped meanwhile (halt);
// recorded is what the run's steps have recorded so far.
func (r *runner) chain(j *job, step *executor.Step, timeout *time.Duration, follow follower, out, recorded executor.Outcome) bool {
	next, t, ok := follow(r.base, step.Name, out)
	if !ok {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if j.halted || r.base.Err() != nil {
		return false
	}
	j.chained, j.progress, j.recorded = append(j.chained, next.Name), "", recorded
	*step, *timeout = next, t
	return true
}

// carry is the outcome of a run so far once a step of it ended with out:
// out, with the versions and boot ID the earlier steps recorded where out
// records none.
func carry(so executor.Outcome, out executor.Outcome) executor.Outcome {
	if out.From == "" {
		out.From = so.From
	}
	if out.To == "" {
		out.To = so.To
	}
	if out.BootID == "" {
		out.BootID = so.BootID
	}
	return out
}

// wake asks for a reconcile of the operation.
func (r *runner) wake(op *ichorv1.TalosOperation) {
	select {
	case r.trigger <- event.GenericEvent{Object: op}:
	default:
		// The channel only wakes reconciles; a full one means one is due anyway.
	}
}

// halt stops the operation's runs before their next Chained step: the
// steps running end, and nothing follows them in the same run.
func (r *runner) halt(op types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, j := range r.jobs {
		if k.op == op {
			j.halted = true
		}
	}
}

// progress returns the latest message of the machine's running step.
func (r *runner) progress(k machineKey, step string, attempt int32) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j, ok := r.jobs[k]
	if !ok || !j.has(step) || j.attempt != attempt || j.progress == "" {
		return "", false
	}
	return j.progress, true
}

// runningStep is the step the machine's run runs now, and what the run's
// steps that ended recorded, if its current step is one of that run's.
func (r *runner) runningStep(k machineKey, step string, attempt int32) (string, executor.Outcome, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	j, ok := r.jobs[k]
	if !ok || !j.has(step) || j.attempt != attempt {
		return "", executor.Outcome{}, false
	}
	return j.current(), j.recorded, true
}

// take returns the unrecorded result of the machine's current step.
func (r *runner) take(k machineKey, step string, attempt int32) (result, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	res, ok := r.results[k]
	if !ok || !res.has(step) || res.attempt != attempt {
		return result{}, false
	}
	return res, true
}

// settle drops what status has recorded: results (and wait deadlines and
// run counts) of steps the machine has moved past, according to the persisted status.
func (r *runner) settle(op *ichorv1.TalosOperation) {
	r.mu.Lock()
	defer r.mu.Unlock()
	current := map[string]ichorv1.MachineStatus{}
	for _, m := range op.Status.Machines {
		current[m.Name] = m
	}
	for k, res := range r.results {
		if k.op != op.UID {
			continue
		}
		m, ok := current[k.machine]
		if !ok || !working(m) || !res.has(m.Step) || m.Attempts != res.attempt {
			delete(r.results, k)
		}
	}
	for k := range r.stepKeys(op.UID) {
		m, ok := current[k.machine]
		if !ok || !working(m) || m.Step != k.step || m.Attempts != k.attempt {
			delete(r.waits, k)
			delete(r.calls, k)
		}
	}
}

// stepKeys are the operation's keys in waits and calls.
func (r *runner) stepKeys(uid types.UID) map[stepKey]bool {
	keys := map[stepKey]bool{}
	for k := range r.waits {
		if k.op == uid {
			keys[k] = true
		}
	}
	for k := range r.calls {
		if k.op == uid {
			keys[k] = true
		}
	}
	return keys
}

// counted is the run count this controller wrote to launch an
// Irreversible step (0 when it wrote none).
func (r *runner) counted(k stepKey) int32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[k]
}

// count remembers the run count written to launch an Irreversible step.
func (r *runner) count(k stepKey, n int32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls[k] = n
}

// waitDeadline returns when a Wait step times out, starting its clock at
// now the first time it is seen.
func (r *runner) waitDeadline(k stepKey, now time.Time, timeout time.Duration) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	first, ok := r.waits[k]
	if !ok {
		first = now
		r.waits[k] = first
	}
	return first.Add(timeout)
}

// forget drops everything about a deleted operation.
func (r *runner) forget(uid types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k := range r.results {
		if k.op == uid {
			delete(r.results, k)
		}
	}
	for k := range r.stepKeys(uid) {
		delete(r.waits, k)
		delete(r.calls, k)
	}
}
