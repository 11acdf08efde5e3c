package lock

import (
	"context"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
)

// ClusterJudge finds holders stale from the objects they stand for, exactly
// as the specification says: an operation that was deleted, completed, or is
// paused on a failed step (an operator-paused one keeps the lock); a machine
// whose join or removal is done or whose Node is gone; a Job that was deleted
// or finished. An identity Ichor does not know is never stale: it has to be
// released by whoever took it.
type ClusterJudge struct {
	// Client reads TalosOperations and Nodes (a cache is fine).
	Client client.Reader
	// Jobs reads Jobs; nil means Client.
	Jobs client.Reader
}

// Stale implements Judge.
func (j ClusterJudge) Stale(ctx context.Context, holder string) (bool, string, error) {
	id, err := ichorv1.ParseLockHolder(holder)
	if err != nil {
		return false, "", nil
	}
	switch id.Kind {
	case ichorv1.HolderOperation:
		return j.staleOperation(ctx, id)
	case ichorv1.HolderMachine:
		return j.staleMachine(ctx, id.Name)
	case ichorv1.HolderJob:
		return j.staleJob(ctx, id)
	}
	return false, "", nil
}

func (j ClusterJudge) staleOperation(ctx context.Context, id ichorv1.LockHolder) (bool, string, error) {
	op := &ichorv1.TalosOperation{}
	err := j.Client.Get(ctx, client.ObjectKey{Namespace: id.Namespace, Name: id.Name}, op)
	if apierrors.IsNotFound(err) {
		return true, "deleted", nil
	}
	if err != nil {
		return false, "", err
	}
	switch {
	case op.Succeeded():
		return true, "completed", nil
	case op.Refused():
		return true, "refused", nil
	case op.FailedAndSettled() && !op.PausedByOperator():
		return true, "paused on a failed step", nil
	}
	return false, "", nil
}

// staleMachine: a control-plane join holds the lock until its Node is Ready;
// a removal (the Node being deleted, or a reset operation on it) until the
// Node is gone or the reset operation has finished.
func (j ClusterJudge) staleMachine(ctx context.Context, name string) (bool, string, error) {
	node := &corev1.Node{}
	err := j.Client.Get(ctx, client.ObjectKey{Name: name}, node)
	if apierrors.IsNotFound(err) {
		return true, "node gone", nil
	}
	if err != nil {
		return false, "", err
	}
	if node.DeletionTimestamp != nil {
		return false, "", nil
	}
	resetting, err := j.resetInProgress(ctx, name)
	if err != nil || resetting {
		return false, "", err
	}
	if machine.Ready(node) {
		return true, "join or removal done", nil
	}
	return false, "", nil
}

func (j ClusterJudge) resetInProgress(ctx context.Context, machine string) (bool, error) {
	var ops ichorv1.TalosOperationList
	if err := j.Client.List(ctx, &ops, client.UnsafeDisableDeepCopy); err != nil {
		return false, err
	}
	for _, op := range ops.Items {
		n := op.Spec.Node
		if op.Spec.Kind != ichorv1.KindNode || n == nil || n.Action != ichorv1.NodeReset || n.Machine != machine {
			continue
		}
		if op.Status.Phase != ichorv1.PhaseSucceeded && op.Status.Phase != ichorv1.PhaseRefused {
			return true, nil
		}
	}
	return false, nil
}

func (j ClusterJudge) staleJob(ctx context.Context, id ichorv1.LockHolder) (bool, string, error) {
	r := j.Jobs
	if r == nil {
		r = j.Client
	}
	job := &batchv1.Job{}
	err := r.Get(ctx, client.ObjectKey{Namespace: id.Namespace, Name: id.Name}, job)
	if apierrors.IsNotFound(err) {
		return true, "deleted", nil
	}
	if err != nil {
		return false, "", err
	}
	for _, c := range job.Status.Conditions {
		if (c.Type == batchv1.JobComplete || c.Type == batchv1.JobFailed) && c.Status == corev1.ConditionTrue {
			return true, "finished", nil
		}
	}
	return false, "", nil
}
