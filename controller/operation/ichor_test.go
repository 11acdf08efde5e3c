package operation_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/kubectl/pkg/util/podutils"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
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
	c := newIchorWorld(t, spec)
	c.install()
	return c
}

// newIchorWorld is newIchorCluster before the install: machines whose
// kubelet runs either build, and nothing of Ichor yet.
func newIchorWorld(t *testing.T, spec sim.Spec) *ichorCluster {
	t.Helper()
	spec.Kubelet.Binaries = map[string]string{oldImage: testcluster.IchorBinary(t, env, oldVersion), newImage: testcluster.IchorBinary(t, env, newVersion)}
	spec.Kubelet.Env = testcluster.ProcessEnv()
	c := &ichorCluster{cluster: newClusterIn(t, spec, ichorv1.DefaultNamespace)}
	// Before the fleet's own cleanup: no controller pod may run on the
	// next test's machines of the same names.
	t.Cleanup(func() { removeIchor(t) })
	return c
}

// install installs the old build as an admin does (its own installer),
// and waits until its Deployment has rolled out and a controller of it leads.
func (c *ichorCluster) install() {
	c.t.Helper()
	install := exec.Command(testcluster.IchorBinary(c.t, env, oldVersion), "install", "--image", oldImage)
	install.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig)
	if out, err := install.CombinedOutput(); err != nil {
		c.t.Fatalf("install %s: %v\n%s", oldVersion, err, out)
	}
	c.writeTalosconfig()
	c.waitRolledOut(oldImage, oldVersion)
}

// removeIchor deletes what the installer and the controller made in
// ichor-system that runs or holds: the Jobs, the Deployment, its
// ReplicaSets and pods, the Leases and the talosconfig. Until none is left:
// an installer Job's process still running re-applies the Deployment, and
// a ReplicaSet the garbage collector has not reached yet makes pods again.
// Pods left behind are bound to Node names the next test's machines take
// again, whose kubelets would find them.
func removeIchor(t *testing.T) {
	ctx := context.Background()
	ns := client.InNamespace(ichorv1.DefaultNamespace)
	bg := client.PropagationPolicy(metav1.DeletePropagationBackground)
	testenv.Eventually(t, time.Minute, "the controller's Jobs, Deployment, ReplicaSets and pods to be gone", func(ctx context.Context) (bool, error) {
		left := 0
		for _, l := range []client.ObjectList{&batchv1.JobList{}, &appsv1.DeploymentList{}, &appsv1.ReplicaSetList{}, &corev1.PodList{}} {
			if err := env.Client.List(ctx, l, ns); err != nil {
				return false, err
			}
			left += meta.LenList(l)
		}
		if left == 0 {
			return true, nil
		}
		for _, o := range []client.Object{&batchv1.Job{}, &appsv1.Deployment{}, &appsv1.ReplicaSet{}} {
			if err := env.Client.DeleteAllOf(ctx, o, ns, bg); err != nil {
				return false, err
			}
		}
		return false, env.Client.DeleteAllOf(ctx, &corev1.Pod{}, ns, client.GracePeriodSeconds(0))
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
			if pods[i].Spec.Containers[0].Image != image || !podutils.IsPodReady(&pods[i]) {
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
		if img := p.Spec.Containers[0].Image; img != newImage || !podutils.IsPodReady(&p) {
			t.Errorf("controller pod %s runs %s (ready %v), want %s", p.Name, img, podutils.IsPodReady(&p), newImage)
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
	if got, want := freeAgain(t, holders), []string{opID, jobID, opID, ""}; !slices.Equal(got, want) {
		t.Errorf("the cluster lock's holders over time:\n %q\nwant\n %q", got, want)
	}
}

// An ichor upgrade with the old controller killed at each step, between a
// call and the status write that records it, and during the rollout, and
// then the new leader killed as it waits for the last old pod: the next
// controller (a standby replica of either build) takes over where status
// says, and the outcome is that of an upgrade nobody killed. One installer
// Job; the lock lent to it and taken back, never free between; every pod
// on the new build; and the operation marked Succeeded by the new build:
// a controller of the old version never marks it done.
func TestIchorKilledAtEveryStep(t *testing.T) {
	tests := []struct {
		name string
		// hook kills the old leader from inside its calls: it calls kill.
		hook func(kill func()) controllerOption
		// during, when set instead, kills old once the operation runs.
		during func(c *ichorCluster, old *controller, kill func())
		// step is where status stands once the killed leader is gone.
		step string
	}{
		{name: "after creating the installer Job, before lending it the lock", step: executor.StepIchorInstall,
			hook: func(kill func()) controllerOption {
				return afterWrite(http.MethodPost, "/namespaces/"+ichorv1.DefaultNamespace+"/jobs", func(runtime.Object) bool { return true }, kill)
			}},
		{name: "after lending the lock to the Job, before status records it", step: executor.StepIchorInstall, hook: afterLend},
		{name: "after taking the lock back from the Job, before status records it", step: executor.StepIchorJob, hook: afterReclaim},
		{name: "during the rollout, then the new leader", during: killDuringRollout},
		{name: "after the rollout, the old leader outliving its pods", during: killAfterRollout, step: executor.StepNewVersion},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newIchorWorld(t, sim.Cluster("", 1, 1))
			holders := c.watchLockHolders()
			var killed atomic.Bool
			var old *controller
			kill := func() {
				if killed.CompareAndSwap(false, true) {
					old.Kill()
				}
			}
			var opts []controllerOption
			if tt.hook != nil {
				opts = append(opts, tt.hook(kill))
			}
			old = c.startOldLeader(opts...)
			c.install()
			c.create("ichor", ichorv1.TalosOperationSpec{Kind: ichorv1.KindIchor, Ichor: &ichorv1.IchorUpgrade{Version: newVersion}})
			if tt.during != nil {
				tt.during(c, old, kill)
			}
			testenv.Eventually(t, 3*time.Minute, "the old leader to be killed", func(context.Context) (bool, error) {
				return killed.Load(), nil
			})
			<-old.Exited()
			if op := c.get("ichor"); tt.step != "" && (len(op.Status.Machines) == 0 || op.Status.Machines[0].Step != tt.step) {
				t.Fatalf("the killed controller was killed elsewhere than at %s: %s", tt.step, boundary(op))
			}
			op := c.waitSucceeded("ichor", 5*time.Minute)

			if want := "finished by ichor-controller " + newVersion; !strings.HasSuffix(op.Status.Machines[0].Message, want) {
				t.Errorf("the operation was marked done as %q, want it finished by %s", op.Status.Machines[0].Message, newVersion)
			}
			for _, p := range controllerPods(t) {
				if img := p.Spec.Containers[0].Image; img != newImage || !podutils.IsPodReady(&p) {
					t.Errorf("controller pod %s runs %s (ready %v), want %s", p.Name, img, podutils.IsPodReady(&p), newImage)
				}
			}
			jobs := jobsOf(t, op)
			if len(jobs) != 1 || jobs[0].Status.Succeeded != 1 {
				t.Fatalf("the operation started %d Jobs (%+v), want 1 that succeeded", len(jobs), jobs)
			}
			opID := ichorv1.OperationIdentity(c.ns, "ichor")
			jobID := ichorv1.JobIdentity(ichorv1.DefaultNamespace, jobs[0].Name)
			if got, want := freeAgain(t, holders), []string{opID, jobID, opID, ""}; !slices.Equal(got, want) {
				t.Errorf("the cluster lock's holders over time:\n %q\nwant\n %q", got, want)
			}
		})
	}
}

// startOldLeader runs a controller of the old build in the test, killable
// (as SIGKILL would: it releases nothing), and waits until it leads: the
// Deployment's pods, installed after it, stand by. It is the old build's
// code, stamped with its version and image.
func (c *ichorCluster) startOldLeader(opts ...controllerOption) *controller {
	c.t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ichorv1.DefaultNamespace}}
	if err := env.Client.Create(context.Background(), ns); err != nil && !apierrors.IsAlreadyExists(err) {
		c.t.Fatal(err)
	}
	oldBuild := func(o *app.Options, _ **rest.Config) { o.Version, o.Image = oldVersion, oldImage }
	old := c.startKillableWith(append([]controllerOption{withLeaderElection(), oldBuild}, opts...)...)
	select {
	case <-old.Elected():
	case <-time.After(time.Minute):
		c.t.Fatal("the old controller did not lead within a minute")
	}
	return old
}

// afterReclaim calls do after the write of the cluster lock Lease that
// takes it back from its borrower: the first one not lent after one lent.
func afterReclaim(do func()) controllerOption {
	var wasLent atomic.Bool
	return afterWrite(http.MethodPut, "/leases/"+ichorv1.LockLeaseName, func(obj runtime.Object) bool {
		if lent(obj) {
			wasLent.Store(true)
			return false
		}
		return wasLent.Load()
	}, do)
}

// killDuringRollout kills the old leader once the rollout has started a
// pod of the new build; then, once a new leader waits for the last pod not
// on the new build (a stray one the test started, which holds the rollout
// open), kills every pod of the new build, the leader among them; the
// next new leader finishes once the stray pod is gone.
func killDuringRollout(c *ichorCluster, _ *controller, kill func()) {
	c.t.Helper()
	ctx := context.Background()
	stray := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: "stray",
			Labels: map[string]string{"app.kubernetes.io/name": manifests.Deployment}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: manifests.Container, Image: "registry.k8s.io/pause:3.10"}}},
	}
	c.createObject(stray)
	testenv.Eventually(c.t, 3*time.Minute, "the rollout to start a pod of "+newImage, func(ctx context.Context) (bool, error) {
		d := &appsv1.Deployment{}
		err := env.Client.Get(ctx, keyOf(ichorv1.DefaultNamespace, manifests.Deployment), d)
		return err == nil && d.Spec.Template.Spec.Containers[0].Image == newImage && d.Status.UpdatedReplicas > 0, err
	})
	kill()
	waiting := "waiting for pod stray (registry.k8s.io/pause:3.10) to go"
	c.waitFor("ichor", "a new leader to wait for the stray pod", 3*time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Succeeded() {
			c.t.Fatalf("the operation was marked done with a pod not on %s left: %s", newImage, op.Status.Machines[0].Message)
		}
		return len(op.Status.Machines) == 1 && op.Status.Machines[0].Message == waiting
	})
	leader := leaderLease(c.t, c.cluster)
	for _, p := range controllerPods(c.t) {
		if p.Spec.Containers[0].Image == newImage {
			if err := env.Client.Delete(ctx, &p, client.GracePeriodSeconds(0)); err != nil {
				c.t.Fatal(err)
			}
		}
	}
	testenv.Eventually(c.t, 3*time.Minute, "another new leader", func(ctx context.Context) (bool, error) {
		l := &coordinationv1.Lease{}
		err := env.Client.Get(ctx, keyOf(ichorv1.DefaultNamespace, ichorv1.LeaderLeaseName), l)
		return err == nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != *leader.Spec.HolderIdentity, err
	})
	if err := env.Client.Delete(ctx, stray, client.GracePeriodSeconds(0)); err != nil {
		c.t.Fatal(err)
	}
}

// killAfterRollout keeps the old leader leading until every pod runs the
// new build, ready, and it has checked the last step since: it still waits
// for the new version (it would mark the operation done now if it did
// not tell its own version from the target's). Then it is killed.
func killAfterRollout(c *ichorCluster, old *controller, kill func()) {
	c.t.Helper()
	c.waitRolledOut(newImage, oldVersion)
	checks := waitKey(c.get("ichor").Status.Machines[0].Name, executor.StepNewVersion)
	// Any change of the operation has it reconciled, which checks the
	// step. Twice: the second check starts once the first one's reconcile,
	// status write included, has ended.
	for i := range 2 {
		n := old.steps.count(checks)
		c.kubectl("annotate", "--overwrite", "talosoperation", "ichor", fmt.Sprintf("test.ichor.maesh.dev/poke=%d", i))
		testenv.Eventually(c.t, time.Minute, "the old leader to check the last step after the rollout", func(context.Context) (bool, error) {
			return old.steps.count(checks) > n || c.get("ichor").Succeeded(), nil
		})
	}
	waiting := "waiting for ichor-controller " + newVersion + " to take over (this controller is " + oldVersion + ")"
	if op := c.get("ichor"); op.Succeeded() || op.Status.Machines[0].Message != waiting {
		c.t.Errorf("after the rollout the old leader left the operation %s: %q, want it %q", op.Status.Phase, op.Status.Machines[0].Message, waiting)
	}
	kill()
}

// A drain of the machine the leading controller's pod runs on evicts that
// pod last: while a budget holds another pod back, the leader stays (its
// standby on the machine goes at once); once the budget lets go, the
// leader evicts itself, a new one takes over and finishes the reboot. A
// leader evicting itself among the others would cut the evictions in
// flight when it ends.
func TestDrainEvictsOwnPodLast(t *testing.T) {
	c := newIchorWorld(t, sim.Cluster("", 1, 2))
	cp, w1, w2 := c.fleet.Machines()[0].Name(), c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	// The controller's pods and the held pod on w1.
	c.setCordon(w2, true)
	c.setCordon(cp, true)
	c.install()
	c.deployment("held", 1, 0)
	c.pdb("held", 1)
	c.waitHealthy("held", 1)
	c.setCordon(w2, false)
	c.setCordon(cp, false)
	leader := *leaderLease(t, c.cluster).Spec.HolderIdentity

	c.create("reboot", rebootSpec(w1))
	want := fmt.Sprintf("PodDisruptionBudget %s/held (minAvailable 1, 1 of 1 healthy) holds 1 pod", c.ns)
	c.waitFor("reboot", "the drain to be held by the budget", 3*time.Minute, func(op *ichorv1.TalosOperation) bool {
		return len(op.Status.Machines) == 1 && op.Status.Machines[0].Step == executor.StepDrain && strings.Contains(op.Status.Machines[0].Message, want)
	})
	testenv.Eventually(t, time.Minute, "the standby on "+w1+" to be evicted", func(ctx context.Context) (bool, error) {
		n := 0
		for _, p := range controllerPods(t) {
			if p.Spec.NodeName == w1 && p.DeletionTimestamp == nil {
				n++
			}
		}
		return n == 1, nil
	})
	if got := *leaderLease(t, c.cluster).Spec.HolderIdentity; got != leader {
		t.Fatalf("the leader changed from %s to %s while the budget held the drain: it evicted its own pod before the others", leader, got)
	}
	if err := env.Client.Delete(context.Background(), &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "held"}}); err != nil {
		t.Fatal(err)
	}
	c.waitSucceeded("reboot", 3*time.Minute)
	if got := *leaderLease(t, c.cluster).Spec.HolderIdentity; got == leader {
		t.Errorf("the leader on the rebooted %s still leads", w1)
	}
}
