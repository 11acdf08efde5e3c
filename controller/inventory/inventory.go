// Package inventory is Talos's record of the bootstrap manifests it applied:
// the ConfigMap kube-system/talos-bootstrap-manifests-inventory, whose keys
// name every object Talos created from its manifests (fluxcd cli-utils
// ObjMetadata strings, as go-kubernetes' SSA inventory writes them), and the
// config.k8s.io/owning-inventory annotation on those objects. The next
// `talosctl upgrade-k8s` server-side-applies what Talos renders and prunes
// what it tracks but no longer renders, so an object Ichor takes over (Cilium)
// or removes (kube-proxy) must leave the inventory first.
package inventory

import (
	"context"
	"fmt"
	"slices"

	"github.com/fluxcd/cli-utils/pkg/object"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// The inventory Talos keeps.
const (
	Namespace = constants.KubernetesInventoryNamespace
	Name      = constants.KubernetesBootstrapManifestsInventoryName
	// OwningAnnotation on an object names the inventory that owns it.
	OwningAnnotation = "config.k8s.io/owning-inventory"
)

// Object names one object, as the inventory's keys do.
type Object = object.ObjMetadata

// Ref names an object of kind group/kind.
func Ref(group, kind, namespace, name string) Object {
	return Object{GroupKind: schema.GroupKind{Group: group, Kind: kind}, Namespace: namespace, Name: name}
}

// Key is the object's key in the inventory ConfigMap, like
// kube-system_kube-proxy_apps_DaemonSet.
func Key(o Object) string { return o.String() }

// KubeProxy are the objects of Talos's kube-proxy bootstrap manifest
// (10-kube-proxy), rendered while cluster.proxy.disabled is not true.
var KubeProxy = []Object{
	Ref("apps", "DaemonSet", "kube-system", "kube-proxy"),
	Ref("", "ServiceAccount", "kube-system", "kube-proxy"),
	Ref("rbac.authorization.k8s.io", "ClusterRoleBinding", "", "kube-proxy"),
}

// Read lists the objects the inventory tracks; none when Talos keeps no
// inventory (a cluster not bootstrapped by Talos 1.13's manifest sync).
func Read(ctx context.Context, c client.Reader) ([]Object, error) {
	cm, err := get(ctx, c)
	if err != nil || cm == nil {
		return nil, err
	}
	out := make([]Object, 0, len(cm.Data))
	for key := range cm.Data {
		o, err := object.ParseObjMetadata(key)
		if err != nil {
			return nil, fmt.Errorf("ConfigMap %s/%s: key %q: %w", Namespace, Name, key, err)
		}
		out = append(out, o)
	}
	slices.SortFunc(out, func(a, b Object) int { return cmpString(a.String(), b.String()) })
	return out, nil
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func get(ctx context.Context, c client.Reader) (*corev1.ConfigMap, error) {
	cm := &corev1.ConfigMap{}
	err := c.Get(ctx, client.ObjectKey{Namespace: Namespace, Name: Name}, cm)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read ConfigMap %s/%s: %w", Namespace, Name, err)
	}
	return cm, nil
}

// Tracked returns those of objs the inventory tracks.
func Tracked(ctx context.Context, c client.Reader, objs ...Object) ([]Object, error) {
	all, err := Read(ctx, c)
	if err != nil {
		return nil, err
	}
	var out []Object
	for _, o := range objs {
		if slices.Contains(all, o) {
			out = append(out, o)
		}
	}
	return out, nil
}

// Remove takes objs out of the inventory, with the resourceVersion it read
// (a conflict is returned: read again and retry), so that Talos's next
// manifest sync neither re-applies nor prunes them. Keys not there are fine.
func Remove(ctx context.Context, c client.Client, objs ...Object) error {
	cm, err := get(ctx, c)
	if err != nil || cm == nil {
		return err
	}
	changed := false
	for _, o := range objs {
		if _, ok := cm.Data[Key(o)]; ok {
			delete(cm.Data, Key(o))
			changed = true
		}
	}
	if !changed {
		return nil
	}
	if err := c.Update(ctx, cm); err != nil {
		return fmt.Errorf("remove %d object(s) from ConfigMap %s/%s: %w", len(objs), Namespace, Name, err)
	}
	return nil
}

// Write makes the inventory track exactly objs, as go-kubernetes' ConfigMap
// inventory writes it (one key per object, empty values), creating the
// ConfigMap if Talos keeps none yet. The update carries the
// resourceVersion it read: a conflict is returned (read again and retry).
func Write(ctx context.Context, c client.Client, objs []Object) error {
	data := make(map[string]string, len(objs))
	for _, o := range objs {
		data[Key(o)] = ""
	}
	cm, err := get(ctx, c)
	if err != nil {
		return err
	}
	if cm == nil {
		cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: Name}, Data: data}
		if err := c.Create(ctx, cm); err != nil {
			return fmt.Errorf("create ConfigMap %s/%s: %w", Namespace, Name, err)
		}
		return nil
	}
	cm.Data = data
	if err := c.Update(ctx, cm); err != nil {
		return fmt.Errorf("write %d object(s) to ConfigMap %s/%s: %w", len(objs), Namespace, Name, err)
	}
	return nil
}
