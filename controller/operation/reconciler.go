// Package operation is the TalosOperation reconciler: the driver of the
// state machine that lives in each operation's status. On every reconcile it
// reads status, applies the results of steps that finished, decides what may
// happen next (lock, preflight, pause, retry, order), writes that intent to
// status, and only then starts the steps it wrote. A controller killed at any
// point, or a new leader, reads the same status and neither repeats a step
// that was recorded as done nor skips one.
package operation

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/conflict"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/controller/talos"
)

// Reconciler drives TalosOperations.
type Reconciler struct {
	Client    client.Client
	Clientset kubernetes.Interface
	// Live reads and writes past the cache (DaemonSets, ConfigMaps that
	// the controller does not watch); nil means Client.
	Live client.Client
	// Controller is what the controller knows of itself, for the steps
	// that start Jobs.
	Controller executor.Controller
	Recorder   recorder.EventRecorder
	Lock       *lock.Lock
	Talos      *talos.Connector
	Executors  executor.Registry
	// Compat is the compatibility table; nil means the embedded one.
	Compat *compat.Table
	// StepTimeout bounds steps that do not set their own.
	StepTimeout time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	Log logr.Logger
	// TestHookAfterRun, when set, is called after a Run step returns and
	// before its result is handed to the reconciler, so before status
	// records it. Tests kill the controller there, in the gap between an
	// irreversible call and its status write. Nil in production.
	TestHookAfterRun func(StepRun)

	runner *runner
	nodes  *nodeReader
	// written is each operation as this controller last wrote it: a turn
	// works from it while the cache still shows a version it replaced.
	written ownWrites
}

func (r *Reconciler) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

// Reconcile implements reconcile.Reconciler. It runs the phase the
// operation is in: deleted, over, or one turn of the state machine.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	res, err := r.reconcile(ctx, req)
	return conflict.Requeue(r.Log.WithValues("operation", req.NamespacedName.String()), res, err)
}

func (r *Reconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	op := &ichorv1.TalosOperation{}
	if err := r.Client.Get(ctx, req.NamespacedName, op); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	op = r.written.latest(op)
	if tk := r.Controller.Takeover; tk != nil && tk.Owns(req.NamespacedName) {
		// An etcd restore carried on outside the driver: its status here
		// is from before, or from a store about to be rewound. The
		// takeover writes the final one; look again after it.
		return ctrl.Result{RequeueAfter: 10 * time.Second}, nil
	}
	log := r.Log.WithValues("operation", req.NamespacedName.String())
	ctx = logr.NewContext(ctx, log)
	r.runner.settle(op)
	t := r.newTurn(op, log)
	defer t.releaseTalos()
	switch {
	case !op.DeletionTimestamp.IsZero():
		return t.reconcileDelete(ctx)
	case !controllerutil.ContainsFinalizer(op, ichorv1.Finalizer) || !lock.Arrived(op):
		// One write, the first time the controller sees the operation: its
		// finalizer, and its place in the queue for the cluster lock.
		lock.RecordArrival(op)
		controllerutil.AddFinalizer(op, ichorv1.Finalizer)
		before := op.ResourceVersion
		if err := r.Client.Update(ctx, op); err != nil {
			r.written.failed(op.UID, err)
			return ctrl.Result{}, err
		}
		r.written.wrote(before, op)
		return ctrl.Result{}, nil
	case over(op):
		return t.reconcileOver(ctx)
	case cancelRequested(op):
		return t.reconcileCancel(ctx)
	}
	began := t.now.Time // start reads the turn's clock again
	defer func() {
		log.V(1).Info("reconciled", "took", r.now().Sub(began).String(), "phase", t.op.Status.Phase)
	}()
	return t.reconcile(ctx)
}

// reconcile is one turn of an operation that is not over: decide, derive
// the status from what was decided, write it, and only then start the steps
// the written status records.
func (t *turn) reconcile(ctx context.Context) (ctrl.Result, error) {
	result, err := t.decide(ctx)
	t.countCalls()
	deriveStatus(t.op, t.now, t.why)
	t.announce()
	t.launchChained()
	ends := t.op.Succeeded() || t.op.Refused()
	if ends {
		// The release follows the write of the end: a waiter's turn in this
		// controller waits for it instead of taking the lock over.
		defer t.r.Lock.Ending(t.holder(), t.idleSince())()
	}
	check := t.checkLockBeside(ctx)
	werr := t.write(ctx)
	_ = check.wait() // it ends with the turn; launch reads its answer
	if werr != nil {
		return ctrl.Result{}, werr
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	if ends {
		// The step that ends the operation runs now that its end is
		// written; then the next operation may come in at once, not a
		// watch round trip later.
		return ctrl.Result{}, errors.Join(t.launchEnd(ctx), t.r.release(ctx, t.op), t.removeRequests(ctx))
	}
	again, err := t.launch(ctx, check)
	if err != nil {
		return ctrl.Result{}, errors.Join(err, t.removeRequests(ctx))
	}
	if again {
		result = lookAgainSoon(result)
	}
	return result, t.removeRequests(ctx)
}

// idleSince is, for a turn that ends the operation, the moment from which
// the operation changes nothing in the cluster: now, since every step of
// it has ended, unless a step runs once the end is written (a shutdown's);
// zero then. A waiter's checks that ran after it count as checks made
// holding the lock, once it takes the lock that this turn releases.
func (t *turn) idleSince() time.Time {
	if endedBy(&t.op.Status) != nil {
		return time.Time{}
	}
	return time.Now()
}

// announce leaves the Event of a change of phase (or of the reason a
// phase is Paused); lock waits have their own, WaitingForLock.
func (t *turn) announce() {
	before, now := &t.persisted.Status, &t.op.Status
	if before.Phase == now.Phase && before.Reason == now.Reason {
		return
	}
	switch {
	case now.Phase == ichorv1.PhaseRefused:
		t.event(corev1.EventTypeWarning, preflight.EventRefused, "%s", now.Message)
	case now.Phase == ichorv1.PhaseSucceeded:
		t.event(corev1.EventTypeNormal, "Succeeded", "%s", now.Message)
	case now.Phase == ichorv1.PhasePaused && now.Reason != ichorv1.ReasonClusterLockHeld:
		t.event(corev1.EventTypeNormal, "Paused", "%s: %s", now.Reason, now.Message)
	}
}

// write saves the working copy's status when it changed, then emits the
// turn's Events and drops a consumed retry annotation.
func (t *turn) write(ctx context.Context) error {
	if !equality.Semantic.DeepEqual(t.persisted.Status, t.op.Status) {
		before := t.op.ResourceVersion
		if err := t.r.Client.Status().Update(ctx, t.op); err != nil {
			t.canLaunch = false
			t.r.written.failed(t.op.UID, err)
			return fmt.Errorf("write status: %w", err)
		}
		statusWrites.Inc()
		// What was just written is persisted: steps it records may start
		// now, without waiting for the write to come back through the watch.
		t.persisted = t.op.DeepCopy()
		t.r.written.wrote(before, t.persisted)
	}
	for _, e := range t.events {
		e()
	}
	t.events = nil
	return nil
}

// removeRequests removes the request annotations the turn has done with (a
// retry, a skip). When that fails nothing else waits for it: status
// already records what the request did (retryConsumed, the Skipped
// machine), and the next turn removes it again.
func (t *turn) removeRequests(ctx context.Context) error {
	drop := map[string]any{}
	if t.dropRetry {
		drop[ichorv1.RetryAnnotation] = nil
	}
	if t.dropSkip {
		for _, a := range skipAnnotations {
			drop[a] = nil
		}
	}
	if len(drop) == 0 {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": drop}})
	if err != nil {
		return err
	}
	before := t.op.ResourceVersion
	if err := t.r.Client.Patch(ctx, t.op, client.RawPatch(types.MergePatchType, patch)); err != nil {
		t.r.written.failed(t.op.UID, err)
		return fmt.Errorf("remove the annotations of the requests acted on: %w", err)
	}
	t.r.written.wrote(before, t.op.DeepCopy())
	if t.op.Status.RetryConsumed {
		// The request is gone: a retry annotation from now on is a new one.
		return t.clearRetryConsumed(ctx)
	}
	return nil
}

// clearRetryConsumed records that the consumed retry request's annotation is gone.
func (t *turn) clearRetryConsumed(ctx context.Context) error {
	before := t.op.ResourceVersion
	t.op.Status.RetryConsumed = false
	if err := t.r.Client.Status().Update(ctx, t.op); err != nil {
		t.r.written.failed(t.op.UID, err)
		return fmt.Errorf("write status: %w", err)
	}
	statusWrites.Inc()
	t.persisted = t.op.DeepCopy()
	t.r.written.wrote(before, t.persisted)
	return nil
}

// over reports whether the operation has ended: it succeeded, or it was
// refused and no override waits to run it (the API's Failed says when).
// cancelRequested reports whether an operator cancelled an operation that
// had not succeeded.
func cancelRequested(op *ichorv1.TalosOperation) bool {
	asked, _ := op.CancelRequested()
	return asked && !op.Succeeded()
}

func over(op *ichorv1.TalosOperation) bool {
	return op.Succeeded() || (op.Refused() && op.Failed())
}
