package sim_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestNodes: each machine owns its Node: labels, address, Ready, the OS
// image and kubelet version it runs.
func TestNodes(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Machines[1].Talos = "v1.13.0"
	spec.Machines[1].Kubernetes = "1.36.1"
	f := start(t, spec)
	for _, m := range f.Machines() {
		n := node(t, m)
		_, cpLabel := n.Labels["node-role.kubernetes.io/control-plane"]
		if cpLabel != (m.Role() == sim.ControlPlane) || n.Labels["kubernetes.io/hostname"] != m.Name() || n.Labels[sim.FleetLabel] != spec.Name {
			t.Errorf("%s labels %v", m.Name(), n.Labels)
		}
		var internal string
		for _, a := range n.Status.Addresses {
			if a.Type == corev1.NodeInternalIP {
				internal = a.Address
			}
		}
		if internal != m.Address() || !nodeReady(n) || n.Spec.Unschedulable {
			t.Errorf("%s: InternalIP %q (want %q), ready %v, unschedulable %v", m.Name(), internal, m.Address(), nodeReady(n), n.Spec.Unschedulable)
		}
		wantOS, wantKubelet := "Talos ("+m.Version()+")", "v"+m.KubeletVersion()
		if n.Status.NodeInfo.OSImage != wantOS || n.Status.NodeInfo.KubeletVersion != wantKubelet {
			t.Errorf("%s nodeInfo %q %q, want %q %q", m.Name(), n.Status.NodeInfo.OSImage, n.Status.NodeInfo.KubeletVersion, wantOS, wantKubelet)
		}
	}
	if n := node(t, f.Machines()[1]); n.Status.NodeInfo.OSImage != "Talos (v1.13.0)" || n.Status.NodeInfo.KubeletVersion != "v1.36.1" {
		t.Errorf("worker nodeInfo %+v", n.Status.NodeInfo)
	}
}

// TestCordonRespected: a Node an operator cordoned stays cordoned through
// reboots and upgrades; the sim uncordons only what it cordoned itself.
func TestCordonRespected(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	if _, _, err := env.Kubectl(context.Background(), nil, "cordon", w.Name()); err != nil {
		t.Fatal(err)
	}
	before := w.BootID()
	if err := c.Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
	before = w.BootID()
	if _, err := c.UpgradeWithOptions(on(w), client.WithUpgradeImage("ghcr.io/siderolabs/installer:v1.13.0")); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
	waitNodeReady(t, w, true)
	if n := node(t, w); !n.Spec.Unschedulable {
		t.Fatal("the operator's cordon was lifted")
	}
}

// newPod makes a pod bound to node in ns, owned by owner (kind) if set.
func newPod(t *testing.T, ns, name, nodeName, owner string) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{
			NodeName:                     nodeName,
			AutomountServiceAccountToken: ptr.To(false),
			Containers:                   []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}},
		},
	}
	if owner != "" {
		pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: owner, Name: "owner", UID: types.UID("owner-" + name), Controller: ptr.To(true)}}
	}
	created, err := env.Kube.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s: %v", name, err)
	}
	return created
}

func namespace(t *testing.T) string {
	t.Helper()
	ns := env.Namespace(t)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := env.Kube.CoreV1().ServiceAccounts(ns).Create(context.Background(), sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	return ns
}

func waitPodGone(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "pod "+pod.Name+" removed", func(ctx context.Context) (bool, error) {
		_, err := env.Kube.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}

func podExists(t *testing.T, pod *corev1.Pod) bool {
	t.Helper()
	_, err := env.Kube.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	return err == nil
}

// TestKubeletPart: a pod deleted or evicted on a machine's Node is removed
// once its grace period ends; pods elsewhere are not the fleet's business;
// a machine that is down removes them when it is back.
func TestKubeletPart(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	ns := namespace(t)
	ctx := context.Background()

	deleted := newPod(t, ns, "deleted", w.Name(), "")
	evicted := newPod(t, ns, "evicted", w.Name(), "")
	elsewhere := newPod(t, ns, "elsewhere", "not-a-fleet-node", "")
	for _, p := range []*corev1.Pod{deleted, elsewhere} {
		if err := env.Kube.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := env.Kube.CoreV1().Pods(ns).EvictV1(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: evicted.Name}}); err != nil {
		t.Fatal(err)
	}
	waitPodGone(t, deleted)
	waitPodGone(t, evicted)
	if !podExists(t, elsewhere) {
		t.Fatal("the sim removed a pod of a Node that is not the fleet's")
	}

	// While the machine is down its pods stay terminating.
	clear := w.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	c := talos(t, f)
	before := w.BootID()
	if err := c.Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	waitNodeReady(t, w, false)
	late := newPod(t, ns, "late", w.Name(), "")
	if err := env.Kube.CoreV1().Pods(ns).Delete(ctx, late.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](1)}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the deletion seen", func(ctx context.Context) (bool, error) {
		p, err := env.Kube.CoreV1().Pods(ns).Get(ctx, late.Name, metav1.GetOptions{})
		return err == nil && p.DeletionTimestamp != nil, err
	})
	if !w.Down() || !podExists(t, late) {
		t.Fatal("a down machine removed a pod")
	}
	clear()
	waitRebooted(t, w, before)
	waitPodGone(t, late)
}

// TestDrain: the real kubectl drain finishes against a fleet (there are no
// kubelets: the machines remove the evicted pods), and Talos's own drain in
// the legacy upgrade evicts what it should and leaves the rest.
func TestDrain(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	w1, w2 := f.Machines()[1], f.Machines()[2]
	ns := namespace(t)
	var pods []*corev1.Pod
	for i := range 3 {
		pods = append(pods, newPod(t, ns, fmt.Sprintf("p%d", i), w1.Name(), "ReplicaSet"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, stderr, err := env.Kubectl(ctx, nil, "drain", w1.Name(), "--ignore-daemonsets", "--disable-eviction=false", "--timeout=50s"); err != nil {
		t.Fatalf("kubectl drain: %v: %s", err, stderr)
	}
	for _, p := range pods {
		if podExists(t, p) {
			t.Fatalf("pod %s still there after the drain", p.Name)
		}
	}

	managed := newPod(t, ns, "managed", w2.Name(), "ReplicaSet")
	daemon := newPod(t, ns, "daemon", w2.Name(), "DaemonSet")
	bare := newPod(t, ns, "bare", w2.Name(), "")
	c := talos(t, f)
	before := w2.BootID()
	if _, err := c.UpgradeWithOptions(on(w2), client.WithUpgradeImage("ghcr.io/siderolabs/installer:v1.13.0")); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w2, before)
	if podExists(t, managed) || !podExists(t, daemon) || !podExists(t, bare) {
		t.Fatalf("Talos drains managed pods only: managed %v, daemon %v, bare %v",
			podExists(t, managed), podExists(t, daemon), podExists(t, bare))
	}
	waitNodeReady(t, w2, true)
	if n := node(t, w2); n.Spec.Unschedulable || n.Annotations["talos.dev/cordoned"] != "" {
		t.Fatalf("after the upgrade the Node stays cordoned: %v %v", n.Spec.Unschedulable, n.Annotations)
	}
}
