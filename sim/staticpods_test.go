package sim_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/kubectl/pkg/util/podutils"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var components = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"}

func mirrorPods(t *testing.T, m *sim.Machine) map[string]*corev1.Pod {
	t.Helper()
	out := map[string]*corev1.Pod{}
	for _, c := range components {
		p, err := env.Kube.CoreV1().Pods(metav1.NamespaceSystem).Get(context.Background(), c+"-"+m.Name(), metav1.GetOptions{})
		if err == nil {
			out[c] = p
		}
	}
	return out
}

// TestStaticPods: each control plane has the mirror pods of Talos's
// control-plane static pods in kube-system, named, labelled and annotated
// as Talos's (the image from its configuration, the configuration
// resource's version, owned by its Node) and Ready; workers have none;
// while the machine is down they are gone, and after it boots they are
// back.
func TestStaticPods(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	cp, w := f.Machines()[0], f.Machines()[1]
	cfg := cp.Config().Cluster()
	images := map[string]string{
		"kube-apiserver": cfg.APIServer().Image(), "kube-controller-manager": cfg.ControllerManager().Image(), "kube-scheduler": cfg.Scheduler().Image(),
	}
	var pods map[string]*corev1.Pod
	testenv.Eventually(t, 30*time.Second, "the mirror pods Ready", func(context.Context) (bool, error) {
		pods = mirrorPods(t, cp)
		for _, c := range components {
			if p := pods[c]; p == nil || !podutils.IsPodReady(p) {
				return false, nil
			}
		}
		return true, nil
	})
	apiConfig, err := safe.StateGetByID[*k8s.APIServerConfig](on(cp), talos(t, f).COSI, k8s.APIServerConfigID)
	if err != nil {
		t.Fatalf("COSI APIServerConfig: %v", err)
	}
	for _, c := range components {
		p := pods[c]
		if p.Labels["k8s-app"] != c || p.Labels["tier"] != "control-plane" || p.Labels["component"] != c {
			t.Errorf("%s labels %v", p.Name, p.Labels)
		}
		if p.Annotations["talos.dev/config-version"] == "" || p.Annotations[corev1.MirrorPodAnnotationKey] == "" {
			t.Errorf("%s annotations %v", p.Name, p.Annotations)
		}
		if len(p.Spec.Containers) != 1 || p.Spec.Containers[0].Image != images[c] || !p.Spec.HostNetwork || p.Status.PodIP != cp.Address() {
			t.Errorf("%s: image %q (want %q), host network %v, pod IP %q", p.Name, p.Spec.Containers[0].Image, images[c], p.Spec.HostNetwork, p.Status.PodIP)
		}
		if ref := metav1.GetControllerOf(p); ref == nil || ref.Kind != "Node" || ref.Name != cp.Name() {
			t.Errorf("%s owner %v", p.Name, p.OwnerReferences)
		}
	}
	if v := pods["kube-apiserver"].Annotations["talos.dev/config-version"]; v != apiConfig.Metadata().Version().String() || apiConfig.TypedSpec().Image != images["kube-apiserver"] {
		t.Errorf("config-version %s, COSI APIServerConfig version %s image %s", v, apiConfig.Metadata().Version(), apiConfig.TypedSpec().Image)
	}
	if len(mirrorPods(t, w)) != 0 {
		t.Error("a worker has control-plane mirror pods")
	}

	release := cp.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	before := cp.BootID()
	if err := talos(t, f).Reboot(on(cp)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the mirror pods gone while the machine is down", func(context.Context) (bool, error) {
		return len(mirrorPods(t, cp)) == 0, nil
	})
	if !cp.Down() {
		t.Fatal("the mirror pods went while the machine was up")
	}
	release()
	waitRebooted(t, cp, before)
	testenv.Eventually(t, 30*time.Second, "new mirror pods Ready after the boot", func(context.Context) (bool, error) {
		now := mirrorPods(t, cp)
		for _, c := range components {
			if p := now[c]; p == nil || !podutils.IsPodReady(p) || p.UID == pods[c].UID {
				return false, nil
			}
		}
		return true, nil
	})
}

// TestKubeconfig: a control plane's Kubeconfig call returns an admin
// kubeconfig (a tar.gz holding "kubeconfig", machinery's client unpacks it)
// for the cluster's API server, named as Talos names it, that works; a
// worker refuses, as Talos does.
func TestKubeconfig(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.APIServer = env.Config
	f := start(t, spec)
	cp, w := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	data, err := c.Kubeconfig(on(cp))
	if err != nil {
		t.Fatal(err)
	}
	kc, err := clientcmd.Load(data)
	if err != nil {
		t.Fatal(err)
	}
	cluster := cp.Config().Cluster().Name()
	if kc.CurrentContext != "admin@"+cluster || kc.Contexts[kc.CurrentContext].Cluster != cluster || kc.Contexts[kc.CurrentContext].Namespace != "default" {
		t.Errorf("contexts %v, current %q", kc.Contexts, kc.CurrentContext)
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(data)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Nodes().Get(context.Background(), cp.Name(), metav1.GetOptions{}); err != nil {
		t.Fatalf("the kubeconfig does not reach the API server: %v", err)
	}
	if _, err := c.Kubeconfig(on(w)); err == nil || !strings.Contains(err.Error(), "only available on control plane nodes") {
		t.Fatalf("a worker's Kubeconfig: %v", err)
	}
}

// TestStaticPodsFollowTheConfig: a live change of the API server's image
// (ApplyConfiguration NO_REBOOT, as talosctl upgrade-k8s does) renders a
// new configuration version and replaces the mirror pod with one of the
// new image, annotated with that version, which becomes Ready; the other
// components' pods stay.
func TestStaticPodsFollowTheConfig(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 0))
	cp := f.Machines()[0]
	c := talos(t, f)
	var before map[string]*corev1.Pod
	testenv.Eventually(t, 30*time.Second, "the mirror pods Ready", func(context.Context) (bool, error) {
		before = mirrorPods(t, cp)
		return len(before) == 3 && podutils.IsPodReady(before["kube-apiserver"]), nil
	})
	mc, err := safe.StateGetByID[*configres.MachineConfig](on(cp), c.COSI, configres.ActiveID)
	if err != nil {
		t.Fatal(err)
	}
	const image = "registry.k8s.io/kube-apiserver:v1.35.1"
	p, err := mc.Provider().PatchV1Alpha1(func(cfg *v1alpha1.Config) error {
		cfg.ClusterConfig.APIServerConfig.ContainerImage = image
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	data, err := p.EncodeBytes()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ApplyConfiguration(on(cp), &machine.ApplyConfigurationRequest{Data: data, Mode: machine.ApplyConfigurationRequest_NO_REBOOT}); err != nil {
		t.Fatal(err)
	}
	var after map[string]*corev1.Pod
	testenv.Eventually(t, 30*time.Second, "a new kube-apiserver pod of the new image Ready", func(context.Context) (bool, error) {
		after = mirrorPods(t, cp)
		p := after["kube-apiserver"]
		return p != nil && p.UID != before["kube-apiserver"].UID && p.Spec.Containers[0].Image == image && podutils.IsPodReady(p), nil
	})
	cfg, err := safe.StateGetByID[*k8s.APIServerConfig](on(cp), c.COSI, k8s.APIServerConfigID)
	if err != nil {
		t.Fatal(err)
	}
	got, old := after["kube-apiserver"].Annotations["talos.dev/config-version"], before["kube-apiserver"].Annotations["talos.dev/config-version"]
	if got == old || got != cfg.Metadata().Version().String() || cfg.TypedSpec().Image != image {
		t.Errorf("config-version %s (was %s), COSI version %s image %s", got, old, cfg.Metadata().Version(), cfg.TypedSpec().Image)
	}
	if after["kube-scheduler"].UID != before["kube-scheduler"].UID {
		t.Error("the scheduler's pod was replaced though its image did not change")
	}
}

// TestMirrorPodsFollowTheNode: a control plane's Node made again while the
// machine runs (deleted, its mirror pods removed with it as the garbage
// collector does, then registered anew) gets the mirror pods back, owned by
// the new Node; until it exists there are none, and the fleet logs no
// failure to make them.
func TestMirrorPodsFollowTheNode(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	logs := logLines(t, &spec)
	f := start(t, spec)
	cp, w := f.Machines()[0], f.Machines()[1]
	ctx := context.Background()
	testenv.Eventually(t, 30*time.Second, "the mirror pods", func(context.Context) (bool, error) {
		return len(mirrorPods(t, cp)) == 3, nil
	})
	old := node(t, cp)
	if err := env.Kube.CoreV1().Nodes().Delete(ctx, cp.Name(), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The fleet's Node informer has seen the deletion once it has seen a
	// later change: a fault annotation on the worker's Node.
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"error:Version:Unavailable"}}}`, sim.FaultAnnotation)
	if _, err := env.Kube.CoreV1().Nodes().Patch(ctx, w.Name(), types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the worker's fault seen", func(context.Context) (bool, error) { return len(w.Faults()) == 1, nil })
	for _, p := range mirrorPods(t, cp) {
		if err := env.Kube.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
	// Likewise its pod informer has handled the deletions (and the kubelet
	// answered them) once it runs a pod created later.
	ns := namespace(t)
	createPod(t, plainPod(ns, "probe", w.Name()))
	waitPod(t, ns, "probe", "Running", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	if pods := mirrorPods(t, cp); len(pods) != 0 {
		t.Fatalf("mirror pods of a control plane without a Node: %v", pods)
	}

	created, err := env.Kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: cp.Name(), Labels: old.Labels}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "mirror pods owned by the new Node", func(context.Context) (bool, error) {
		pods := mirrorPods(t, cp)
		for _, c := range components {
			p := pods[c]
			if p == nil {
				return false, nil
			}
			if ref := metav1.GetControllerOf(p); ref == nil || ref.UID != created.UID {
				return false, nil
			}
		}
		return true, nil
	})
	if failed := logs("mirror pod"); len(failed) > 0 {
		t.Errorf("the fleet failed to make mirror pods: %q", failed)
	}
}
