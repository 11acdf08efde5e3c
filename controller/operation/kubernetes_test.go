package operation_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/kubectl/pkg/util/podutils"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/constants"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestKubernetesStages: a Kubernetes upgrade pulls the new images, then
// moves every control plane's kube-apiserver, then kube-controller-manager,
// then kube-scheduler mirror pod to the new image and configuration
// version, then cluster.proxy.image on every control plane, then syncs the
// bootstrap manifests (kube-proxy's DaemonSet rolled to the new image by
// the real DaemonSet controller), then every kubelet, through a controller
// killed after the pre-pull and each image patch on cp-2 (one in every
// machine stage) and on w-1, and after the sync, before status records
// them: each image is applied once per machine, live, the
// sync run again changes nothing, and every machine ends on the new
// versions.
func TestKubernetesStages(t *testing.T) {
	spec := sim.Cluster("", 2, 2)
	spec.KubeProxy = true
	c := newCluster(t, spec)
	t.Cleanup(func() { removeBootstrapManifests(t) })
	waitKubeProxy(t, "registry.k8s.io/kube-proxy:v1.35.0", 4)
	const to = "v1.35.1"
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}, MaxUnavailable: 2})
	cp2, w1 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	var mu sync.Mutex
	runs, kills, syncs := map[string]int{}, 0, 0
	var op *ichorv1.TalosOperation
	for restarts := 0; op == nil; restarts++ {
		if restarts > 11 {
			t.Fatal("still not done after 11 controllers")
		}
		var ctl atomic.Pointer[testcluster.Controller]
		gone := make(chan struct{})
		kill := func() {
			kills++
			ctl.Load().Kill()
			close(gone)
		}
		// The odd runs are the first of a stage, the even ones their reruns.
		hook := func(s operation.StepRun) {
			mu.Lock()
			defer mu.Unlock()
			if s.Err != nil {
				return
			}
			if s.Step == executor.StepSyncManifests {
				if syncs++; syncs == 1 {
					kill()
				}
			}
			if (s.Step != executor.StepPatchImage && s.Step != executor.StepPullImages) || (s.Machine != cp2 && s.Machine != w1) {
				return
			}
			key := s.Machine + "/" + s.Step
			if runs[key]++; runs[key]%2 == 1 {
				kill()
			}
		}
		o := app.Options{Namespace: c.ctrlNS, TestHookAfterRun: hook}
		ctl.Store(testcluster.StartKillable(t, env.Config, o))
		testenv.Eventually(t, 2*time.Minute, "the controller killed after a patch or the sync, or the operation done", func(ctx context.Context) (bool, error) {
			select {
			case <-gone:
				return true, nil
			default:
			}
			got := c.get("k8s")
			if got.Failed() {
				t.Fatalf("failed: %s: %s", got.Status.FailureReason, got.Status.Message)
			}
			if got.Succeeded() {
				op = got
			}
			return op != nil, nil
		})
		ctl.Load().Stop()
	}
	if kills != 9 {
		t.Errorf("%d kills, want 9: the pre-pull and five machine stages on %s, the pre-pull and one on %s, one after the sync", kills, cp2, w1)
	}
	if syncs != 2 {
		t.Errorf("the manifests were synced %d times, want twice (once more after the kill)", syncs)
	}

	for i, s := range op.Status.Stages {
		if s.FinishedAt == nil || i > 0 && s.StartedAt.Before(op.Status.Stages[i-1].FinishedAt) {
			t.Errorf("stage %s ran %v to %v, the one before ended %v", s.Name, s.StartedAt, s.FinishedAt, op.Status.Stages[max(i-1, 0)].FinishedAt)
		}
	}
	// Generation 2: the sim's creation, then the sync's new image; the
	// sync run again changed nothing.
	checkKubeProxyRolled(t, "registry.k8s.io/kube-proxy:"+to, 4, 2)
	rec := c.fleet.Recorder()
	for _, m := range c.fleet.Machines() {
		want := 1
		if m.Role() == sim.ControlPlane {
			want = 5
			for _, component := range []string{executor.StageAPIServer, executor.StageControllerManager, executor.StageScheduler} {
				p := &corev1.Pod{}
				if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: "kube-system", Name: component + "-" + m.Name()}, p); err != nil {
					t.Fatal(err)
				}
				if img := p.Spec.Containers[0].Image; img != "registry.k8s.io/"+component+":"+to || p.Annotations[constants.AnnotationStaticPodConfigVersion] == "1" {
					t.Errorf("%s: mirror pod %s runs %s at configuration version %s", m.Name(), component, img, p.Annotations[constants.AnnotationStaticPodConfigVersion])
				}
			}
			if img := m.Config().Cluster().Proxy().Image(); img != "registry.k8s.io/kube-proxy:"+to {
				t.Errorf("%s: cluster.proxy.image %s", m.Name(), img)
			}
		}
		if n := rec.Calls(m.Name(), "MachineService/ApplyConfiguration"); n != want {
			t.Errorf("%s: %d configurations applied, want %d", m.Name(), n, want)
		}
		if got := c.node(m.Name()).Status.NodeInfo.KubeletVersion; got != to {
			t.Errorf("%s: kubelet %s, want %s", m.Name(), got, to)
		}
	}
}

// TestKubeProxyStageFaultAndRetry: the control plane that syncs the
// bootstrap manifests refuses to list them (COSI): the operation pauses in
// the bootstrap-manifests stage with the reason, the control-plane and
// kube-proxy stages finished and untouched; once the fault is cleared a
// retry resumes there, each control plane's images applied exactly once.
func TestKubeProxyStageFaultAndRetry(t *testing.T) {
	spec := sim.Cluster("", 2, 1)
	spec.KubeProxy = true
	c := newCluster(t, spec)
	t.Cleanup(func() { removeBootstrapManifests(t) })
	waitKubeProxy(t, "registry.k8s.io/kube-proxy:v1.35.0", 3)
	cp1 := c.fleet.Machines()[0]
	var mu sync.Mutex
	patches := map[string]int{}
	// kubelets is kube-proxy's DaemonSet when the kubelet stage patched its
	// first machine: the rollout was waited for before.
	var kubelets *appsv1.DaemonSet
	o := app.Options{Namespace: c.ctrlNS, TestHookAfterRun: func(s operation.StepRun) {
		mu.Lock()
		defer mu.Unlock()
		if s.Step != executor.StepPatchImage || s.Err != nil {
			return
		}
		if patches[s.Machine]++; patches[s.Machine] == 5 && kubelets == nil {
			kubelets = &appsv1.DaemonSet{}
			if err := env.Client.Get(context.Background(), keyOf("kube-system", "kube-proxy"), kubelets); err != nil {
				t.Error(err)
			}
		}
	}}
	testcluster.StartController(t, env.Config, o)
	const to = "v1.35.1"
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}})
	// The fault comes once preflight, which reads the manifests too, passed.
	c.waitFor("k8s", "to pass preflight", time.Minute, func(op *ichorv1.TalosOperation) bool { return op.Status.Stage != "" })
	cp1.Inject(sim.Fault{Kind: sim.FaultError, Method: "State/List", Code: codes.PermissionDenied})

	op := c.waitFor("k8s", "to fail", 2*time.Minute, (*ichorv1.TalosOperation).StepFailed)
	failed := op.Status.FailedMachine()
	if op.Status.Stage != executor.StageManifests || op.Status.Phase != ichorv1.PhasePaused || op.Status.FailureReason != "ManifestsNotRead" ||
		failed == nil || failed.Name != cp1.Name() || failed.Step != executor.StepManifestsRendered || !strings.Contains(failed.Message, "PermissionDenied") {
		t.Fatalf("stage %s phase %s failureReason %q, failed machine %+v", op.Status.Stage, op.Status.Phase, op.Status.FailureReason, failed)
	}
	// Every stage before bootstrap-manifests: the pre-pull, the three
	// control-plane components and kube-proxy.
	before := op.Status.Stages[:slices.IndexFunc(op.Status.Stages, func(s ichorv1.StageStatus) bool { return s.Name == executor.StageManifests })]
	if len(before) != 5 {
		t.Fatalf("%d stages before %s, want 5", len(before), executor.StageManifests)
	}
	finished := map[string]metav1.Time{}
	for _, s := range before {
		if s.FinishedAt == nil {
			t.Fatalf("stage %s has not finished before the failure", s.Name)
		}
		finished[s.Name] = *s.FinishedAt
	}

	cp1.ClearFaults()
	c.kubectl("annotate", "talosoperation", "k8s", ichorv1.RetryAnnotation+"=true")
	op = c.waitSucceeded("k8s", 2*time.Minute)
	for _, s := range op.Status.Stages[:len(before)] {
		if s.FinishedAt == nil || !s.FinishedAt.Equal(ptr.To(finished[s.Name])) {
			t.Errorf("stage %s finished at %v after the retry, %v before", s.Name, s.FinishedAt, finished[s.Name])
		}
	}
	checkKubeProxyRolled(t, "registry.k8s.io/kube-proxy:"+to, 3, 2)
	mu.Lock()
	defer mu.Unlock()
	if kubelets == nil {
		t.Error("the kubelet stage patched no control plane")
	} else if st := kubelets.Status; st.ObservedGeneration != 2 || st.UpdatedNumberScheduled != 3 || st.NumberAvailable != 3 {
		t.Errorf("kube-proxy when the kubelet stage began: generation %d, %d updated, %d available; want generation 2 rolled out to 3 nodes",
			st.ObservedGeneration, st.UpdatedNumberScheduled, st.NumberAvailable)
	}
	rec := c.fleet.Recorder()
	for _, m := range c.fleet.Machines() {
		// apiserver, controller-manager, scheduler, kube-proxy, kubelet.
		want := 5
		if m.Role() == sim.Worker {
			want = 1
		}
		if n := rec.Calls(m.Name(), "MachineService/ApplyConfiguration"); n != want || patches[m.Name()] != want {
			t.Errorf("%s: %d configurations applied in %d image patches, want %d", m.Name(), n, patches[m.Name()], want)
		}
	}
}

// TestKubeProxyDisabled: with cluster.proxy.disabled on the control planes
// the kube-proxy stage patches nothing and the manifest sync does not run
// (it would prune what Talos applied for kube-proxy), each saying why; the
// other stages move as usual.
func TestKubeProxyDisabled(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	t.Cleanup(func() { removeBootstrapManifests(t) })
	cp := c.fleet.Machines()[0]
	applyNoReboot(t, c.fleet, cp, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ProxyConfig = &v1alpha1.ProxyConfig{Disabled: ptr.To(true)}
	})
	o := app.Options{Namespace: c.ctrlNS}
	testcluster.StartController(t, env.Config, o)
	// Every status written, not a poll's samples: a stage of one machine
	// can begin and end between two polls.
	w := watchOps(t, c.ns)
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.35.1"}})
	var messages []string
	w.until(t, "k8s", 2*time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Failed() {
			t.Fatalf("failed: %s: %s", op.Status.FailureReason, op.Status.Message)
		}
		if op.Status.Stage == executor.StageKubeProxy || op.Status.Stage == executor.StageManifests {
			if m := entryOf(op, cp.Name()); m.Phase == ichorv1.MachineSucceeded && !slices.Contains(messages, op.Status.Stage+": "+m.Message) {
				messages = append(messages, op.Status.Stage+": "+m.Message)
			}
		}
		return op.Status.Stage == executor.StageKubelet || op.Succeeded()
	})
	c.waitSucceeded("k8s", 2*time.Minute)
	for _, stage := range []string{executor.StageKubeProxy, executor.StageManifests} {
		if want := stage + ": kube-proxy is disabled (cluster.proxy.disabled): nothing to upgrade"; !slices.Contains(messages, want) {
			t.Errorf("no %q among the messages seen: %q", want, messages)
		}
	}
	// The test's disabling, apiserver, controller-manager, scheduler, kubelet.
	if n := c.fleet.Recorder().Calls(cp.Name(), "MachineService/ApplyConfiguration"); n != 5 {
		t.Errorf("%s: %d configurations applied, want 5", cp.Name(), n)
	}
	if err := env.Client.Get(context.Background(), keyOf("kube-system", "kube-proxy"), &appsv1.DaemonSet{}); !apierrors.IsNotFound(err) {
		t.Errorf("kube-proxy's DaemonSet exists (%v): the manifests were synced", err)
	}
	if tracked, err := inventory.Read(context.Background(), env.Client); err != nil || len(tracked) != 0 {
		t.Errorf("Talos's inventory tracks %v (%v): the manifests were synced", tracked, err)
	}
}

// waitKubeProxy waits until kube-proxy's DaemonSet, as Talos applied it,
// runs image on n nodes.
func waitKubeProxy(t testing.TB, image string, n int32) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "kube-proxy "+image+" on every node", func(ctx context.Context) (bool, error) {
		ds := &appsv1.DaemonSet{}
		if err := env.Client.Get(ctx, keyOf("kube-system", "kube-proxy"), ds); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		st := ds.Status
		return ds.Spec.Template.Spec.Containers[0].Image == image && st.ObservedGeneration == ds.Generation &&
			st.UpdatedNumberScheduled == n && st.NumberAvailable == n, nil
	})
}

// checkKubeProxyRolled checks that kube-proxy's DaemonSet is at generation
// and its n pods, which the DaemonSet controller made from its template,
// run image and are Ready.
func checkKubeProxyRolled(t *testing.T, image string, n int, generation int64) {
	t.Helper()
	ctx := context.Background()
	ds := &appsv1.DaemonSet{}
	if err := env.Client.Get(ctx, keyOf("kube-system", "kube-proxy"), ds); err != nil {
		t.Fatal(err)
	}
	if ds.Generation != generation || ds.Status.ObservedGeneration != generation || ds.Status.UpdatedNumberScheduled != int32(n) {
		t.Errorf("kube-proxy's DaemonSet: generation %d, observed %d, %d updated; want generation %d on %d nodes",
			ds.Generation, ds.Status.ObservedGeneration, ds.Status.UpdatedNumberScheduled, generation, n)
	}
	var pods corev1.PodList
	if err := env.Client.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-proxy"}); err != nil {
		t.Fatal(err)
	}
	ready := 0
	for _, p := range pods.Items {
		owner := metav1.GetControllerOf(&p)
		if owner == nil || owner.Kind != "DaemonSet" || owner.UID != ds.UID || p.Spec.Containers[0].Image != image {
			t.Errorf("pod %s: controller %+v, image %s", p.Name, owner, p.Spec.Containers[0].Image)
		}
		if podutils.IsPodReady(&p) {
			ready++
		}
	}
	if len(pods.Items) != n || ready != n {
		t.Errorf("%d kube-proxy pods, %d Ready; want %d", len(pods.Items), ready, n)
	}
}

// removeBootstrapManifests deletes what Talos's inventory tracks (the
// manifests synced or Talos applied) and the inventory: kube-system is
// shared by the package's tests.
func removeBootstrapManifests(t testing.TB) {
	ctx := context.Background()
	tracked, err := inventory.Read(ctx, env.Client)
	if err != nil {
		t.Error(err)
	}
	for _, ref := range tracked {
		m, err := env.Client.RESTMapper().RESTMapping(ref.GroupKind)
		if err != nil {
			t.Error(err)
			continue
		}
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(m.GroupVersionKind)
		u.SetNamespace(ref.Namespace)
		u.SetName(ref.Name)
		_ = env.Client.Delete(ctx, u, client.PropagationPolicy(metav1.DeletePropagationBackground))
	}
	removeKubeProxy(t)
}
