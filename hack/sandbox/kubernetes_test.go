package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

// TestKubernetesEndToEnd is issue 13's done-when, in a sandbox on Talos
// v1.13.7 and Kubernetes 1.35.0 without Cilium (Ichor's table runs
// Kubernetes 1.36 only with no Cilium or Cilium 1.20, which it does not
// ship), one control plane left on Talos 1.12, through the plugin and the
// real kubectl, with the controller as its Deployment's pods and the RBAC
// of manifests/: 1.35 -> 1.37 is Refused naming 1.36; 1.36 is Refused
// while a machine runs Talos 1.12, which does not run it; once Talos has
// moved it, the upgrade to 1.36 moves each control plane's kube-apiserver,
// then kube-controller-manager, then kube-scheduler mirror pod one control
// plane at a time (the order a watch of the pods saw), kube-proxy's
// DaemonSet is rolled to the new image by the DaemonSet controller (new
// pods, from its template), and every Node's kubelet ends on 1.36.
func TestKubernetesEndToEnd(t *testing.T) {
	assets(t)
	bin := buildBinaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const behind = "sandbox-cp-3"
	sb := startInProcess(ctx, t, "--controller", filepath.Join(bin, "ichor-controller"),
		"--control-planes", "3", "--workers", "2", "--pace", "200ms", "--cilium=false",
		"--talos", "v1.13.7", "--talos-on", behind+"=v1.12.4")
	const to = "v1.36.2"

	t.Run("refused", func(t *testing.T) {
		for _, tt := range []struct {
			to   string
			want []string
		}{
			{"v1.37.1", []string{"KubernetesMinorSkip: Kubernetes v1.37.1 is 2 minors ahead of v1.35.0", "upgrade to a 1.36 release first"}},
			{to, []string{"KubernetesTalosSupported: Kubernetes " + to + " does not run on Talos v1.12.4 (on " + behind + ")", "move Talos on those machines there first"}},
		} {
			out, code := kubectlIchor(ctx, t, sb, bin, "upgrade", "kubernetes", "--to", tt.to)
			if code != 2 || !strings.Contains(out, "was refused by preflight, nothing ran") {
				t.Errorf("upgrade kubernetes --to %s: exit %d, want 2 and a refusal", tt.to, code)
			}
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("upgrade kubernetes --to %s does not say %q", tt.to, w)
				}
			}
		}
	})

	mustIchor(ctx, t, sb, bin, "upgrade", "talos", "--to", "v1.13.7", "--name", "talos-1", "--watch")

	t.Run("to 1.36", func(t *testing.T) {
		kube, err := kubernetes.NewForConfig(sb.Admin)
		if err != nil {
			t.Fatal(err)
		}
		var before []types.UID
		for _, p := range kubeProxyPods(ctx, t, sb) {
			before = append(before, p.UID)
		}
		moves := watchMirrorPods(ctx, t, kube, to)
		mustIchor(ctx, t, sb, bin, "upgrade", "kubernetes", "--to", to, "--name", "k8s-1", "--watch")
		waitOp(t, sb, "k8s-1", "to have succeeded", (*ichorv1.TalosOperation).Succeeded)

		var cps []string
		for _, m := range sb.Fleet.ControlPlanes() {
			cps = append(cps, m.Name())
		}
		log, ended := moves()
		checkOneAtATime(t, log, ended, cps)

		ds := &appsv1.DaemonSet{}
		if err := sb.Client.Get(ctx, client.ObjectKey{Namespace: "kube-system", Name: "kube-proxy"}, ds); err != nil {
			t.Fatal(err)
		}
		n := int32(len(sb.Fleet.Machines()))
		if ds.Status.ObservedGeneration != ds.Generation || ds.Status.UpdatedNumberScheduled != n || ds.Status.NumberAvailable != n {
			t.Errorf("kube-proxy's DaemonSet: generation %d, observed %d, %d updated, %d available; want all %d", ds.Generation,
				ds.Status.ObservedGeneration, ds.Status.UpdatedNumberScheduled, ds.Status.NumberAvailable, n)
		}
		after := kubeProxyPods(ctx, t, sb)
		if len(after) != int(n) {
			t.Errorf("%d kube-proxy pods, want one on each of the %d machines", len(after), n)
		}
		for _, p := range after {
			owner := metav1.GetControllerOf(&p)
			if owner == nil || owner.UID != ds.UID || p.Spec.Containers[0].Image != "registry.k8s.io/kube-proxy:"+to || !podReady(&p) {
				t.Errorf("kube-proxy pod %s on %s: owner %v, image %s, ready %v", p.Name, p.Spec.NodeName, owner, p.Spec.Containers[0].Image, podReady(&p))
			}
			if slices.Contains(before, p.UID) {
				t.Errorf("kube-proxy pod %s is one from before the upgrade: the DaemonSet controller did not replace it", p.Name)
			}
		}
		var nodes corev1.NodeList
		if err := sb.Client.List(ctx, &nodes); err != nil {
			t.Fatal(err)
		}
		for _, node := range nodes.Items {
			if v := node.Status.NodeInfo.KubeletVersion; v != to || !nodeReady(&node) {
				t.Errorf("Node %s: kubelet %s, Ready %v; want %s", node.Name, v, nodeReady(&node), to)
			}
		}
	})
}

// kubeProxyPods are kube-proxy's pods, as listed now.
func kubeProxyPods(ctx context.Context, t *testing.T, sb *Sandbox) []corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	if err := sb.Client.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-proxy"}); err != nil {
		t.Fatal(err)
	}
	return pods.Items
}

// watchMirrorPods watches kube-system's pods from now on and records, in
// the order the API server told them, when each control plane's mirror pod
// of each component first ran the image at version to ("moved COMPONENT
// MACHINE") and when it first was Ready on it ("ready ..."). The returned
// function says what it has recorded, and whether the watch ended early.
func watchMirrorPods(ctx context.Context, t *testing.T, kube kubernetes.Interface, to string) func() ([]string, bool) {
	t.Helper()
	pods := kube.CoreV1().Pods("kube-system")
	list, err := pods.List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		log     []string
		stopped bool
		ended   bool
	)
	seen := map[string]bool{}
	record := func(what string) {
		if !seen[what] {
			seen[what] = true
			log = append(log, what)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			for _, component := range mirrorComponents {
				if p.Name != component+"-"+p.Spec.NodeName || p.Spec.Containers[0].Image != "registry.k8s.io/"+component+":"+to {
					continue
				}
				mu.Lock()
				record("moved " + component + " " + p.Spec.NodeName)
				if podReady(p) {
					record("ready " + component + " " + p.Spec.NodeName)
				}
				mu.Unlock()
			}
		}
		mu.Lock()
		ended = !stopped
		mu.Unlock()
	}()
	t.Cleanup(func() {
		mu.Lock()
		stopped = true
		mu.Unlock()
		w.Stop()
		<-done
	})
	return func() ([]string, bool) {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(log), ended
	}
}

// mirrorComponents are the control-plane components, in the order the
// upgrade moves them.
var mirrorComponents = []string{executor.StageAPIServer, executor.StageControllerManager, executor.StageScheduler}

// checkOneAtATime checks what watchMirrorPods saw: each component in turn,
// and within it one control plane after the other, each Ready on the new
// version before the next one moved.
func checkOneAtATime(t *testing.T, log []string, ended bool, cps []string) {
	t.Helper()
	if ended {
		t.Errorf("the watch of kube-system's pods ended early")
	}
	if len(log) != 2*len(mirrorComponents)*len(cps) {
		t.Errorf("the watch saw %d moves, want each of %d components moved and Ready on %d control planes:\n%s", len(log),
			len(mirrorComponents), len(cps), strings.Join(log, "\n"))
		return
	}
	i := 0
	for _, component := range mirrorComponents {
		var order []string
		for range cps {
			moved, ready := log[i], log[i+1]
			i += 2
			m, ok := strings.CutPrefix(moved, "moved "+component+" ")
			if !ok || ready != "ready "+component+" "+m || !slices.Contains(cps, m) || slices.Contains(order, m) {
				t.Errorf("not one control plane at a time, component after component: %q then %q; the watch saw:\n%s", moved, ready, strings.Join(log, "\n"))
				return
			}
			order = append(order, m)
		}
		t.Logf("%s moved on %s, one after the other", component, strings.Join(order, ", "))
	}
}

// kubectlIchor runs `kubectl ichor args...` with the real kubectl against
// the sandbox, the plugin in bin first on PATH, and returns what it printed
// and its exit code.
func kubectlIchor(ctx context.Context, t *testing.T, sb *Sandbox, bin string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.CommandContext(ctx, sb.cfg.Kubectl, append([]string{"ichor"}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+sb.Path(fileKubeconfig), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"), "NO_COLOR=1")
	out, err := cmd.CombinedOutput()
	t.Logf("$ kubectl ichor %s\n%s", strings.Join(args, " "), out)
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("kubectl ichor %s: %v", strings.Join(args, " "), err)
	}
	return string(out), cmd.ProcessState.ExitCode()
}

// mustIchor is kubectlIchor that must exit 0.
func mustIchor(ctx context.Context, t *testing.T, sb *Sandbox, bin string, args ...string) string {
	t.Helper()
	out, code := kubectlIchor(ctx, t, sb, bin, args...)
	if code != 0 {
		t.Fatalf("kubectl ichor %s: exit %d", strings.Join(args, " "), code)
	}
	return out
}
