package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/resource/meta"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// staticPod is one control-plane component that Talos runs as a static pod
// on every control plane, with the COSI resource its configuration is
// rendered into (whose version is the pod's talos.dev/config-version).
type staticPod struct {
	id       string
	image    func(config.Provider) string
	resource func(image string) resource.Resource
}

// staticPodComponents are Talos's control-plane static pods, in the order
// Talos renders them.
var staticPodComponents = []staticPod{
	{k8s.APIServerID, func(c config.Provider) string { return c.Cluster().APIServer().Image() }, func(image string) resource.Resource {
		r := k8s.NewAPIServerConfig()
		r.TypedSpec().Image = image
		return r
	}},
	{k8s.ControllerManagerID, func(c config.Provider) string { return c.Cluster().ControllerManager().Image() }, func(image string) resource.Resource {
		r := k8s.NewControllerManagerConfig()
		r.TypedSpec().Enabled, r.TypedSpec().Image = true, image
		return r
	}},
	{k8s.SchedulerID, func(c config.Provider) string { return c.Cluster().Scheduler().Image() }, func(image string) resource.Resource {
		r := k8s.NewSchedulerConfig()
		r.TypedSpec().Enabled, r.TypedSpec().Image = true, image
		return r
	}},
}

// The control planes serve their components' configuration resources
// (namespace controlplane) through COSI, as Talos does.
func init() {
	for _, c := range staticPodComponents {
		r := c.resource("")
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

// mirrorPod is the mirror pod of one component of a control plane, as
// Talos renders the static pod (labels, annotations, priority, host
// network) and the kubelet mirrors it (config annotations, owned by the
// Node).
func (k *kube) mirrorPod(m *Machine, c staticPod, node types.UID) *corev1.Pod {
	image := c.image(m.Config())
	version := m.staticPodVersion(c, image)
	sum := sha256.Sum256([]byte(c.id + "|" + image + "|" + version))
	hash := hex.EncodeToString(sum[:16])
	yes := true
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      c.id + "-" + m.Name(),
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
				constants.AnnotationStaticPodSecretsVersion: "1",
				constants.AnnotationStaticPodConfigVersion:  version,
				"kubernetes.io/config.hash":                 hash,
				corev1.MirrorPodAnnotationKey:               hash,
				"kubernetes.io/config.seen":                 time.Now().UTC().Format(time.RFC3339Nano),
				"kubernetes.io/config.source":               "file",
			},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: m.Name(), UID: node, Controller: &yes}},
		},
		Spec: corev1.PodSpec{
			NodeName:          m.Name(),
			HostNetwork:       true,
			PriorityClassName: "system-cluster-critical",
			Containers:        []corev1.Container{{Name: c.id, Image: image, Command: []string{"/usr/local/bin/" + c.id}}},
			Tolerations:       []corev1.Toleration{{Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute}},
		},
	}
}

// staticPodVersion is the version of the component's configuration
// resource, rendered anew (a new version) when its image changed.
func (m *Machine) staticPodVersion(c staticPod, image string) string {
	want := c.resource(image)
	cur, err := m.cosi.Get(context.Background(), want.Metadata())
	if err == nil && resourceImage(cur) == image {
		return cur.Metadata().Version().String()
	}
	m.put(want)
	if cur, err = m.cosi.Get(context.Background(), want.Metadata()); err != nil {
		return "1"
	}
	return cur.Metadata().Version().String()
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
