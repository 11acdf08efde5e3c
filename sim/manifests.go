package sim

import (
	"context"
	"encoding/json"
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Talos's bootstrap-manifests inventory and the annotation on what it applied.
const (
	inventoryName       = "talos-bootstrap-manifests-inventory"
	owningInventoryAnno = "config.k8s.io/owning-inventory"
)

// kubeProxyManifest is what Talos's ManifestApplyController does with the
// kube-proxy bootstrap manifest (10-kube-proxy) when Spec.KubeProxy is set:
// while a running control plane's configuration leaves cluster.proxy
// enabled, its DaemonSet, ServiceAccount and ClusterRoleBinding are created
// if missing (never updated, never deleted: disabling the proxy leaves
// them) and recorded in the inventory ConfigMap under go-kubernetes' keys.
func (k *kube) kubeProxyManifest(m *Machine) {
	if k == nil || !k.f.spec.KubeProxy || m.spec.Role != ControlPlane || k.f.ctx.Err() != nil {
		return
	}
	k.f.wg.Go(func() { k.syncKubeProxy(m) })
}

func (k *kube) syncKubeProxy(m *Machine) {
	if m.Down() {
		return
	}
	cfg := m.Config()
	if cfg == nil || cfg.Cluster() == nil || !cfg.Cluster().Proxy().Enabled() {
		return
	}
	ctx, cancel := k.ctx()
	defer cancel()
	if err := k.applyKubeProxy(ctx, cfg.Cluster().Proxy().Image()); err != nil {
		k.f.logf("%s: kube-proxy manifest: %v", m.Name(), err)
	}
}

func (k *kube) applyKubeProxy(ctx context.Context, image string) error {
	ns := metav1.NamespaceSystem
	meta := metav1.ObjectMeta{Name: "kube-proxy", Labels: map[string]string{"k8s-app": "kube-proxy", "tier": "node"},
		Annotations: map[string]string{owningInventoryAnno: inventoryName}}
	sa := &corev1.ServiceAccount{ObjectMeta: *meta.DeepCopy()}
	sa.Namespace = ns
	crb := &rbacv1.ClusterRoleBinding{ObjectMeta: *meta.DeepCopy(),
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "system:node-proxier"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "kube-proxy", Namespace: ns}}}
	ds := &appsv1.DaemonSet{ObjectMeta: *meta.DeepCopy()}
	ds.Namespace = ns
	ds.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"k8s-app": "kube-proxy"}}
	ds.Spec.Template.Labels = map[string]string{"k8s-app": "kube-proxy", "tier": "node"}
	ds.Spec.Template.Spec = corev1.PodSpec{
		ServiceAccountName: "kube-proxy", HostNetwork: true, PriorityClassName: "system-node-critical",
		Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
		Containers: []corev1.Container{{Name: "kube-proxy", Image: image,
			Command: []string{"/usr/local/bin/kube-proxy", "--proxy-mode=nftables"}}},
	}
	created := map[string]error{
		"_kube-proxy__ServiceAccount": ignoreExists(k.cs.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{})),
		"_kube-proxy_rbac.authorization.k8s.io_ClusterRoleBinding": ignoreExists(
			k.cs.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})),
		"_kube-proxy_apps_DaemonSet": ignoreExists(k.cs.AppsV1().DaemonSets(ns).Create(ctx, ds, metav1.CreateOptions{})),
	}
	keys := map[string]any{}
	for key, err := range created {
		if err != nil {
			return err
		}
		if key != "_kube-proxy_rbac.authorization.k8s.io_ClusterRoleBinding" {
			key = ns + key
		}
		keys[key] = ""
	}
	patch, _ := json.Marshal(map[string]any{"data": keys})
	_, err := k.cs.CoreV1().ConfigMaps(ns).Patch(ctx, inventoryName, types.MergePatchType, patch, metav1.PatchOptions{})
	if apierrors.IsNotFound(err) {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: inventoryName}, Data: map[string]string{}}
		for key := range keys {
			cm.Data[key] = ""
		}
		_, err = k.cs.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{})
	}
	if err != nil {
		return fmt.Errorf("record kube-proxy in %s: %w", inventoryName, err)
	}
	return nil
}

func ignoreExists[T any](_ T, err error) error {
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}
