// Package bootstrap holds the manifest sync of `talosctl upgrade-k8s` on
// Talos 1.13 and later: the bootstrap manifests a control plane renders
// from its configuration (COSI k8s.Manifest: kube-proxy, CoreDNS, ...) are
// server-side applied under Talos's field manager and recorded in Talos's
// inventory (controller/inventory), objects the inventory tracks that are
// no longer rendered are pruned, and the sync is done once every tracked
// object has reconciled (kstatus). Talos itself only creates these objects
// at bootstrap and never updates them, so without a sync a new
// cluster.proxy.image never reaches kube-proxy's DaemonSet.
package bootstrap

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/fluxcd/cli-utils/pkg/kstatus/polling"
	"github.com/fluxcd/cli-utils/pkg/kstatus/polling/clusterreader"
	"github.com/fluxcd/cli-utils/pkg/kstatus/polling/engine"
	kstatus "github.com/fluxcd/cli-utils/pkg/kstatus/status"
	"github.com/fluxcd/cli-utils/pkg/object"
	"github.com/fluxcd/pkg/ssa"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/controller/inventory"
)

// Read returns the objects of the bootstrap manifests of the control plane
// ctx is routed to (talosclient.WithNode), manifest by manifest in ID order
// (COSI lists them so; Talos numbers them in the order they apply), as
// go-kubernetes' GetBootstrapManifests reads them.
func Read(ctx context.Context, st state.State) ([]*unstructured.Unstructured, error) {
	list, err := safe.StateList[*k8s.Manifest](ctx, st, resource.NewMetadata(k8s.ControlPlaneNamespaceName, k8s.ManifestType, "", resource.VersionUndefined))
	if err != nil {
		return nil, fmt.Errorf("read the bootstrap manifests (COSI %s): %w", k8s.ManifestType, err)
	}
	var out []*unstructured.Unstructured
	for m := range list.All() {
		for _, item := range m.TypedSpec().Items {
			// A copy: the apply annotates the objects.
			out = append(out, (&unstructured.Unstructured{Object: item.Object}).DeepCopy())
		}
	}
	return out, nil
}

// Result is what a sync did, by action, as talosctl logs it.
type Result struct {
	Changes []ssa.ChangeSetEntry
	// Pruned are the objects the inventory tracked that Talos no longer
	// renders, deleted.
	Pruned []inventory.Object
}

// String says how many objects were created, configured, left unchanged
// and pruned.
func (r Result) String() string {
	counts := map[ssa.Action]int{}
	for _, e := range r.Changes {
		counts[e.Action]++
	}
	var parts []string
	for _, a := range []ssa.Action{ssa.CreatedAction, ssa.ConfiguredAction, ssa.UnchangedAction, ssa.SkippedAction} {
		if counts[a] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", counts[a], a))
		}
	}
	if len(r.Pruned) > 0 {
		parts = append(parts, fmt.Sprintf("%d pruned", len(r.Pruned)))
	}
	return cmp.Or(strings.Join(parts, ", "), "nothing to apply")
}

// waitTimeout bounds the wait of the apply for its first stage (CRDs,
// namespaces, cluster roles) to be ready; talosctl's reconcile timeout.
const waitTimeout = 5 * time.Minute

// Sync applies objs as talosctl's manifest sync does on Talos 1.13 and
// later, with its default options: server-side apply under Talos's field
// manager taking over conflicting fields (fluxcd ssa's apply always forces
// ownership), objects with immutable changes not recreated
// (--manifests-force is off), ConfigMaps and Secrets applied before the
// workloads that mount them, an object of another inventory refused
// (--manifests-inventory-policy AdoptIfNoInventory), then what the
// inventory tracks but objs no longer hold pruned. Applying what is already
// applied changes nothing, so a sync interrupted anywhere may run again.
func Sync(ctx context.Context, c client.Client, objs []*unstructured.Unstructured) (Result, error) {
	tracked, err := inventory.Read(ctx, c)
	if err != nil {
		return Result{}, err
	}
	for _, o := range objs {
		if err := adoptable(ctx, c, o); err != nil {
			return Result{}, err
		}
		annotations := o.GetAnnotations()
		if annotations == nil {
			annotations = map[string]string{}
		}
		annotations[inventory.OwningAnnotation] = inventory.Name
		o.SetAnnotations(annotations)
	}
	// The apply waits for its first stage (cluster roles, CRDs, namespaces)
	// reading each object by name: the default poller lists every object of
	// their kinds, which the controller's RBAC, by name, does not allow.
	poller := polling.NewStatusPoller(c, c.RESTMapper(), polling.Options{
		ClusterReaderFactory: engine.ClusterReaderFactoryFunc(clusterreader.NewDirectClusterReader)})
	mgr := ssa.NewResourceManager(c, poller, ssa.Owner{Field: constants.KubernetesFieldManagerName})
	cs, applyErr := mgr.ApplyAllStaged(ctx, objs, ssa.ApplyOptions{
		WaitInterval: 2 * time.Second, WaitTimeout: waitTimeout,
		CustomStageKinds: map[schema.GroupKind]struct{}{{Kind: "ConfigMap"}: {}, {Kind: "Secret"}: {}},
	})
	res := Result{}
	if cs != nil {
		res.Changes = cs.Entries
	}
	// What was applied is recorded even when the apply stopped half way,
	// so that a later sync may prune it.
	for _, e := range res.Changes {
		if !slices.Contains(tracked, e.ObjMetadata) {
			tracked = append(tracked, e.ObjMetadata)
		}
	}
	if err := errors.Join(applyErr, inventory.Write(ctx, c, tracked)); err != nil {
		return res, fmt.Errorf("apply the bootstrap manifests: %w", err)
	}
	kept, pruned, err := prune(ctx, mgr, tracked, objs)
	res.Pruned = pruned
	return res, errors.Join(err, inventory.Write(ctx, c, kept))
}

// adoptable refuses an object that exists and belongs to another inventory
// (AdoptIfNoInventory: one without an inventory is taken over).
func adoptable(ctx context.Context, c client.Client, o *unstructured.Unstructured) error {
	live, err := get(ctx, c, object.UnstructuredToObjMetadata(o), o.GroupVersionKind())
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if owner := live.GetAnnotations()[inventory.OwningAnnotation]; owner != "" && owner != inventory.Name {
		return fmt.Errorf("%s belongs to inventory %q, not Talos's %s/%s (annotation %s): remove the annotation to let Talos's manifests take it over",
			describe(object.UnstructuredToObjMetadata(o)), owner, inventory.Namespace, inventory.Name, inventory.OwningAnnotation)
	}
	return nil
}

// prune deletes the tracked objects objs no longer hold (in the background,
// as go-kubernetes does), unless another inventory owns them, and returns
// what the inventory keeps and what went.
func prune(ctx context.Context, mgr *ssa.ResourceManager, tracked []inventory.Object, objs []*unstructured.Unstructured) (kept, pruned []inventory.Object, err error) {
	rendered := map[inventory.Object]bool{}
	for _, o := range objs {
		rendered[object.UnstructuredToObjMetadata(o)] = true
	}
	var errs []error
	for _, ref := range tracked {
		if rendered[ref] {
			kept = append(kept, ref)
			continue
		}
		live, err := get(ctx, mgr.Client(), ref, schema.GroupVersionKind{})
		switch {
		case apierrors.IsNotFound(err):
			continue
		case err != nil:
			kept, errs = append(kept, ref), append(errs, err)
			continue
		}
		if owner := live.GetAnnotations()[inventory.OwningAnnotation]; owner != "" && owner != inventory.Name {
			kept, errs = append(kept, ref), append(errs, fmt.Errorf("prune %s: it belongs to inventory %q", describe(ref), owner))
			continue
		}
		if _, err := mgr.Delete(ctx, live, ssa.DeleteOptions{PropagationPolicy: metav1.DeletePropagationBackground}); err != nil && !apierrors.IsNotFound(err) {
			kept, errs = append(kept, ref), append(errs, fmt.Errorf("prune %s: %w", describe(ref), err))
			continue
		}
		pruned = append(pruned, ref)
	}
	return kept, pruned, errors.Join(errs...)
}

// get reads the live object ref names, of kind gvk or (its version empty)
// of the version the API server prefers.
func get(ctx context.Context, c client.Client, ref inventory.Object, gvk schema.GroupVersionKind) (*unstructured.Unstructured, error) {
	if gvk.Version == "" {
		m, err := c.RESTMapper().RESTMapping(ref.GroupKind)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", describe(ref), err)
		}
		gvk = m.GroupVersionKind
	}
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(gvk)
	if err := c.Get(ctx, client.ObjectKey{Namespace: ref.Namespace, Name: ref.Name}, u); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, err
		}
		return nil, fmt.Errorf("read %s: %w", describe(ref), err)
	}
	return u, nil
}

// Reconciled reports whether every object Talos's inventory tracks has
// reconciled, by kstatus (as talosctl's wait after the sync, and fluxcd
// ssa's, compute it: a DaemonSet is Current once the DaemonSet controller
// has rolled its new template out to every node it schedules to), and
// otherwise which object it waits for and why.
func Reconciled(ctx context.Context, c client.Client) (bool, string, error) {
	tracked, err := inventory.Read(ctx, c)
	if err != nil {
		return false, "", err
	}
	// The workloads first: a check while they roll out (each change of
	// kube-proxy's DaemonSet or CoreDNS's Deployment wakes the wait) stops
	// at them, instead of reading every RBAC object, ServiceAccount and
	// ConfigMap again first, which made the wait most of a Kubernetes
	// upgrade's API requests.
	slices.SortStableFunc(tracked, func(a, b inventory.Object) int { return cmp.Compare(checkOrder(a), checkOrder(b)) })
	for _, ref := range tracked {
		live, err := get(ctx, c, ref, schema.GroupVersionKind{})
		if apierrors.IsNotFound(err) {
			return false, "waiting for " + describe(ref) + " to be created", nil
		}
		if err != nil {
			return false, "", err
		}
		if ok, why, err := current(live, describe(ref)); err != nil || !ok {
			return false, why, err
		}
	}
	return true, fmt.Sprintf("%d objects of Talos's bootstrap manifests reconciled", len(tracked)), nil
}

// RolledOut is Reconciled of one workload already read (obj, of kind gvk):
// whether it has reconciled by kstatus, and otherwise why it is waited for.
func RolledOut(obj client.Object, gvk schema.GroupVersionKind) (bool, string, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return false, "", fmt.Errorf("status of %s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetGroupVersionKind(gvk)
	return current(u, describe(inventory.Object{GroupKind: gvk.GroupKind(), Namespace: obj.GetNamespace(), Name: obj.GetName()}))
}

// current says whether live, named what, is Current by kstatus, and
// otherwise why it is waited for.
func current(live *unstructured.Unstructured, what string) (bool, string, error) {
	res, err := kstatus.Compute(live)
	if err != nil {
		return false, "", fmt.Errorf("status of %s: %w", what, err)
	}
	if res.Status != kstatus.CurrentStatus {
		return false, fmt.Sprintf("waiting for %s to reconcile: %s (%s)", what, res.Status, res.Message), nil
	}
	return true, "", nil
}

// checkOrder puts the kinds that take a while to reconcile (their
// controllers roll their pods out) before those that are current once
// applied.
func checkOrder(o inventory.Object) int {
	if o.GroupKind.Group == "apps" && slices.Contains([]string{"DaemonSet", "Deployment", "StatefulSet"}, o.GroupKind.Kind) {
		return 0
	}
	return 1
}

// describe names an object as kubectl does: Kind namespace/name.
func describe(ref inventory.Object) string {
	if ref.Namespace == "" {
		return ref.GroupKind.Kind + " " + ref.Name
	}
	return ref.GroupKind.Kind + " " + ref.Namespace + "/" + ref.Name
}
