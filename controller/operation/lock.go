package operation

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
)

// acquire takes (or confirms) the cluster lock. Operations take a free lock
// in creation order: a newer one leaves it to an older one that wants it.
func (t *turn) acquire(ctx context.Context) (bool, error) {
	place := t.persisted.QueuePlace()
	res, err := t.r.Lock.Acquire(ctx, lock.Request{Holder: t.holder(), Place: &place, WhileEnding: t.checkWhileEnding(ctx)})
	if err != nil {
		return false, fmt.Errorf("taking the cluster lock: %w", err)
	}
	if !res.Acquired {
		if res.Ahead != "" {
			holder := res.Holder
			if holder == "" {
				holder = res.Ahead
			}
			t.wait(holder, "waiting for the cluster lock: the older "+res.Ahead+" goes first")
			return false, nil
		}
		t.wait(res.Holder, fmt.Sprintf("waiting for the cluster lock, held by %s since %s", res.Holder, res.Since.UTC().Format(time.RFC3339)))
		return false, nil
	}
	status := &t.op.Status
	if status.Lock != ichorv1.LockHeld {
		lockHeld.Set(1)
		if res.TookOver != "" {
			t.event(corev1.EventTypeNormal, "LockTakenOver", "took the cluster lock over from %s", res.TookOver)
		} else {
			t.event(corev1.EventTypeNormal, "LockAcquired", "holds the cluster lock as %s", res.Holder)
		}
	}
	status.Lock, status.LockHolder = ichorv1.LockHeld, ""
	t.lockSeen, t.freeAt = res.Seen, res.FreeAt
	return true, nil
}

// checkWhileEnding runs the checks of an operation that has not started
// again while its Acquire waits for an idle holder's release, when they
// last ran before that holder went idle: once the lock is taken on that
// release they count as the checks made holding it (checkOnceHeld), and
// they run beside the holder's last writes instead of after the take. When
// they fail, checkOnceHeld runs them again holding the lock, and refuses.
func (t *turn) checkWhileEnding(ctx context.Context) func(time.Time) {
	return func(idle time.Time) {
		if t.started() || t.checkedAt.After(idle) {
			return
		}
		_, _ = t.checksPass(ctx, "once the cluster lock was held") // checkOnceHeld acts on a failure
	}
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

// holder is who holds the lock for this operation: the operation itself
// (by UID), under its identity.
func (t *turn) holder() lock.Holder { return lock.ForOperation(t.persisted, t.identity()) }

// release lets go of the cluster lock if this operation holds it, under
// whichever identity (its own, or its machine's for a reset).
func (r *Reconciler) release(ctx context.Context, op *ichorv1.TalosOperation) error {
	held, released, err := r.Lock.Release(ctx, lock.ForOperation(op, ichorv1.OperationIdentity(op.Namespace, op.Name)))
	if err != nil {
		return fmt.Errorf("releasing the cluster lock: %w", err)
	}
	if released {
		lockHeld.Set(0)
		lockHeldSeconds.Add(held.Seconds())
		r.Recorder.Eventf(op, nil, corev1.EventTypeNormal, "LockReleased", "LockReleased", "released the cluster lock after %s", held.Round(time.Millisecond))
	}
	return nil
}
