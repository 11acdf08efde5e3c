package lock

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Queue finds who goes before a taker.
type Queue interface {
	// Ahead names the first waiter queued before place that wants the
	// lock: an operation, or one of jobs (the Jobs the Lease lists). It
	// returns "" when there is none.
	Ahead(ctx context.Context, me Holder, place ichorv1.QueuePlace, jobs []ichorv1.LockWaiter) (string, error)
}

// ClusterQueue is the queue of the specification: operations that want the
// lock and Jobs waiting for it, in the order the API server created them.
type ClusterQueue struct {
	// Operations lists TalosOperations. An informer cache is fine: it
	// receives creations in the order the API server made them, so it
	// never lacks an operation older than one it has.
	Operations client.Reader
	// Judge tells a waiting Job that has finished or gone from one that
	// still waits.
	Judge Judge
}

// Ahead implements Queue.
func (q ClusterQueue) Ahead(ctx context.Context, me Holder, place ichorv1.QueuePlace, jobs []ichorv1.LockWaiter) (string, error) {
	var ops ichorv1.TalosOperationList
	if err := q.Operations.List(ctx, &ops, client.UnsafeDisableDeepCopy); err != nil {
		return "", fmt.Errorf("list operations: %w", err)
	}
	first, ahead := place, ""
	for i := range ops.Items {
		op := &ops.Items[i]
		if p := op.QueuePlace(); op.UID != me.UID && op.WantsLock() && p.Before(first) {
			first, ahead = p, ichorv1.OperationIdentity(op.Namespace, op.Name)
		}
	}
	for _, w := range jobs {
		if w.UID == me.UID || !w.Place.Before(first) {
			continue
		}
		h, err := waiterHolder(w)
		if err != nil {
			continue // not a Job Ichor knows: it cannot be judged, and a taker never queued it
		}
		v, err := q.Judge.Stale(ctx, h)
		if err != nil {
			return "", fmt.Errorf("judge waiting %s: %w", w.Identity, err)
		}
		if !v.Over {
			first, ahead = w.Place, w.Identity
		}
	}
	return ahead, nil
}

// waiterHolder is the holder a queued Job would be.
func waiterHolder(w ichorv1.LockWaiter) (Holder, error) {
	id, err := ichorv1.ParseLockHolder(w.Identity)
	if err != nil || id.Kind != ichorv1.HolderJob {
		return Holder{}, fmt.Errorf("queued %q is not a Job", w.Identity)
	}
	return Holder{Identity: w.Identity, Object: id.Object(), UID: w.UID}, nil
}

// Arrived reports whether the operation's arrival in the queue is recorded.
func Arrived(op *ichorv1.TalosOperation) bool { return op.Annotations[ichorv1.ArrivalAnnotation] != "" }

// RecordArrival records, unless it is recorded already, the operation's
// resourceVersion as its arrival revision (ichorv1.ArrivalAnnotation), for
// the caller to write. Called the first time the controller sees an
// operation, that is the revision the API server created it at, unless
// something changed it before; the watch delivers creations in the order
// they happened, so operations created within one second keep that order.
func RecordArrival(op *ichorv1.TalosOperation) {
	if !Arrived(op) {
		metav1.SetMetaDataAnnotation(&op.ObjectMeta, ichorv1.ArrivalAnnotation, op.ResourceVersion)
	}
}
