package operation_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/manifests"
	"maesh.dev/ichor/sim"
)

// Two builds of ichor-controller, each the image of its release.
const (
	oldVersion = "v0.1.0"
	newVersion = "v0.2.0"
	oldImage   = executor.ReleaseImage + ":" + oldVersion
	newImage   = executor.ReleaseImage + ":" + newVersion
)

// ichorCluster is a cluster running Ichor as an admin installs it: the
// manifests applied by the old build's installer into ichor-system, the
// controller as its Deployment's pods on the machines, each the real binary
// of its image's build (the old and the new one).
type ichorCluster struct {
	*cluster
}

func newIchorCluster(t *testing.T, spec sim.Spec) *ichorCluster {
	t.Helper()
	oldBin, newBin := testcluster.IchorBinary(t, env, oldVersion), testcluster.IchorBinary(t, env, newVersion)
	spec.Kubelet.Binaries = map[string]string{oldImage: oldBin, newImage: newBin}
	spec.Kubelet.Env = testcluster.ProcessEnv()
	c := &ichorCluster{cluster: newClusterIn(t, spec, ichorv1.DefaultNamespace)}
	// Before the fleet's own cleanup: no controller pod may run on the
	// next test's machines of the same names.
	t.Cleanup(func() { removeIchor(t) })
	install := exec.Command(oldBin, "install", "--image", oldImage)
	install.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig)
	if out, err := install.CombinedOutput(); err != nil {
		t.Fatalf("install %s: %v\n%s", oldVersion, err, out)
	}
	c.writeTalosconfig()
	c.waitRolledOut(oldImage, oldVersion)
	return c
}

// removeIchor deletes what the installer and the controller made in
// ichor-system that runs or holds: the Deployment and its pods, the Jobs,
// the Leases and the talosconfig.
func removeIchor(t *testing.T) {
	ctx := context.Background()
	ns := client.InNamespace(ichorv1.DefaultNamespace)
	bg := client.PropagationPolicy(metav1.DeletePropagationBackground)
	_ = env.Client.Delete(ctx, &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: manifests.Deployment}}, bg)
	_ = env.Client.DeleteAllOf(ctx, &batchv1.Job{}, ns, bg)
	testenv.Eventually(t, time.Minute, "the controller's pods to be gone", func(ctx context.Context) (bool, error) {
		if err := env.Client.DeleteAllOf(ctx, &corev1.Pod{}, ns, client.GracePeriodSeconds(0)); err != nil {
			return false, err
		}
		var pods corev1.PodList
		err := env.Client.List(ctx, &pods, ns)
		return err == nil && len(pods.Items) == 0, err
	})
	_ = env.Client.DeleteAllOf(ctx, &coordinationv1.Lease{}, ns)
	_ = env.Client.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: ichorv1.TalosconfigSecret}})
}

// controllerPods are the pods of the controller's Deployment.
func controllerPods(t testing.TB) []corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	if err := env.Client.List(context.Background(), &pods, client.InNamespace(ichorv1.DefaultNamespace),
		client.MatchingLabels{"app.kubernetes.io/name": manifests.Deployment}); err != nil {
		t.Fatal(err)
	}
	return pods.Items
}

// waitRolledOut waits until every replica of the Deployment runs image,
// ready, no other pod is left, and the leader Lease names version.
func (c *ichorCluster) waitRolledOut(image, version string) {
	c.t.Helper()
	testenv.Eventually(c.t, 3*time.Minute, "every controller pod to run "+image+" and one to lead", func(ctx context.Context) (bool, error) {
		d := &appsv1.Deployment{}
		if err := env.Client.Get(ctx, keyOf(ichorv1.DefaultNamespace, manifests.Deployment), d); err != nil {
			return false, err
		}
		pods := controllerPods(c.t)
		if len(pods) != int(*d.Spec.Replicas) {
			return false, nil
		}
		for i := range pods {
			if pods[i].Spec.Containers[0].Image != image || !isReady(&pods[i]) {
				return false, nil
			}
		}
		lease := &coordinationv1.Lease{}
		if err := env.Client.Get(ctx, keyOf(ichorv1.DefaultNamespace, ichorv1.LeaderLeaseName), lease); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		return lease.Annotations[ichorv1.VersionAnnotation] == version, nil
	})
}

// pauseRollout sets the Deployment's spec.paused, as `kubectl rollout
// pause` does.
func (c *ichorCluster) pauseRollout(paused bool) {
	c.t.Helper()
	d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: manifests.Deployment}}
	patch := fmt.Sprintf(`{"spec":{"paused":%v}}`, paused)
	if err := env.Client.Patch(context.Background(), d, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		c.t.Fatal(err)
	}
}

func isReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// An ichor operation from one build to the next: the old controller starts
// the installer Job of the new image and lends it the cluster lock; the Job
// applies the new build's manifests; the Deployment's rollout replaces
// every controller pod (old and new ones run side by side on the
// machines, more pods than machines); and the new build, once it leads, marks the operation
// Succeeded. The lock goes from the operation to the Job and back, never
// free between.
func TestIchorUpgradeThroughInstaller(t *testing.T) {
	c := newIchorCluster(t, sim.Cluster("", 1, 1))
	holders := c.watchLockHolders()
	// The rollout is held until the old leader has reached the last step,
	// so that it shows it waits there for the new version, rather than
	// racing the new pods to it. The installer's apply leaves the field
	// (it sets no spec.paused).
	c.pauseRollout(true)
	c.create("ichor", ichorv1.TalosOperationSpec{Kind: ichorv1.KindIchor, Ichor: &ichorv1.IchorUpgrade{Version: newVersion}})
	waiting := "waiting for ichor-controller " + newVersion + " to take over (this controller is " + oldVersion + ")"
	c.waitFor("ichor", "to wait for the new controller", 3*time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Failed() || op.Succeeded() {
			t.Fatalf("ichor ended as %s before the new controller ran: %s", op.Status.Phase, boundary(op))
		}
		return len(op.Status.Machines) == 1 && op.Status.Machines[0].Step == executor.StepNewVersion && op.Status.Machines[0].Message == waiting
	})
	c.pauseRollout(false)
	op := c.waitSucceeded("ichor", 5*time.Minute)

	m := op.Status.Machines[0]
	if want := "finished by ichor-controller " + newVersion; !strings.HasSuffix(m.Message, want) {
		t.Errorf("the operation was marked done as %q, want it finished by %s", m.Message, newVersion)
	}
	pods := controllerPods(t)
	if len(pods) != 2 {
		t.Errorf("%d controller pods, want the Deployment's 2", len(pods))
	}
	for _, p := range pods {
		if img := p.Spec.Containers[0].Image; img != newImage || !isReady(&p) {
			t.Errorf("controller pod %s runs %s (ready %v), want %s", p.Name, img, isReady(&p), newImage)
		}
		// The new pods ran beside the old ones on the two machines: none
		// crashed on a port another one held.
		if cs := p.Status.ContainerStatuses; len(cs) != 1 || cs[0].RestartCount != 0 {
			t.Errorf("controller pod %s restarted: %+v", p.Name, cs)
		}
	}
	jobs := jobsOf(t, op)
	if len(jobs) != 1 || jobs[0].Status.Succeeded != 1 {
		t.Fatalf("the operation started %d Jobs (%+v), want 1 that succeeded", len(jobs), jobs)
	}
	if img := jobs[0].Spec.Template.Spec.Containers[0].Image; img != newImage {
		t.Errorf("the installer Job ran %s, want %s", img, newImage)
	}
	opID := ichorv1.OperationIdentity(c.ns, "ichor")
	jobID := ichorv1.JobIdentity(ichorv1.DefaultNamespace, jobs[0].Name)
	if got, want := holders(), []string{opID, jobID, opID, ""}; !slices.Equal(got, want) {
		t.Errorf("the cluster lock's holders over time:\n %q\nwant\n %q", got, want)
	}
}
