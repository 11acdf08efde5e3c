package operation

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

// acquire takes (or confirms) the cluster lock. Operations take a free lock
// in creation order: a newer one leaves it to an older one that wants it.
func (t *turn) acquire(ctx context.Context) (bool, error) {
	id := t.identity()
	st, err := t.r.Lock.Get(ctx)
	if err != nil {
		return false, err
	}
	if !st.Holds(id) {
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
		return false, fmt.Errorf("taking the cluster lock: %w", err)
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
	t.why = msg
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

// release lets go of the cluster lock if this operation holds it.
func (r *Reconciler) release(ctx context.Context, op *ichorv1.TalosOperation) error {
	for _, id := range []string{ichorv1.OperationIdentity(op.Namespace, op.Name), r.machineIdentity(op)} {
		if id == "" {
			continue
		}
		held, released, err := r.Lock.Release(ctx, id)
		if err != nil {
			return fmt.Errorf("releasing the cluster lock: %w", err)
		}
		if released {
			lockHeld.Set(0)
			lockHeldSeconds.Add(held.Seconds())
			r.Recorder.Eventf(op, nil, corev1.EventTypeNormal, "LockReleased", "LockReleased", "released the cluster lock after %s", held.Round(time.Millisecond))
		}
	}
	return nil
}

func (r *Reconciler) machineIdentity(op *ichorv1.TalosOperation) string {
	if op.Spec.Kind == ichorv1.KindNode && op.Spec.Node != nil && op.Spec.Node.Action == ichorv1.NodeReset {
		return ichorv1.MachineIdentity(op.Spec.Node.Machine)
	}
	return ""
}
