// Package membership takes the cluster lock while a control plane joins or
// leaves, under the machine's identity (ichor-controller/machine/<node>), so
// that no disruptive operation starts while etcd membership changes.
//
// A join is a control-plane Node that has never been Ready: Ichor marks
// each control-plane Node it sees Ready with JoinedAnnotation, so a Node that
// goes NotReady later (a reboot) is not mistaken for a join. The first time
// the reconciler runs in a cluster it marks every control-plane Node that
// exists then as joined, Ready or not (they predate Ichor: one down for
// maintenance when Ichor is installed is not joining), and records that
// baseline on the lock Lease (LockMembershipBaselineAnnotation); a restarted
// controller or a new leader sees it and marks nothing. So only a Node
// created after the baseline can be a join.
//
// A removal is a control-plane Node that is deleted: held while its
// finalizers keep it, and, once it is gone (at once for a Node without
// finalizers: `kubectl delete node`), until the removal has settled in
// etcd. The delete event carries the gone Node's UID and addresses; the
// reconciler records the removal in the Lease (LockRemovalsAnnotation),
// takes the lock as the gone Node, and checks etcd through the Talos API
// until the remaining control planes agree on a healthy member list without
// a member for the machine. The Judge does not find a hold over because its
// Node is gone while the Lease lists its removal, and a restarted controller
// finds the removal there and checks on. A removal that has not settled
// within RemovalBound keeps the lock (etcd still counting a member that is
// gone is exactly what the lock guards against), says so once in an Event
// and a log line naming the machine and what etcd says, and the Lease keeps
// the latest finding for `kubectl ichor lock`. A Node of that name
// registering again (another UID) ends the removal: the machine is back.
// A Node deleted while no controller runs is not seen as a removal.
//
// Resetting a control plane through a TalosOperation is a removal too; that
// operation holds the lock under the machine's identity itself.
package membership

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/conflict"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/talos"
)

// JoinedAnnotation marks a control-plane Node Ichor has seen Ready, or
// found when it first ran.
const JoinedAnnotation = "ichor.maesh.dev/joined"

// Defaults for a removal's etcd checks.
const (
	DefaultRemovalCheck = 10 * time.Second
	DefaultRemovalBound = 15 * time.Minute
)

// Reconciler takes and releases the lock for joins and removals.
type Reconciler struct {
	Client   client.Client
	Lock     *lock.Lock
	Talos    *talos.Connector
	Recorder recorder.EventRecorder
	Log      logr.Logger
	// RemovalCheck is how often a removal's etcd is checked while it has
	// not settled; zero means DefaultRemovalCheck.
	RemovalCheck time.Duration
	// RemovalBound is how long a removal may take to settle before an
	// Event says it has not; zero means DefaultRemovalBound.
	RemovalBound time.Duration

	// baseMu guards baselined, set once the Lease holds the baseline.
	baseMu    sync.Mutex
	baselined bool
	mu        sync.Mutex
	// deleted are the control-plane Nodes seen deleted, by name, until the
	// Lease records their removal.
	deleted map[string]*corev1.Node
}

// SetupWithManager watches control-plane Nodes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	controlPlane := predicate.NewPredicateFuncs(func(o client.Object) bool {
		_, ok := o.GetLabels()[ichorv1.ControlPlaneLabel]
		return ok
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("membership").
		// Deletes come through r.removed, which keeps the gone Node.
		For(&corev1.Node{}, builder.WithPredicates(controlPlane, predicate.Funcs{DeleteFunc: func(event.DeleteEvent) bool { return false }})).
		Watches(&corev1.Node{}, handler.Funcs{DeleteFunc: r.removed}, builder.WithPredicates(controlPlane)).
		Watches(&coordinationv1.Lease{}, handler.EnqueueRequestsFromMapFunc(r.pending), builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
			return o.GetNamespace() == r.Lock.Namespace && o.GetName() == ichorv1.LockLeaseName
		}), lock.Changed())).
		WithOptions(controller.Options{SkipNameValidation: ptr.To(true)}).
		Complete(r)
}

// removed keeps the last state of a deleted control-plane Node (the
// informer's tombstone has it even when the delete itself was missed) for
// its reconcile, which records the removal in the Lease.
func (r *Reconciler) removed(_ context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
	node, ok := e.Object.(*corev1.Node)
	if !ok {
		return
	}
	r.mu.Lock()
	if r.deleted == nil {
		r.deleted = map[string]*corev1.Node{}
	}
	r.deleted[node.Name] = node
	r.mu.Unlock()
	q.Add(reconcile.Request{NamespacedName: types.NamespacedName{Name: node.Name}})
}

// Reconcile implements reconcile.Reconciler.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	res, err := r.reconcile(ctx, req)
	return conflict.Requeue(r.Log.WithValues("node", req.Name), res, err)
}

func (r *Reconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	if err := r.baseline(ctx); err != nil {
		return ctrl.Result{}, err
	}
	node := &corev1.Node{}
	err := r.Client.Get(ctx, req.NamespacedName, node)
	if apierrors.IsNotFound(err) {
		return r.gone(ctx, req.Name)
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.back(ctx, node); err != nil {
		return ctrl.Result{}, err
	}
	switch {
	case !node.DeletionTimestamp.IsZero():
		// Recorded before the Node is gone, so that no taker finds the
		// hold over in between.
		if err := r.record(ctx, node.Name, node); err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, r.take(ctx, lock.ForNode(node), node, "removal")
	case machine.Ready(node):
		if err := r.markJoined(ctx, node); err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, r.release(ctx, lock.ForNode(node), node, "joined")
	case node.Annotations[JoinedAnnotation] != "true":
		return ctrl.Result{}, r.take(ctx, lock.ForNode(node), node, "join")
	}
	return ctrl.Result{}, nil
}

func (r *Reconciler) markJoined(ctx context.Context, node *corev1.Node) error {
	if node.Annotations[JoinedAnnotation] == "true" {
		return nil
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, JoinedAnnotation)
	if err := r.Client.Patch(ctx, node, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		return fmt.Errorf("mark %s joined: %w", node.Name, err)
	}
	return nil
}

// baseline marks every control-plane Node joined and records the baseline
// in the Lease, unless the Lease holds it already.
func (r *Reconciler) baseline(ctx context.Context) error {
	r.baseMu.Lock()
	defer r.baseMu.Unlock()
	if r.baselined {
		return nil
	}
	st, err := r.Lock.Current(ctx)
	if err != nil {
		return err
	}
	if st.Baseline == "" {
		var nodes corev1.NodeList
		if err := r.Client.List(ctx, &nodes, client.HasLabels{ichorv1.ControlPlaneLabel}); err != nil {
			return fmt.Errorf("list control-plane nodes: %w", err)
		}
		for i := range nodes.Items {
			if err := r.markJoined(ctx, &nodes.Items[i]); err != nil {
				return err
			}
		}
		at, err := r.Lock.RecordBaseline(ctx, time.Now())
		if err != nil {
			return fmt.Errorf("record the membership baseline: %w", err)
		}
		r.Log.Info("first run in this cluster: the control planes that exist are joined", "controlPlanes", len(nodes.Items), "baseline", at)
	}
	r.baselined = true
	return nil
}

// take acquires the lock for h, a join or removal, which goes on whether or
// not it gets it. obj is what its Events are about.
func (r *Reconciler) take(ctx context.Context, h lock.Holder, obj client.Object, what string) error {
	res, err := r.Lock.Acquire(ctx, lock.Request{Holder: h})
	if err != nil {
		return fmt.Errorf("taking the cluster lock for the control-plane %s: %w", what, err)
	}
	if !res.Acquired {
		// The lock is taken as soon as its holder lets go (the Lease
		// watch wakes this reconcile).
		r.Log.Info("control-plane "+what+" while the cluster lock is held", "node", h.Object.Name, "holder", res.Holder)
		return nil
	}
	if res.AlreadyHeld {
		return nil
	}
	r.Recorder.Eventf(obj, nil, corev1.EventTypeNormal, "ClusterLockTaken", "ClusterLockTaken",
		"control-plane %s: the cluster lock is held as %s until it is done", what, h.Identity)
	return nil
}

// back ends the pending removal of a machine whose Node (another, by UID)
// has registered again: the machine is back.
func (r *Reconciler) back(ctx context.Context, node *corev1.Node) error {
	st, err := r.Lock.Get(ctx)
	if err != nil {
		return err
	}
	for _, rem := range st.Removals {
		if rem.Node == node.Name && rem.UID != node.UID {
			if err := r.end(ctx, rem, "its Node registered again"); err != nil {
				return err
			}
		}
	}
	return nil
}

// gone handles a control plane whose Node no longer exists: its removal is
// recorded in the Lease (from the delete event, or from a hold of the Node
// the Lease does not list as a removal yet) and lasts until etcd has
// settled.
func (r *Reconciler) gone(ctx context.Context, name string) (ctrl.Result, error) {
	st, err := r.Lock.Current(ctx)
	if err != nil {
		return ctrl.Result{}, err
	}
	r.mu.Lock()
	node := r.deleted[name]
	r.mu.Unlock()
	if node == nil && st.Holder.Object == (ichorv1.LockObject{Kind: ichorv1.ObjectNode, Name: name}) {
		// Its delete event came before this controller ran: the hold
		// says which Node it was; its hostname finds its member.
		node = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, UID: st.Holder.UID}}
	}
	if err := r.record(ctx, name, node); err != nil {
		return ctrl.Result{}, err
	}
	r.mu.Lock()
	if r.deleted[name] == node {
		delete(r.deleted, name)
	}
	r.mu.Unlock()
	if st, err = r.Lock.Current(ctx); err != nil {
		return ctrl.Result{}, err
	}
	var res ctrl.Result
	for _, rem := range st.Removals {
		if rem.Node != name {
			continue
		}
		again, err := r.settle(ctx, rem)
		if err != nil {
			return ctrl.Result{}, err
		}
		if again {
			res.RequeueAfter = r.every()
		}
	}
	return res, nil
}

// record writes the removal of node (nil: none) in the Lease, unless it
// is there already.
func (r *Reconciler) record(ctx context.Context, name string, node *corev1.Node) error {
	if node == nil || node.UID == "" {
		return nil
	}
	st, err := r.Lock.Current(ctx)
	if err != nil {
		return err
	}
	if _, listed := st.Removal(node.UID); listed {
		return nil
	}
	rem := ichorv1.LockRemoval{Node: name, UID: node.UID, Since: metav1.Now()}
	for _, a := range node.Status.Addresses {
		rem.Addresses = append(rem.Addresses, a.Address)
	}
	if err := r.Lock.PutRemoval(ctx, rem); err != nil {
		return fmt.Errorf("record the removal of %s in the cluster lock: %w", name, err)
	}
	r.Log.Info("control-plane removal: the cluster lock is held for it until etcd has settled", "node", name, "uid", node.UID)
	return nil
}

// settle checks etcd for the removal rem: settled, the removal ends and its
// lock is released; not yet, it holds (or waits for) the lock, the Lease
// keeps what etcd says, and again is true to check once more.
func (r *Reconciler) settle(ctx context.Context, rem ichorv1.LockRemoval) (again bool, err error) {
	finding := r.checkEtcd(ctx, rem)
	if finding == "" {
		return false, r.end(ctx, rem, "etcd has settled")
	}
	h := removalHolder(rem)
	if err := r.take(ctx, h, goneNode(rem), "removal"); err != nil {
		return false, err
	}
	overdue := !rem.Overdue && time.Since(rem.Since.Time) > r.bound()
	if finding == rem.Etcd && !overdue {
		return true, nil
	}
	rem.Etcd, rem.Overdue = finding, rem.Overdue || overdue
	if err := r.Lock.PutRemoval(ctx, rem); err != nil {
		return false, fmt.Errorf("record what etcd says of the removal of %s: %w", rem.Node, err)
	}
	if overdue {
		r.Log.Info("control-plane removal has not settled in etcd: the cluster lock stays held until it has",
			"node", rem.Node, "since", rem.Since.Time, "etcd", finding)
		r.Recorder.Eventf(goneNode(rem), nil, corev1.EventTypeWarning, "RemovalNotSettled", "RemovalNotSettled",
			"control plane %s removed from Kubernetes %s ago, but not from etcd: %s; the cluster lock stays held as %s",
			rem.Node, time.Since(rem.Since.Time).Round(time.Second), finding, h.Identity)
	}
	return true, nil
}

// checkEtcd returns what keeps the removal from having settled in etcd,
// "" when nothing does.
func (r *Reconciler) checkEtcd(ctx context.Context, rem ichorv1.LockRemoval) string {
	var nodes corev1.NodeList
	if err := r.Client.List(ctx, &nodes, client.HasLabels{ichorv1.ControlPlaneLabel}); err != nil {
		return "cannot list the control planes: " + err.Error()
	}
	var cps []string
	for i := range nodes.Items {
		if a := machine.Address(&nodes.Items[i]); a != "" && nodes.Items[i].Name != rem.Node {
			cps = append(cps, a)
		}
	}
	use, err := r.Talos.Use(ctx)
	if err != nil {
		return "cannot reach the Talos API: " + err.Error()
	}
	defer use.Release()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := talos.EtcdRemoved(ctx, use.Client, cps, rem.Node, rem.Addresses); err != nil {
		return err.Error()
	}
	return ""
}

// end takes the removal off the Lease and releases its lock.
func (r *Reconciler) end(ctx context.Context, rem ichorv1.LockRemoval, why string) error {
	h := removalHolder(rem)
	released, err := r.Lock.EndRemoval(ctx, h)
	if err != nil {
		return fmt.Errorf("end the removal of %s: %w", rem.Node, err)
	}
	r.Log.Info("control-plane removal done", "node", rem.Node, "why", why, "lockReleased", released)
	if released {
		r.Recorder.Eventf(goneNode(rem), nil, corev1.EventTypeNormal, "ClusterLockReleased", "ClusterLockReleased",
			"control plane removed: %s; cluster lock released", why)
	}
	return nil
}

func removalHolder(rem ichorv1.LockRemoval) lock.Holder {
	h := lock.ForNode(goneNode(rem))
	h.Removal = true
	return h
}

// goneNode stands for the Node that is gone, for Events about it.
func goneNode(rem ichorv1.LockRemoval) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: rem.Node, UID: rem.UID}}
}

func (r *Reconciler) every() time.Duration {
	if r.RemovalCheck > 0 {
		return r.RemovalCheck
	}
	return DefaultRemovalCheck
}

func (r *Reconciler) bound() time.Duration {
	if r.RemovalBound > 0 {
		return r.RemovalBound
	}
	return DefaultRemovalBound
}

// pending maps a change of the lock Lease to the control planes that
// wait for it: joining, being removed, or gone with their removal pending
// (a restarted controller finds those in the Lease).
func (r *Reconciler) pending(ctx context.Context, o client.Object) []reconcile.Request {
	var out []reconcile.Request
	add := func(name string) {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Name: name}})
	}
	removals, err := ichorv1.LockRemovals(o.GetAnnotations())
	if err != nil {
		r.Log.Error(err, "read the pending removals")
	}
	for _, rem := range removals {
		add(rem.Node)
	}
	var nodes corev1.NodeList
	if err := r.Client.List(ctx, &nodes, client.HasLabels{ichorv1.ControlPlaneLabel}, client.UnsafeDisableDeepCopy); err != nil {
		r.Log.Error(err, "list control-plane nodes")
		return out
	}
	for i := range nodes.Items {
		n := &nodes.Items[i]
		if !n.DeletionTimestamp.IsZero() || (!machine.Ready(n) && n.Annotations[JoinedAnnotation] != "true") {
			add(n.Name)
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
		r.Recorder.Eventf(node, nil, corev1.EventTypeNormal, "ClusterLockReleased", "ClusterLockReleased", "control plane %s: cluster lock released", why)
	}
	return nil
}
