package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/resource/meta"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/config"
	talosconfig "github.com/siderolabs/talos/pkg/machinery/config/config"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
)

// staticPod is one control-plane component that Talos runs as a static pod
// on every control plane, with the COSI resource its configuration is
// rendered into (whose version is the pod's talos.dev/config-version).
type staticPod struct {
	id string
	// config is the component's configuration resource, rendered from the
	// machine configuration (its image and extraArgs).
	config func(talosconfig.ClusterConfig) resource.Resource
	// args are those Talos sets itself; extraArgs are merged over them.
	args map[string][]string
}

// staticPodComponents are Talos's control-plane static pods, in the order
// Talos renders them.
var staticPodComponents = []staticPod{
	{k8s.APIServerID, func(c talosconfig.ClusterConfig) resource.Resource {
		r := k8s.NewAPIServerConfig()
		r.TypedSpec().Image, r.TypedSpec().ExtraArgs = c.APIServer().Image(), argValues(c.APIServer().ExtraArgs())
		return r
	}, withFlags(map[string][]string{
		"allow-privileged": {"true"}, "anonymous-auth": {"false"}, "enable-admission-plugins": {"NodeRestriction"},
		"authorization-config": {"/system/config/kubernetes/kube-apiserver/authorization-config.yaml"},
	}, apiServerFlags(constants.KubernetesAPIServerSecretsDir))},
	{k8s.ControllerManagerID, func(c talosconfig.ClusterConfig) resource.Resource {
		r := k8s.NewControllerManagerConfig()
		r.TypedSpec().Enabled, r.TypedSpec().Image = true, c.ControllerManager().Image()
		r.TypedSpec().ExtraArgs = argValues(c.ControllerManager().ExtraArgs())
		return r
	}, map[string][]string{
		"allocate-node-cidrs": {"true"}, "controllers": {"*", "tokencleaner"}, "use-service-account-credentials": {"true"},
		"root-ca-file":                     {constants.KubernetesControllerManagerSecretsDir + "/ca.crt"},
		"service-account-private-key-file": {constants.KubernetesControllerManagerSecretsDir + "/service-account.key"},
	}},
	{k8s.SchedulerID, func(c talosconfig.ClusterConfig) resource.Resource {
		r := k8s.NewSchedulerConfig()
		r.TypedSpec().Enabled, r.TypedSpec().Image = true, c.Scheduler().Image()
		r.TypedSpec().ExtraArgs = argValues(c.Scheduler().ExtraArgs())
		return r
	}, map[string][]string{
		"config": {"/system/config/kubernetes/kube-scheduler/scheduler-config.yaml"},
	}},
}

// withFlags is base with flags added.
func withFlags(base, flags map[string][]string) map[string][]string {
	maps.Copy(base, flags)
	return base
}

func argValues(in map[string][]string) map[string]k8s.ArgValues {
	out := make(map[string]k8s.ArgValues, len(in))
	for k, v := range in {
		out[k] = k8s.ArgValues{Values: v}
	}
	return out
}

// additiveArgs are the flags whose extraArgs Talos adds to its own values
// (argsbuilder.MergeAdditive) instead of replacing them.
var additiveArgs = map[string]bool{
	"enable-admission-plugins": true, "feature-gates": true, "authorization-mode": true,
	"tls-cipher-suites": true, "controllers": true, "service-cluster-ip-range": true,
}

// renderArgs is Talos's argsbuilder: base merged with extra (additive
// flags joined by commas), one --flag=value per value, flags sorted.
func renderArgs(base map[string][]string, extra map[string]k8s.ArgValues) []string {
	merged := map[string][]string{}
	for k, v := range base {
		merged[k] = []string{strings.Join(v, ",")}
	}
	for k, v := range extra {
		if cur, ok := merged[k]; ok && additiveArgs[k] {
			merged[k] = []string{strings.Join(append(cur, v.Values...), ",")}
			continue
		}
		merged[k] = v.Values
	}
	keys := slices.Sorted(maps.Keys(merged))
	var out []string
	for _, k := range keys {
		for _, v := range merged[k] {
			out = append(out, "--"+k+"="+v)
		}
	}
	return out
}

// The control planes serve their components' configuration resources
// (namespace controlplane), their StaticPods and KubeletSpec (namespace
// k8s) and the bootstrap Manifests (namespace controlplane) through COSI,
// as Talos does.
func init() {
	for _, r := range []resource.Resource{
		k8s.NewAPIServerConfig(), k8s.NewControllerManagerConfig(), k8s.NewSchedulerConfig(),
		k8s.NewStaticPod(k8s.NamespaceName, ""), k8s.NewKubeletSpec(k8s.NamespaceName, k8s.KubeletID),
		k8s.NewManifest(k8s.ControlPlaneNamespaceName, ""),
	} {
		rd := r.(meta.ResourceDefinitionProvider).ResourceDefinition()
		cosiTypes[r.Metadata().Type()] = rd.Sensitivity == meta.Sensitive
	}
	cosiNamespaces[k8s.ControlPlaneNamespaceName] = true
}

// staticPods makes a control plane's mirror pods in kube-system match the
// machine, as its kubelet mirrors the static pods Talos renders: while it
// runs, one per component (named <component>-<node>, labelled and
// annotated as Talos's, the image from the active configuration); while
// it is down, none (Talos tears them down with etcd). A changed image
// renders a new configuration version and the kubelet replaces the pod.
//
// As the kubelet's mirror client, it makes no mirror pod before it knows
// its Node's UID (the pods' owner): a Node created after the machine
// started gets them when the fleet's Node informer sees it (nodeAdded).
func (k *kube) staticPods(m *Machine, up bool) {
	if k == nil || m.spec.Role != ControlPlane {
		return
	}
	uid := k.nodeUID(m)
	if up && uid == "" {
		return
	}
	ctx, cancel := k.ctx()
	defer cancel()
	pods := k.cs.CoreV1().Pods(metav1.NamespaceSystem)
	for _, c := range staticPodComponents {
		name := c.id + "-" + m.Name()
		cur, err := pods.Get(ctx, name, metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			k.f.logf("%s: mirror pod %s: %v", m.Name(), name, err)
			continue
		}
		var want *corev1.Pod
		if up {
			want = k.mirrorPod(m, c, uid)
		}
		if cur != nil && err == nil && (want == nil || stale(cur, want)) {
			zero := int64(0)
			if err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &cur.UID}}); err != nil && !apierrors.IsNotFound(err) {
				k.f.logf("%s: remove mirror pod %s: %v", m.Name(), name, err)
				continue
			}
			if want != nil {
				k.waitGone(ctx, name, cur)
			}
			cur = nil
		}
		if want != nil && (cur == nil || err != nil) {
			if _, err := pods.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				k.f.logf("%s: create mirror pod %s: %v", m.Name(), name, err)
			}
		}
	}
}

// stale reports whether a mirror pod is not the one wanted: another static
// pod (its hash), or owned by an earlier Node of the same name (which the
// garbage collector removes).
func stale(cur, want *corev1.Pod) bool {
	if cur.Annotations[corev1.MirrorPodAnnotationKey] != want.Annotations[corev1.MirrorPodAnnotationKey] {
		return true
	}
	ref := metav1.GetControllerOf(cur)
	return ref == nil || ref.UID != want.OwnerReferences[0].UID
}

// waitGone waits (briefly) until a deleted mirror pod has left the API
// server, so that its successor of the same name can be created.
func (k *kube) waitGone(ctx context.Context, name string, old *corev1.Pod) {
	for range 50 {
		p, err := k.cs.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && p.UID != old.UID) {
			return
		}
		if sleep(ctx, 20*time.Millisecond) != nil {
			return
		}
	}
}

// mirrorPod is the mirror pod of one component of a control plane: the
// static pod Talos rendered (renderStaticPod) as the kubelet mirrors it
// (config annotations, owned by the Node, NoExecute tolerated).
func (k *kube) mirrorPod(m *Machine, c staticPod, node types.UID) *corev1.Pod {
	pod := m.renderStaticPod(c)
	if pod == nil {
		return nil
	}
	image := pod.Spec.Containers[0].Image
	sum := sha256.Sum256([]byte(c.id + "|" + image + "|" + pod.Annotations[constants.AnnotationStaticPodConfigVersion] +
		"|" + pod.Annotations[constants.AnnotationStaticPodSecretsVersion]))
	hash := hex.EncodeToString(sum[:16])
	yes := true
	pod.TypeMeta = metav1.TypeMeta{}
	pod.Name = c.id + "-" + m.Name()
	pod.Annotations["kubernetes.io/config.hash"] = hash
	pod.Annotations[corev1.MirrorPodAnnotationKey] = hash
	pod.Annotations["kubernetes.io/config.seen"] = time.Now().UTC().Format(time.RFC3339Nano)
	pod.Annotations["kubernetes.io/config.source"] = "file"
	pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: m.Name(), UID: node, Controller: &yes}}
	pod.Spec.NodeName = m.Name()
	pod.Spec.Tolerations = []corev1.Toleration{{Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute}}
	return pod
}

// renderStaticPods renders every component of a control plane (Talos's
// control-plane controllers do so as its configuration changes).
func (m *Machine) renderStaticPods() {
	if m.spec.Role != ControlPlane {
		return
	}
	for _, c := range staticPodComponents {
		m.renderStaticPod(c)
	}
}

// renderStaticPod is what Talos's ControlPlaneStaticPodController does for
// one component: its configuration resource follows the active
// configuration (a new version when the image or extraArgs changed), and
// the StaticPod resource (namespace k8s, ID the component) is the pod
// rendered from it, annotated with that version. It returns the pod, nil
// if the machine has no cluster configuration.
func (m *Machine) renderStaticPod(c staticPod) *corev1.Pod {
	cfg := m.Config()
	if cfg == nil || cfg.Cluster() == nil {
		return nil
	}
	m.renderMu.Lock()
	defer m.renderMu.Unlock()
	ctx := context.Background()
	want := c.config(cfg.Cluster())
	cur, err := m.cosi.Get(ctx, want.Metadata())
	if err != nil || !reflect.DeepEqual(cur.Spec(), want.Spec()) {
		m.put(want)
		if cur, err = m.cosi.Get(ctx, want.Metadata()); err != nil {
			return nil
		}
	}
	pod := staticPodOf(c, cur, m.secretsVersion(cfg))
	sp, err := safe.StateGetByID[*k8s.StaticPod](ctx, m.cosi, c.id)
	if err == nil && sp.TypedSpec().Pod != nil {
		if prev, ok := sp.TypedSpec().Pod["metadata"].(map[string]any); ok {
			if ann, ok := prev["annotations"].(map[string]any); ok &&
				ann[constants.AnnotationStaticPodConfigVersion] == pod.Annotations[constants.AnnotationStaticPodConfigVersion] &&
				ann[constants.AnnotationStaticPodSecretsVersion] == pod.Annotations[constants.AnnotationStaticPodSecretsVersion] {
				return pod
			}
		}
	}
	obj, err := kruntime.DefaultUnstructuredConverter.ToUnstructured(pod)
	if err != nil {
		m.f.logf("%s: render static pod %s: %v", m.Name(), c.id, err)
		return pod
	}
	res := k8s.NewStaticPod(k8s.NamespaceName, c.id)
	res.TypedSpec().Pod = obj
	m.put(res)
	return pod
}

// secretsVersion is the version of the secrets the machine's static pods
// are rendered with (Talos's SecretsStatus, talos.dev/secrets-version): one
// more each time the Kubernetes secrets of its configuration change (the
// CAs, the service-account key, the encryption secrets). The caller holds
// renderMu.
func (m *Machine) secretsVersion(cfg config.Provider) string {
	key := ""
	if in, err := apiServerInputs(cfg); err == nil {
		key = in.key
	}
	if m.secretsVer == 0 || key != m.secretsKey {
		m.secretsVer++
		m.secretsKey = key
	}
	return strconv.Itoa(m.secretsVer)
}

// staticPodOf is the static pod Talos renders from a component's
// configuration resource: labelled and annotated as Talos's, the command
// its flags merged with extraArgs.
func staticPodOf(c staticPod, cfg resource.Resource, secretsVersion string) *corev1.Pod {
	image, extra := resourceImage(cfg), resourceArgs(cfg)
	return &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{
			Name:      c.id,
			Namespace: metav1.NamespaceSystem,
			Labels: map[string]string{
				"tier":                         "control-plane",
				"k8s-app":                      c.id,
				"component":                    c.id,
				"app.kubernetes.io/name":       c.id,
				"app.kubernetes.io/version":    strings.TrimPrefix(imageTag(image), "v"),
				"app.kubernetes.io/component":  "control-plane",
				"app.kubernetes.io/managed-by": "Talos",
			},
			Annotations: map[string]string{
				constants.AnnotationStaticPodSecretsVersion: secretsVersion,
				constants.AnnotationStaticPodConfigVersion:  cfg.Metadata().Version().String(),
			},
		},
		Spec: corev1.PodSpec{
			HostNetwork:       true,
			PriorityClassName: "system-cluster-critical",
			Containers: []corev1.Container{{Name: c.id, Image: image,
				Command: append([]string{"/usr/local/bin/" + c.id}, renderArgs(c.args, extra)...)}},
		},
	}
}

func resourceImage(r resource.Resource) string {
	switch r := r.(type) {
	case *k8s.APIServerConfig:
		return r.TypedSpec().Image
	case *k8s.ControllerManagerConfig:
		return r.TypedSpec().Image
	case *k8s.SchedulerConfig:
		return r.TypedSpec().Image
	}
	return ""
}

func resourceArgs(r resource.Resource) map[string]k8s.ArgValues {
	switch r := r.(type) {
	case *k8s.APIServerConfig:
		return r.TypedSpec().ExtraArgs
	case *k8s.ControllerManagerConfig:
		return r.TypedSpec().ExtraArgs
	case *k8s.SchedulerConfig:
		return r.TypedSpec().ExtraArgs
	}
	return nil
}
