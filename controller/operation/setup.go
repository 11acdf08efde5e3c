package operation

import (
	"context"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/kubectl/pkg/util/podutils"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/siderolabs/talos/pkg/machinery/constants"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/machine"
)

// SetupWithManager registers the reconciler, the step runner and the
// watches: TalosOperations, Nodes (only changes that matter to a step), the
// cluster lock Lease, the talosconfig Secret, and finished steps.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.StepTimeout == 0 {
		r.StepTimeout = 15 * time.Minute
	}
	r.runner = newRunner(r.now)
	r.runner.afterRun = r.TestHookAfterRun
	if err := mgr.Add(r.runner); err != nil {
		return err
	}
	reader := client.Reader(mgr.GetClient())
	phases.client.Store(&reader)
	r.nodes = &nodeReader{client: reader, informers: mgr.GetCache()}
	ns := r.Lock.Namespace
	inNamespace := func(name string) predicate.Funcs {
		return predicate.NewPredicateFuncs(func(o client.Object) bool { return o.GetNamespace() == ns && o.GetName() == name })
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("talosoperation").
		For(&ichorv1.TalosOperation{}).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.active), builder.WithPredicates(nodeChanged())).
		// An operation that ends, fails or goes away may let a waiting one take its turn.
		Watches(&ichorv1.TalosOperation{}, handler.EnqueueRequestsFromMapFunc(r.waiters), builder.WithPredicates(turnChanged())).
		// The control-plane mirror pods (all the cache holds of Pods): a
		// kubernetes upgrade waits for each to restart on its new version.
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(r.active), builder.WithPredicates(mirrorPodChanged())).
		// Talos's bootstrap workloads (the cache holds kube-proxy's DaemonSet
		// and CoreDNS's Deployment only): the kinds that sync or remove them
		// wait for their rollouts, which only their status announces.
		// Metadata is enough to notice a change; the steps read them live.
		Watches(&appsv1.DaemonSet{}, handler.EnqueueRequestsFromMapFunc(r.bootstrapWaiters), builder.OnlyMetadata).
		Watches(&appsv1.Deployment{}, handler.EnqueueRequestsFromMapFunc(r.bootstrapWaiters), builder.OnlyMetadata).
		Watches(&coordinationv1.Lease{}, handler.EnqueueRequestsFromMapFunc(r.active), builder.WithPredicates(inNamespace(ichorv1.LockLeaseName), lock.Changed())).
		Watches(&corev1.Secret{}, handler.EnqueueRequestsFromMapFunc(r.active), builder.WithPredicates(inNamespace(ichorv1.TalosconfigSecret))).
		// A Job holding the lock (the Cilium Helm Job) is stale once it
		// finishes or goes: its changes wake the waiters. Metadata is enough
		// to notice a change, and keeps every Job of the cluster out of memory.
		Watches(&batchv1.Job{}, handler.EnqueueRequestsFromMapFunc(r.jobHolder), builder.OnlyMetadata).
		WatchesRawSource(source.Channel(r.runner.trigger, &handler.EnqueueRequestForObject{})).
		// Several managers run in one process in tests (replicas, restarts).
		WithOptions(controller.Options{MaxConcurrentReconciles: 4, SkipNameValidation: ptr.To(true)}).
		Complete(r)
}

// active maps any event to the operations that are not finished.
func (r *Reconciler) active(ctx context.Context, _ client.Object) []reconcile.Request {
	return r.requests(ctx, func(op *ichorv1.TalosOperation) bool {
		return !over(op) || endPending(op)
	})
}

// bootstrapWaiters maps a change of a bootstrap workload to the active
// operations of the kinds that wait for one: waking the others (a Talos
// upgrade's reboots move kube-proxy's status on every machine) would only
// cost them turns.
func (r *Reconciler) bootstrapWaiters(ctx context.Context, _ client.Object) []reconcile.Request {
	return r.requests(ctx, func(op *ichorv1.TalosOperation) bool {
		return !over(op) && (op.Spec.Kind == ichorv1.KindKubernetes || op.Spec.Kind == ichorv1.KindCNI)
	})
}

// jobHolder maps a change of a Job to the operation that started it (its
// step waits for the Job), and to the waiting operations when that Job
// holds the cluster lock.
func (r *Reconciler) jobHolder(ctx context.Context, job client.Object) []reconcile.Request {
	var out []reconcile.Request
	if ns, name, ok := strings.Cut(job.GetAnnotations()[executor.JobOperationAnnotation], "/"); ok {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: ns, Name: name}})
	}
	st, err := r.Lock.Get(ctx)
	if err != nil || st.Holder.Object != (ichorv1.LockObject{Kind: ichorv1.ObjectJob, Namespace: job.GetNamespace(), Name: job.GetName()}) {
		return out
	}
	return append(out, r.waiters(ctx, job)...)
}

// live is the client that reads past the cache.
func (r *Reconciler) live() client.Client {
	if r.Live != nil {
		return r.Live
	}
	return r.Client
}

// waiters maps an event to the other operations that wait for the cluster lock.
func (r *Reconciler) waiters(ctx context.Context, changed client.Object) []reconcile.Request {
	return r.requests(ctx, func(op *ichorv1.TalosOperation) bool {
		return op.WaitingForLock() && op.UID != changed.GetUID()
	})
}

// requests lists the operations (from the cache) that match.
func (r *Reconciler) requests(ctx context.Context, match func(*ichorv1.TalosOperation) bool) []reconcile.Request {
	var ops ichorv1.TalosOperationList
	if err := r.Client.List(ctx, &ops, client.UnsafeDisableDeepCopy); err != nil {
		r.Log.Error(err, "list operations")
		return nil
	}
	var out []reconcile.Request
	for i := range ops.Items {
		if match(&ops.Items[i]) {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&ops.Items[i])})
		}
	}
	return out
}

// turnChanged passes the operation events that can change whose turn it is:
// its phase, its failure, a pause, its deletion, and what a waiter's judge
// concludes of it as a holder. Not its steps settling while it runs on (a
// holder's every machine): that only matters to the judge once a step
// failed or it was cancelled, and waking the waiters for each would run
// their checks for nothing, and ahead of the holder's end.
func turnChanged() predicate.Funcs {
	return predicate.Funcs{
		CreateFunc: func(event.CreateEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			a, okA := e.ObjectOld.(*ichorv1.TalosOperation)
			b, okB := e.ObjectNew.(*ichorv1.TalosOperation)
			return !okA || !okB || a.Status.Phase != b.Status.Phase || a.Status.FailureReason != b.Status.FailureReason ||
				lock.OperationVerdict(a) != lock.OperationVerdict(b) ||
				a.Spec.Paused != b.Spec.Paused || !a.DeletionTimestamp.Equal(b.DeletionTimestamp)
		},
	}
}

// mirrorPodChanged passes the mirror-pod events a step waiting for a
// static pod's restart looks for: a pod created or deleted, its
// configuration version, its readiness.
func mirrorPodChanged() predicate.Funcs {
	return predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			a, okA := e.ObjectOld.(*corev1.Pod)
			b, okB := e.ObjectNew.(*corev1.Pod)
			return !okA || !okB || podutils.IsPodReady(a) != podutils.IsPodReady(b) ||
				a.Annotations[constants.AnnotationStaticPodConfigVersion] != b.Annotations[constants.AnnotationStaticPodConfigVersion]
		},
	}
}

// nodeChanged passes Node events that can change what a step sees, and
// drops the heartbeats that make up most Node updates.
func nodeChanged() predicate.Funcs {
	return predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			a, okA := e.ObjectOld.(*corev1.Node)
			b, okB := e.ObjectNew.(*corev1.Node)
			if !okA || !okB {
				return true
			}
			return machine.Ready(a) != machine.Ready(b) ||
				a.Spec.Unschedulable != b.Spec.Unschedulable ||
				a.Status.NodeInfo.BootID != b.Status.NodeInfo.BootID ||
				a.Status.NodeInfo.OSImage != b.Status.NodeInfo.OSImage ||
				a.Status.NodeInfo.KubeletVersion != b.Status.NodeInfo.KubeletVersion ||
				!a.DeletionTimestamp.Equal(b.DeletionTimestamp) ||
				a.Annotations[ichorv1.UpgradeHoldAnnotation] != b.Annotations[ichorv1.UpgradeHoldAnnotation] ||
				a.Labels[ichorv1.UpgradeOrderLabel] != b.Labels[ichorv1.UpgradeOrderLabel]
		},
	}
}
