package lock

import (
	"context"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
)

// Judge decides whether a holder has finished with the lock without
// releasing it.
type Judge interface {
	Stale(ctx context.Context, h Holder) (Verdict, error)
}

// Verdict is a Judge's finding on a holder.
type Verdict struct {
	// Stale means the next taker may take the lock over.
	Stale bool
	// Over means the holder's work is over for good (deleted, completed,
	// done, finished), not merely paused on a failed step: the lock is
	// released even when nobody waits.
	Over bool
	// Why says which, for the Lease's takeover note.
	Why string
}

func stale(why string) Verdict { return Verdict{Stale: true, Why: why} }
func over(why string) Verdict  { return Verdict{Stale: true, Over: true, Why: why} }

// ClusterJudge finds holders stale from the objects they stand for, exactly
// as the specification says: an operation that was deleted, completed, or is
// paused on a failed step (an operator-paused one keeps the lock); a
// control-plane join or removal that is done, or whose Node is gone (unless
// the Lease lists its removal as not settled in etcd yet); a Job
// that was deleted or finished. An object with the holder's name but another
// UID is another object: the holder's is gone. An identity Ichor does not
// know is never stale: it has to be released by whoever took it.
type ClusterJudge struct {
	// Client reads the holders' objects. Decisions that start disruption
	// rest on its answers: give it the API server (a manager's APIReader),
	// not a cache.
	Client client.Reader
}

// Stale implements Judge.
func (j ClusterJudge) Stale(ctx context.Context, h Holder) (Verdict, error) {
	o := h.Object
	key := client.ObjectKey{Namespace: o.Namespace, Name: o.Name}
	switch o.Kind {
	case ichorv1.ObjectOperation:
		op := &ichorv1.TalosOperation{}
		if gone, err := j.get(ctx, key, op, h.UID); gone || err != nil {
			return over("deleted"), err
		}
		return OperationVerdict(op), nil
	case ichorv1.ObjectNode:
		node := &corev1.Node{}
		gone, err := j.get(ctx, key, node, h.UID)
		switch {
		case err != nil:
			return Verdict{}, err
		case gone && h.Removal:
			// Gone from Kubernetes, not yet from etcd: the membership
			// reconciler releases it once etcd has settled.
			return Verdict{}, nil
		case gone:
			return over("node gone"), nil
		}
		if node.DeletionTimestamp.IsZero() && machine.Ready(node) {
			return over("join or removal done"), nil
		}
	case ichorv1.ObjectJob:
		job := &batchv1.Job{}
		if gone, err := j.get(ctx, key, job, h.UID); gone || err != nil {
			return over("deleted"), err
		}
		for _, c := range job.Status.Conditions {
			if (c.Type == batchv1.JobComplete || c.Type == batchv1.JobFailed) && c.Status == corev1.ConditionTrue {
				return over("finished"), nil
			}
		}
	}
	return Verdict{}, nil
}

// get reads the holder's object and reports whether it is gone: not found,
// or another object of that name (the UID differs; an empty uid, from a
// Lease that did not record one, matches any).
func (j ClusterJudge) get(ctx context.Context, key client.ObjectKey, obj client.Object, uid types.UID) (gone bool, err error) {
	err = j.Client.Get(ctx, key, obj)
	if apierrors.IsNotFound(err) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return uid != "" && obj.GetUID() != uid, nil
}

// OperationVerdict judges an operation that exists, as the Judge does a
// holder: what a waiter concludes from it.
func OperationVerdict(op *ichorv1.TalosOperation) Verdict {
	switch {
	case op.Succeeded():
		return over("completed")
	case op.Refused() && op.Failed():
		return over("refused")
	case op.Cancelled() && op.Settled():
		return over("cancelled")
	case op.FailedAndSettled() && !op.PausedByOperator():
		return stale("paused on a failed step")
	}
	return Verdict{}
}
