package chaos

import (
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// settle clears every fault, powers machines back on, resumes what is
// paused and retries what failed, until every operation has succeeded (or
// Settle has passed).
func (r *run) settle() {
	r.tl.add(time.Now(), "settle: faults cleared, failures retried from here on")
	deadline := time.Now().Add(r.cfg.Settle)
	jobsDone := make(chan struct{})
	go func() { r.jobs.Wait(); close(jobsDone) }()
	for time.Now().Before(deadline) {
		for _, m := range r.fleet.Machines() {
			m.ClearFaults()
		}
		for i := range r.unhealthy {
			r.healed(i)
		}
		busy := r.settleOps()
		r.mu.Lock()
		cordoned := sortedKeys(r.cordoned)
		r.mu.Unlock()
		for _, n := range cordoned {
			r.uncordon(n)
		}
		select {
		case <-jobsDone:
		default:
			busy = true
		}
		if !busy {
			if h, err := r.lockHolder(); err == nil && !r.settledHolder(h) {
				return
			}
		}
		r.waitUntil(time.Now().Add(300 * time.Millisecond))
	}
	r.tl.add(time.Now(), "settle: gave up after %s", r.cfg.Settle)
}

// settleOps resumes, retries and powers on what the operations need, and
// says whether any is still going.
func (r *run) settleOps() bool {
	var ops ichorv1.TalosOperationList
	if err := r.env.Client.List(r.ctx, &ops, client.InNamespace(r.ns)); err != nil {
		return true
	}
	busy := false
	offWanted := map[string]bool{} // machines a shutdown or reset under way leaves off
	for i := range ops.Items {
		op := &ops.Items[i]
		if op.Succeeded() && op.DeletionTimestamp.IsZero() {
			continue
		}
		busy = true
		if shutsDown(op) {
			offWanted[op.Spec.Node.Machine] = true
		}
		if !op.DeletionTimestamp.IsZero() {
			continue
		}
		if op.Spec.Paused {
			r.settleAction("resume", op.Name, r.patchOp(op.Name, `{"spec":{"paused":false}}`))
		}
		if op.Status.FailureReason != "" && op.Annotations[ichorv1.RetryAnnotation] != ichorv1.RetryRequested {
			r.settleAction("retry", op.Name, r.patchOp(op.Name, fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, ichorv1.RetryAnnotation)))
		}
	}
	for _, m := range r.fleet.Machines() {
		if m.Off() && !offWanted[m.Name()] {
			r.settleAction("power on", m.Name(), m.PowerOn())
		}
		if m.Off() {
			busy = true
		}
	}
	return busy
}

// shutsDown says whether op is a shutdown or reset under way on its
// machine, which leaves the machine off. One that failed (its machine was
// off already, say) is retried with the machine on; one that has not
// started (it waits for the lock) may wait for that very machine to be back
// in service, as another operation's budget counts it.
func shutsDown(op *ichorv1.TalosOperation) bool {
	n := op.Spec.Node
	if n == nil || (n.Action != ichorv1.NodeShutdown && n.Action != ichorv1.NodeReset) || op.Status.FailureReason != "" {
		return false
	}
	for _, m := range op.Status.Machines {
		if m.Name == n.Machine {
			return m.Phase == ichorv1.MachineInProgress
		}
	}
	return false
}

func (r *run) settleAction(what, name string, err error) {
	r.tl.add(time.Now(), "settle: %s %s %s", what, name, errOrNil(err))
}

// settledHolder says whether the lock names an operation that is over.
func (r *run) settledHolder(holder string) bool {
	id, err := ichorv1.ParseLockHolder(holder)
	if err != nil || id.Kind != ichorv1.HolderOperation {
		return false
	}
	op := &ichorv1.TalosOperation{}
	err = r.env.Client.Get(r.ctx, client.ObjectKey{Namespace: id.Namespace, Name: id.Name}, op)
	return apierrors.IsNotFound(err) || (err == nil && op.Succeeded())
}
