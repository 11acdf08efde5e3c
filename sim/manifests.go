package sim

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/cosi-project/runtime/pkg/safe"
	talosconfig "github.com/siderolabs/talos/pkg/machinery/config/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
)

// Talos's bootstrap-manifests inventory and the annotation on what it applied.
const (
	inventoryName       = "talos-bootstrap-manifests-inventory"
	owningInventoryAnno = "config.k8s.io/owning-inventory"
)

// manifest is one bootstrap manifest Talos renders: its ID (the
// k8s.Manifest resource's) and its objects, in Talos's order.
type manifest struct {
	id   string
	objs []kruntime.Object
}

// bootstrapManifests are the manifests Talos's ManifestController renders
// from a control plane's configuration that the simulator models:
// kube-proxy (10-kube-proxy, while cluster.proxy is enabled) and CoreDNS
// (11-core-dns and 11-core-dns-svc, while cluster.coreDNS is enabled),
// and, as Talos's ExtraManifestController does, each of
// cluster.inlineManifests (99-<name>, after the default manifests).
// Talos also renders the kubelet bootstrap token, CSR RBAC, the in-cluster
// kubeconfig, Talos's node RBAC, flannel, its ServiceAccount CRD and the
// manifests it downloads (cluster.extraManifests); the simulator leaves
// those out.
//
// An inline manifest that does not parse is in failed, with why: Talos's
// ExtraManifestController fails its run and leaves that manifest's
// resource as it was, while the default manifests render on.
func bootstrapManifests(c talosconfig.ClusterConfig) (out []manifest, failed map[string]error) {
	if c.CoreDNS().Enabled() {
		ips, _ := c.Network().DNSServiceIPs()
		ip := ""
		if len(ips) > 0 {
			ip = ips[0].String()
		}
		out = append(out,
			manifest{"11-core-dns", coreDNSObjects(c.CoreDNS().Image(), c.Network().DNSDomain())},
			manifest{"11-core-dns-svc", []kruntime.Object{coreDNSService(ip)}})
	}
	if c.Proxy().Enabled() {
		out = append(out, manifest{"10-kube-proxy", kubeProxyObjects(c.Proxy().Image(), proxyArgs(c))})
	}
	for _, m := range c.InlineManifests() {
		id := "99-" + m.Name()
		objs, err := parseManifest(m.Contents())
		if err != nil {
			if failed == nil {
				failed = map[string]error{}
			}
			failed[id] = err
			continue
		}
		out = append(out, manifest{id, objs})
	}
	return out, failed
}

// parseManifest reads a multi-document YAML manifest as Talos's manifest
// adapter does (SetYAML): documents that are empty or only comments are
// skipped, and a List is unwrapped into its items.
func parseManifest(contents string) ([]kruntime.Object, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(contents)))
	var out []kruntime.Object
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		doc = bytes.TrimSpace(doc)
		if len(doc) == 0 {
			continue
		}
		js, err := utilyaml.ToJSON(doc)
		if err != nil {
			return nil, fmt.Errorf("convert a document to JSON: %w", err)
		}
		if string(js) == "null" || string(js) == "{}" {
			continue
		}
		obj := &unstructured.Unstructured{}
		if err := json.Unmarshal(js, obj); err != nil {
			return nil, fmt.Errorf("read a document as an object: %w", err)
		}
		if !obj.IsList() {
			out = append(out, obj)
			continue
		}
		err = obj.EachListItem(func(item kruntime.Object) error {
			out = append(out, item)
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("unwrap a List: %w", err)
		}
	}
}

// renderManifests is Talos's ManifestController on a control plane: one
// k8s.Manifest resource (namespace controlplane) per bootstrap manifest,
// its objects as unstructured maps; those no longer rendered are removed.
func (m *Machine) renderManifests() {
	cfg := m.Config()
	if m.spec.Role != ControlPlane || cfg == nil || cfg.Cluster() == nil {
		return
	}
	m.renderMu.Lock()
	defer m.renderMu.Unlock()
	rendered := map[string]bool{}
	manifests, failed := bootstrapManifests(cfg.Cluster())
	for id, err := range failed {
		m.f.logf("%s: render manifest %s: %v", m.Name(), id, err)
		rendered[id] = true
	}
	for _, mf := range manifests {
		res := k8s.NewManifest(k8s.ControlPlaneNamespaceName, mf.id)
		for _, obj := range mf.objs {
			u, err := kruntime.DefaultUnstructuredConverter.ToUnstructured(obj)
			if err != nil {
				m.f.logf("%s: render manifest %s: %v", m.Name(), mf.id, err)
				continue
			}
			res.TypedSpec().Items = append(res.TypedSpec().Items, k8s.SingleManifest{Object: u})
		}
		rendered[mf.id] = true
		m.put(res)
	}
	list, err := safe.StateListAll[*k8s.Manifest](context.Background(), m.cosi)
	if err != nil {
		return
	}
	for r := range list.All() {
		if !rendered[r.Metadata().ID()] {
			m.destroy(r.Metadata())
		}
	}
}

// proxyArgs are kube-proxy's flags as Talos renders them: its own, with
// cluster.proxy.extraArgs over them; the mode is nftables unless set.
func proxyArgs(c talosconfig.ClusterConfig) []string {
	mode := cmp.Or(c.Proxy().Mode(), "nftables")
	return renderArgs(map[string][]string{
		"cluster-cidr": {strings.Join(c.Network().PodCIDRs(), ",")}, "hostname-override": {"$(NODE_NAME)"},
		"kubeconfig": {"/etc/kubernetes/kubeconfig"}, "proxy-mode": {mode}, "conntrack-max-per-core": {"0"},
	}, argValues(c.Proxy().ExtraArgs()))
}

// kubeProxyObjects are Talos's 10-kube-proxy: the DaemonSet, its
// ServiceAccount and ClusterRoleBinding.
func kubeProxyObjects(image string, args []string) []kruntime.Object {
	labels := map[string]string{"tier": "node", "k8s-app": "kube-proxy"}
	ds := &appsv1.DaemonSet{
		TypeMeta:   metav1.TypeMeta{Kind: "DaemonSet", APIVersion: "apps/v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy", Namespace: metav1.NamespaceSystem, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			UpdateStrategy: appsv1.DaemonSetUpdateStrategy{Type: appsv1.RollingUpdateDaemonSetStrategyType,
				RollingUpdate: &appsv1.RollingUpdateDaemonSet{MaxUnavailable: ptr.To(intstr.FromInt(1))}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					Containers: []corev1.Container{{Name: "kube-proxy", Image: image,
						Command: append([]string{"/usr/local/bin/kube-proxy"}, args...),
						Env: []corev1.EnvVar{
							{Name: "NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
							{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
						},
						SecurityContext: &corev1.SecurityContext{Privileged: ptr.To(true)},
					}},
					HostNetwork: true, PriorityClassName: "system-cluster-critical", ServiceAccountName: "kube-proxy",
					Tolerations: []corev1.Toleration{
						{Effect: corev1.TaintEffectNoSchedule, Operator: corev1.TolerationOpExists},
						{Effect: corev1.TaintEffectNoExecute, Operator: corev1.TolerationOpExists},
					},
				},
			},
		},
	}
	sa := &corev1.ServiceAccount{TypeMeta: metav1.TypeMeta{Kind: "ServiceAccount", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy", Namespace: metav1.NamespaceSystem}}
	crb := &rbacv1.ClusterRoleBinding{TypeMeta: metav1.TypeMeta{Kind: "ClusterRoleBinding", APIVersion: "rbac.authorization.k8s.io/v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "kube-proxy", Namespace: metav1.NamespaceSystem}},
		RoleRef:    rbacv1.RoleRef{Kind: "ClusterRole", Name: "system:node-proxier", APIGroup: rbacv1.GroupName}}
	return []kruntime.Object{ds, sa, crb}
}

// coreDNSObjects are Talos's 11-core-dns: ServiceAccount, ClusterRole,
// ClusterRoleBinding, the Corefile and the Deployment.
func coreDNSObjects(image, domain string) []kruntime.Object {
	rbacMeta := func(name string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/bootstrapping": "rbac-defaults"}}
	}
	crbMeta := rbacMeta("system:coredns")
	crbMeta.Annotations = map[string]string{"rbac.authorization.kubernetes.io/autoupdate": "true"}
	corefile := fmt.Sprintf(".:53 {\n    errors\n    health {\n        lameduck 5s\n    }\n    ready\n    log . {\n        class error\n    }\n"+
		"    prometheus :9153\n    kubernetes %[1]s in-addr.arpa ip6.arpa {\n        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n        ttl 30\n    }\n"+
		"    forward . /etc/resolv.conf {\n       max_concurrent 1000\n    }\n    cache 30 {\n       disable success %[1]s\n       disable denial %[1]s\n    }\n"+
		"    loop\n    reload\n    loadbalance\n}\n", domain)
	sel := map[string]string{"k8s-app": "kube-dns"}
	deploy := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{Kind: "Deployment", APIVersion: "apps/v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: metav1.NamespaceSystem, Labels: map[string]string{"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(int32(2)),
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType,
				RollingUpdate: &appsv1.RollingUpdateDeployment{MaxUnavailable: ptr.To(intstr.FromInt(1))}},
			Selector: &metav1.LabelSelector{MatchLabels: sel},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: sel},
				Spec: corev1.PodSpec{
					NodeSelector:       map[string]string{"kubernetes.io/os": "linux"},
					ServiceAccountName: "coredns", PriorityClassName: "system-cluster-critical", DNSPolicy: corev1.DNSDefault,
					Tolerations: []corev1.Toleration{
						{Key: "node-role.kubernetes.io/control-plane", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
						{Key: "node.cloudprovider.kubernetes.io/uninitialized", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
					},
					Containers: []corev1.Container{{Name: "coredns", Image: image, ImagePullPolicy: corev1.PullIfNotPresent,
						Args:         []string{"-conf", "/etc/coredns/Corefile"},
						VolumeMounts: []corev1.VolumeMount{{Name: "config-volume", MountPath: "/etc/coredns", ReadOnly: true}},
						Ports: []corev1.ContainerPort{{Name: "dns", Protocol: corev1.ProtocolUDP, ContainerPort: 53},
							{Name: "dns-tcp", Protocol: corev1.ProtocolTCP, ContainerPort: 53}, {Name: "metrics", Protocol: corev1.ProtocolTCP, ContainerPort: 9153}},
					}},
					Volumes: []corev1.Volume{{Name: "config-volume", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
						LocalObjectReference: corev1.LocalObjectReference{Name: "coredns"}, Items: []corev1.KeyToPath{{Key: "Corefile", Path: "Corefile"}}}}}},
				},
			},
		},
	}
	return []kruntime.Object{
		&corev1.ServiceAccount{TypeMeta: metav1.TypeMeta{Kind: "ServiceAccount", APIVersion: "v1"},
			ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: metav1.NamespaceSystem}},
		&rbacv1.ClusterRole{TypeMeta: metav1.TypeMeta{Kind: "ClusterRole", APIVersion: "rbac.authorization.k8s.io/v1"}, ObjectMeta: rbacMeta("system:coredns"),
			Rules: []rbacv1.PolicyRule{
				{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
				{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
			}},
		&rbacv1.ClusterRoleBinding{TypeMeta: metav1.TypeMeta{Kind: "ClusterRoleBinding", APIVersion: "rbac.authorization.k8s.io/v1"}, ObjectMeta: crbMeta,
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:coredns"},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "coredns", Namespace: metav1.NamespaceSystem}}},
		&corev1.ConfigMap{TypeMeta: metav1.TypeMeta{Kind: "ConfigMap", APIVersion: "v1"},
			ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: metav1.NamespaceSystem}, Data: map[string]string{"Corefile": corefile}},
		deploy,
	}
}

// coreDNSService is Talos's 11-core-dns-svc: kube-dns at the cluster's DNS
// service IP.
func coreDNSService(ip string) kruntime.Object {
	svc := &corev1.Service{
		TypeMeta: metav1.TypeMeta{Kind: "Service", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "kube-dns", Namespace: metav1.NamespaceSystem,
			Annotations: map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "9153"},
			Labels:      map[string]string{"k8s-app": "kube-dns", "kubernetes.io/cluster-service": "true", "kubernetes.io/name": "CoreDNS"}},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"k8s-app": "kube-dns"}, ClusterIP: ip,
			Ports: []corev1.ServicePort{
				{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt(53)},
				{Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt(53)},
				{Name: "metrics", Port: 9153, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt(9153)},
			},
			IPFamilyPolicy: ptr.To(corev1.IPFamilyPolicySingleStack),
		},
	}
	if ip != "" {
		svc.Spec.ClusterIPs, svc.Spec.IPFamilies = []string{ip}, []corev1.IPFamily{corev1.IPv4Protocol}
	}
	return svc
}

// kubeProxyManifest is what Talos's ManifestApplyController does with the
// kube-proxy bootstrap manifest (10-kube-proxy) when Spec.KubeProxy is set:
// while a running control plane's configuration leaves cluster.proxy
// enabled, its DaemonSet, ServiceAccount and ClusterRoleBinding are created
// if missing (never updated, never deleted: disabling the proxy leaves
// them), annotated with the inventory and recorded in the inventory
// ConfigMap under go-kubernetes' keys. (Talos applies every bootstrap
// manifest so; the simulator applies kube-proxy's only, and leaves the
// others to a manifest sync.)
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
	if err := k.applyKubeProxy(ctx, kubeProxyObjects(cfg.Cluster().Proxy().Image(), proxyArgs(cfg.Cluster()))); err != nil {
		k.f.logf("%s: kube-proxy manifest: %v", m.Name(), err)
	}
}

func (k *kube) applyKubeProxy(ctx context.Context, objs []kruntime.Object) error {
	ns := metav1.NamespaceSystem
	keys := map[string]any{}
	for _, obj := range objs {
		o := obj.(metav1.Object)
		o.SetAnnotations(map[string]string{owningInventoryAnno: inventoryName})
		var err error
		switch obj := obj.(type) {
		case *appsv1.DaemonSet:
			_, err = k.cs.AppsV1().DaemonSets(ns).Create(ctx, obj, metav1.CreateOptions{})
			keys[ns+"_kube-proxy_apps_DaemonSet"] = ""
		case *corev1.ServiceAccount:
			_, err = k.cs.CoreV1().ServiceAccounts(ns).Create(ctx, obj, metav1.CreateOptions{})
			keys[ns+"_kube-proxy__ServiceAccount"] = ""
		case *rbacv1.ClusterRoleBinding:
			_, err = k.cs.RbacV1().ClusterRoleBindings().Create(ctx, obj, metav1.CreateOptions{})
			keys["_kube-proxy_rbac.authorization.k8s.io_ClusterRoleBinding"] = ""
		}
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
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
