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
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/controller/talos"
)

// Reconciler drives TalosOperations.
type Reconciler struct {
	Client    client.Client
	Clientset kubernetes.Interface
	Recorder  recorder.EventRecorder
	Lock      *lock.Lock
	Talos     *talos.Connector
	Executors executor.Registry
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
	// superseded holds, per operation, the resourceVersions this controller
	// has itself replaced by writing: a cache that still shows one of them is
	// stale, and reconciling it would only end in a conflict (and backoff).
	// The watch event of the write brings the operation back anyway.
	superseded sync.Map // types.UID -> string
}

func (r *Reconciler) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

// Reconcile implements reconcile.Reconciler.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	op := &ichorv1.TalosOperation{}
	if err := r.Client.Get(ctx, req.NamespacedName, op); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if v, ok := r.superseded.Load(op.UID); ok && v.(string) == op.ResourceVersion {
		return ctrl.Result{}, nil
	}
	log := r.Log.WithValues("operation", req.NamespacedName.String())
	ctx = logr.NewContext(ctx, log)
	r.runner.settle(op)

	if !op.DeletionTimestamp.IsZero() {
		return r.finalize(ctx, op)
	}
	if !controllerutil.ContainsFinalizer(op, ichorv1.Finalizer) {
		controllerutil.AddFinalizer(op, ichorv1.Finalizer)
		return ctrl.Result{}, r.Client.Update(ctx, op)
	}
	if settled(op) {
		return ctrl.Result{}, r.release(ctx, op)
	}

	start := r.now()
	defer func() { log.V(1).Info("reconciled", "took", r.now().Sub(start).String(), "phase", op.Status.Phase) }()
	t := &turn{r: r, persisted: op, op: op.DeepCopy(), log: log}
	result, err := t.run(ctx)
	if werr := t.write(ctx); werr != nil {
		return ctrl.Result{}, werr
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	if t.op.Succeeded() || t.op.Refused() {
		// Let the next operation in at once, not a watch round trip later.
		return ctrl.Result{}, r.release(ctx, t.op)
	}
	t.launch(ctx)
	return result, nil
}

// turn is one reconcile of one operation: persisted is the status as read,
// op the working copy written at the end.
type turn struct {
	r         *Reconciler
	persisted *ichorv1.TalosOperation
	op        *ichorv1.TalosOperation
	log       logr.Logger
	exec      executor.Executor
	nodes     []corev1.Node // every Node, as the cache has them (read-only)
	byName    map[string]*corev1.Node
	cps       []string
	talos     *talosclient.Client
	// dropRetry removes the retry annotation once status is written.
	dropRetry bool
	// canLaunch says the operation may start the steps persisted status records.
	canLaunch bool
	events    []func()
}

func (t *turn) event(eventType, reason, format string, args ...any) {
	op := t.persisted
	t.events = append(t.events, func() {
		t.r.Recorder.Eventf(op, nil, eventType, reason, reason, format, args...)
	})
}

func (t *turn) run(ctx context.Context) (ctrl.Result, error) {
	op := t.op
	st := &op.Status
	t.exec = t.r.Executors[op.Spec.Kind]
	if t.exec == nil {
		t.refuse([]preflight.Failure{{Check: CheckKindSupported, Message: fmt.Sprintf(
			"this ichor-controller does not carry out kind %s yet (it carries out %s); nothing ran", op.Spec.Kind, t.r.kinds())}})
		return ctrl.Result{}, nil
	}
	if op.Refused() {
		// spec.override was set on a refused operation: run it that way.
		st.Phase, st.CompletionTime = ichorv1.PhasePending, nil
		setChecks(op, nil, false)
	}
	var nodes corev1.NodeList
	// Read-only: the cache's own objects, not 5,000 copies per turn.
	if err := t.r.Client.List(ctx, &nodes, client.UnsafeDisableDeepCopy); err != nil {
		return ctrl.Result{}, fmt.Errorf("list nodes: %w", err)
	}
	t.nodes = nodes.Items
	if st.StartTime == nil {
		if err := t.plan(); err != nil {
			t.refuse([]preflight.Failure{{Check: preflight.MachinesInScope, Message: err.Error()}})
			return ctrl.Result{}, nil
		}
	}

	tc, err := t.r.Talos.Client(ctx)
	var cfgErr *talos.ConfigError
	if errors.As(err, &cfgErr) {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: ConditionTalosAPI, Status: metav1.ConditionFalse,
			Reason: cfgErr.Reason, Message: cfgErr.Message, ObservedGeneration: op.Generation})
		if st.Phase == "" {
			setPhase(op, ichorv1.PhasePending, cfgErr.Reason, cfgErr.Message)
		}
		return ctrl.Result{}, nil
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	meta.RemoveStatusCondition(&st.Conditions, ConditionTalosAPI)
	t.talos = tc

	t.collect()
	if st.StartTime == nil {
		if ok, err := t.preflight(ctx, ""); !ok || err != nil {
			return ctrl.Result{}, err
		}
	}
	if !t.handleFailure() || !t.handlePause() {
		return ctrl.Result{}, nil
	}
	held, err := t.acquire(ctx)
	if err != nil || !held {
		return ctrl.Result{}, err
	}
	if st.StartTime == nil {
		if ok, err := t.preflight(ctx, "once the cluster lock was held"); !ok || err != nil {
			return ctrl.Result{}, err
		}
		now := metav1.NewTime(t.r.now())
		st.StartTime = &now
		t.event(corev1.EventTypeNormal, "Started", "started %s on %d machine(s)", st.Target, len(st.Machines))
	}
	return t.advance(ctx)
}

func (r *Reconciler) kinds() string {
	var out []string
	for _, k := range ichorv1.Kinds {
		if r.Executors[k] != nil {
			out = append(out, string(k))
		}
	}
	return fmt.Sprint(out)
}

// write saves the working copy's status when it changed, then emits the
// turn's Events and drops a consumed retry annotation.
func (t *turn) write(ctx context.Context) error {
	summarise(&t.op.Status)
	if !equality.Semantic.DeepEqual(t.persisted.Status, t.op.Status) {
		before := t.op.ResourceVersion
		if err := t.r.Client.Status().Update(ctx, t.op); err != nil {
			if apierrors.IsConflict(err) {
				t.log.V(1).Info("status changed meanwhile; reconciling again")
			}
			t.canLaunch = false
			return fmt.Errorf("write status: %w", err)
		}
		statusWrites.Inc()
		t.r.superseded.Store(t.op.UID, before)
		// What was just written is persisted: steps it records may start
		// now, without waiting for the write to come back through the watch.
		t.persisted = t.op.DeepCopy()
	}
	for _, e := range t.events {
		e()
	}
	if t.dropRetry {
		patch := []byte(fmt.Sprintf(`{"metadata":{"annotations":{%q:null}}}`, ichorv1.RetryAnnotation))
		before := t.op.ResourceVersion
		if err := t.r.Client.Patch(ctx, t.op, client.RawPatch(types.MergePatchType, patch)); err != nil {
			return fmt.Errorf("remove the retry annotation: %w", err)
		}
		t.r.superseded.Store(t.op.UID, before)
	}
	return nil
}

// refuse makes the operation Refused: terminal, nothing ran, no lock kept.
func (t *turn) refuse(failures []preflight.Failure) {
	op := t.op
	setChecks(op, failures, false)
	now := metav1.NewTime(t.r.now())
	op.Status.CompletionTime = &now
	op.Status.Lock, op.Status.LockHolder = "", ""
	msg := preflight.RefusedMessage(failures)
	if !overridable(failures) {
		msg = "refused; nothing ran: " + describe(failures)
	}
	setPhase(op, ichorv1.PhaseRefused, preflight.ConditionReason, msg)
	t.event(corev1.EventTypeWarning, preflight.EventRefused, "%s", msg)
}

// overridable: a kind this controller cannot carry out, or no machine in
// scope, cannot be overridden.
func overridable(fs []preflight.Failure) bool {
	for _, f := range fs {
		if f.Check == CheckKindSupported || f.Check == preflight.MachinesInScope {
			return false
		}
	}
	return true
}

func describe(fs []preflight.Failure) string {
	parts := make([]string, len(fs))
	for i, f := range fs {
		parts[i] = f.Check + ": " + f.Message
	}
	return strings.Join(parts, "; ")
}

// settled reports whether the operation is over: it succeeded, or it was
// refused and no override waits to run it (the API's Failed says when).
func settled(op *ichorv1.TalosOperation) bool {
	return op.Succeeded() || (op.Refused() && op.Failed())
}
