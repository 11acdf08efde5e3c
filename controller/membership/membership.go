// Package membership takes the cluster lock while a control plane joins or
// leaves, under the machine's identity (ichor-controller/machine/<node>), so
// that no disruptive operation starts while etcd membership changes.
//
// A join is a control-plane Node that has never been Ready: Ichor marks
// each control-plane Node it sees Ready with JoinedAnnotation, so a Node that
// goes NotReady later (a reboot) is not mistaken for a join. A removal is a
// control-plane Node being deleted. Resetting a control plane through a
// TalosOperation is a removal too; that operation holds the lock under the
// machine's identity itself.
package membership

import (
	"context"
	"fmt"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/conflict"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/machine"
)

// JoinedAnnotation marks a control-plane Node Ichor has seen Ready.
const JoinedAnnotation = "ichor.maesh.dev/joined"

// Reconciler takes and releases the lock for joins and removals.
type Reconciler struct {
	Client   client.Client
	Lock     *lock.Lock
	Recorder recorder.EventRecorder
	Log      logr.Logger
}

// SetupWithManager watches control-plane Nodes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	controlPlane := predicate.NewPredicateFuncs(func(o client.Object) bool {
		_, ok := o.GetLabels()[ichorv1.ControlPlaneLabel]
		return ok
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("membership").
		For(&corev1.Node{}, builder.WithPredicates(controlPlane)).
		Watches(&coordinationv1.Lease{}, handler.EnqueueRequestsFromMapFunc(r.pending), builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			return o.GetNamespace() == r.Lock.Namespace && o.GetName() == ichorv1.LockLeaseName
		}), lock.Changed())).
		WithOptions(controller.Options{SkipNameValidation: ptr.To(true)}).
		Complete(r)
}

// Reconcile implements reconcile.Reconciler.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	res, err := r.reconcile(ctx, req)
	return conflict.Requeue(r.Log.WithValues("node", req.Name), res, err)
}

func (r *Reconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	node := &corev1.Node{}
	err := r.Client.Get(ctx, req.NamespacedName, node)
	if apierrors.IsNotFound(err) {
		return ctrl.Result{}, r.gone(ctx, req.Name)
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	switch {
	case !node.DeletionTimestamp.IsZero():
		return ctrl.Result{}, r.take(ctx, node, "removal")
	case machine.Ready(node):
		if node.Annotations[JoinedAnnotation] != "true" {
			patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, JoinedAnnotation)
			if err := r.Client.Patch(ctx, node, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
				return ctrl.Result{}, fmt.Errorf("mark %s joined: %w", node.Name, err)
			}
		}
		return ctrl.Result{}, r.release(ctx, lock.ForNode(node), node, "joined")
	case node.Annotations[JoinedAnnotation] != "true":
		return ctrl.Result{}, r.take(ctx, node, "join")
	}
	return ctrl.Result{}, nil
}

func (r *Reconciler) take(ctx context.Context, node *corev1.Node, what string) error {
	h := lock.ForNode(node)
	res, err := r.Lock.Acquire(ctx, lock.Request{Holder: h})
	if err != nil {
		return fmt.Errorf("taking the cluster lock for the control-plane %s: %w", what, err)
	}
	if !res.Acquired {
		// The join or removal goes on regardless; the lock is taken as
		// soon as its holder lets go (the Lease watch wakes this reconcile).
		r.Log.Info("control-plane "+what+" while the cluster lock is held", "node", node.Name, "holder", res.Holder)
		return nil
	}
	if res.AlreadyHeld {
		return nil
	}
	r.Recorder.Eventf(node, nil, corev1.EventTypeNormal, "ClusterLockTaken", "ClusterLockTaken",
		"control-plane %s: the cluster lock is held as %s until it is done", what, h.Identity)
	return nil
}

// gone releases the lock a membership change of a Node that no longer
// exists holds, whatever its UID was.
func (r *Reconciler) gone(ctx context.Context, name string) error {
	st, err := r.Lock.Get(ctx)
	if err != nil || st.Holder.Object != (ichorv1.LockObject{Kind: ichorv1.ObjectNode, Name: name}) {
		return err
	}
	return r.release(ctx, st.Holder, nil, "removed")
}

// pending maps a change of the lock Lease to the control planes that
// wait for it: joining or being removed.
func (r *Reconciler) pending(ctx context.Context, _ client.Object) []reconcile.Request {
	var nodes corev1.NodeList
	if err := r.Client.List(ctx, &nodes, client.HasLabels{ichorv1.ControlPlaneLabel}, client.UnsafeDisableDeepCopy); err != nil {
		r.Log.Error(err, "list control-plane nodes")
		return nil
	}
	var out []reconcile.Request
	for i := range nodes.Items {
		n := &nodes.Items[i]
		if !n.DeletionTimestamp.IsZero() || (!machine.Ready(n) && n.Annotations[JoinedAnnotation] != "true") {
			out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Name: n.Name}})
		}
	}
	return out
}

// release lets go of the lock h holds, if it still holds it.
func (r *Reconciler) release(ctx context.Context, h lock.Holder, node *corev1.Node, why string) error {
	_, released, err := r.Lock.Release(ctx, h)
	if err != nil {
		return fmt.Errorf("releasing the cluster lock of %s: %w", h.Identity, err)
	}
	if released {
		r.Log.Info("control-plane membership change done; cluster lock released", "identity", h.Identity, "why", why)
		if node != nil {
			r.Recorder.Eventf(node, nil, corev1.EventTypeNormal, "ClusterLockReleased", "ClusterLockReleased", "control plane %s: cluster lock released", why)
		}
	}
	return nil
}
