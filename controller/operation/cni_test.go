package operation_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/kube"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testchart"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// The image of the controller under test: pods of it run the real binary.
const testImage = "ghcr.io/maesh-dev/ichor-controller:v0.1.0"

// ciliumCluster is a cluster whose machines run pods (Ichor's image as the
// real binary), with a user's Cilium 1.18 installed by Helm from the test
// chart, and the shipped chart (the test chart at 1.19.6) in a directory as
// the image has it.
type ciliumCluster struct {
	*cluster
	dir string
	pin compat.ChartPin
}

func newCiliumCluster(t *testing.T, spec sim.Spec) *ciliumCluster {
	t.Helper()
	spec.Kubelet.Binaries = testcluster.IchorBinaries(t, env)
	c := &ciliumCluster{cluster: newCluster(t, spec), dir: t.TempDir()}
	old, err := testchart.Write(c.dir, "1.18.11")
	if err != nil {
		t.Fatal(err)
	}
	if c.pin, err = testchart.Write(c.dir, "1.19.6"); err != nil {
		t.Fatal(err)
	}
	ciliumJobAccount(t)
	ch, err := cilium.LoadChart(c.dir, old)
	if err != nil {
		t.Fatal(err)
	}
	in := action.NewInstall(helmConfig(t))
	in.ReleaseName, in.Namespace, in.WaitStrategy, in.Timeout = cilium.Release, cilium.Namespace, kube.StatusWatcherStrategy, 2*time.Minute
	if _, err := in.RunWithContext(context.Background(), ch, map[string]any{"ipam": map[string]any{"mode": "kubernetes"}}); err != nil {
		t.Fatalf("install the user's Cilium: %v", err)
	}
	t.Cleanup(func() {
		un := action.NewUninstall(helmConfig(t))
		un.WaitStrategy = kube.HookOnlyStrategy
		if _, err := un.Run(cilium.Release); err != nil {
			t.Logf("uninstall cilium: %v", err)
		}
		_ = env.Client.DeleteAllOf(context.Background(), &batchv1.Job{}, client.InNamespace(cilium.Namespace),
			client.HasLabels{executor.JobOperationUIDLabel}, client.PropagationPolicy(metav1.DeletePropagationBackground))
	})
	return c
}

func helmConfig(t *testing.T) *action.Configuration {
	f := genericclioptions.NewConfigFlags(false)
	f.KubeConfig = &env.Kubeconfig
	cfg := action.NewConfiguration()
	if err := cfg.Init(f, cilium.Namespace, "secret"); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// ciliumJobAccount is manifests/controller/jobs.yaml's ServiceAccount of the Cilium Job.
func ciliumJobAccount(t *testing.T) {
	ctx := context.Background()
	for _, o := range []client.Object{
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: cilium.Namespace, Name: executor.CiliumServiceAccount}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: executor.CiliumServiceAccount},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: executor.CiliumServiceAccount, Namespace: cilium.Namespace}}},
	} {
		if err := env.Client.Create(ctx, o); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
}

// withImage runs the controller as its Deployment would: it knows its
// image, and its chart directory holds the shipped chart.
func (c *ciliumCluster) withImage() controllerOption {
	return func(o *app.Options, _ **rest.Config) {
		o.Image, o.ChartDir, o.CiliumChart = testImage, c.dir, &c.pin
	}
}

func agentImage(t *testing.T) string {
	t.Helper()
	ds := &appsv1.DaemonSet{}
	if err := env.Client.Get(context.Background(), keyOf(cilium.Namespace, cilium.DaemonSet), ds); err != nil {
		t.Fatal(err)
	}
	return ds.Spec.Template.Spec.Containers[0].Image
}

// jobsOf are the Jobs an operation started.
func jobsOf(t *testing.T, op *ichorv1.TalosOperation) []batchv1.Job {
	t.Helper()
	var jobs batchv1.JobList
	if err := env.Client.List(context.Background(), &jobs, client.MatchingLabels{executor.JobOperationUIDLabel: string(op.UID)}); err != nil {
		t.Fatal(err)
	}
	return jobs.Items
}

// A cni operation moves the user's Cilium to the shipped chart through a
// Job whose init container held the cluster lock (lent by the operation),
// while a Talos upgrade created after it waits for the Job; then the
// upgrade runs.
func TestCiliumUpgradeThroughJob(t *testing.T) {
	c := newCiliumCluster(t, sim.Cluster("", 1, 2))
	holders := c.watchLockHolders()
	c.start(c.withImage())
	cni := c.create("cilium", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI})
	c.waitFor("cilium", "to lend the lock to its Job", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return len(op.Status.Machines) > 0 && op.Status.Machines[0].Step == executor.StepCilium
	})
	c.create("talos", talosSpec("v1.13.7"))
	waited := c.waitFor("talos", "to wait for the Cilium Job", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.WaitingForLock()
	})
	if !strings.HasPrefix(waited.Status.LockHolder, "job/kube-system/ichor-cni-") {
		t.Errorf("the Talos upgrade waits for %q, want the Cilium Job", waited.Status.LockHolder)
	}
	done := c.waitSucceeded("cilium", 3*time.Minute)
	c.waitSucceeded("talos", 3*time.Minute)

	if img := agentImage(t); img != "quay.io/cilium/cilium:v1.19.6" {
		t.Errorf("agents run %s after the upgrade", img)
	}
	jobs := jobsOf(t, cni)
	if len(jobs) != 1 {
		t.Fatalf("the operation started %d Jobs, want 1", len(jobs))
	}
	job := jobs[0]
	jobID := ichorv1.JobIdentity(job.Namespace, job.Name)
	opID := ichorv1.OperationIdentity(c.ns, "cilium")
	talosID := ichorv1.OperationIdentity(c.ns, "talos")
	// Lent to the Job and taken back, never free between; then the next in
	// the queue (directly, or after a free moment a watch may not see).
	got := holders()
	next := slices.DeleteFunc(slices.Clone(got[min(3, len(got)):]), func(h string) bool { return h == "" })
	if len(got) < 3 || !slices.Equal(got[:3], []string{opID, jobID, opID}) || !slices.Equal(next, []string{talosID}) {
		t.Errorf("the cluster lock's holders over time:\n %q\nwant %q, then %q", got, []string{opID, jobID, opID}, talosID)
	}
	// Its pod may be gone (the Talos upgrade drained its machine): a
	// succeeded Job ran its lock init container to success first.
	if job.Status.Succeeded != 1 || len(job.Spec.Template.Spec.InitContainers) != 1 ||
		!slices.Equal(job.Spec.Template.Spec.InitContainers[0].Args[:4], []string{"lock", "acquire", "--identity", jobID}) {
		t.Errorf("the Job (%d succeeded) did not take the lock in its init container: %+v", job.Status.Succeeded, job.Spec.Template.Spec.InitContainers)
	}
	if m := done.Status.Machines[0]; m.Phase != ichorv1.MachineSucceeded {
		t.Errorf("the lead machine ended %s: %s", m.Phase, m.Message)
	}
}

// A Job of someone else's that takes the lock with the same init
// container waits its turn behind a cni operation, like any holder: it
// gets the lock only once the operation has released it, never while the
// operation's own Job holds it. The operation's Job is held from running
// (a ResourceQuota admits no pod of its priority class in kube-system)
// until the other Job is queued behind it in the Lease.
func TestForeignJobWaitsForCNI(t *testing.T) {
	c := newCiliumCluster(t, sim.Cluster("", 1, 1))
	holders := c.watchLockHolders()
	quota := &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: cilium.Namespace, Name: "hold-cluster-critical"},
		Spec: corev1.ResourceQuotaSpec{
			Hard: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("0")},
			ScopeSelector: &corev1.ScopeSelector{MatchExpressions: []corev1.ScopedResourceSelectorRequirement{{
				ScopeName: corev1.ResourceQuotaScopePriorityClass, Operator: corev1.ScopeSelectorOpIn, Values: []string{"system-cluster-critical"}}}},
		},
	}
	c.createObject(quota)
	unhold := func() { _ = env.Client.Delete(context.Background(), quota) }
	t.Cleanup(unhold)
	c.start(c.withImage())
	c.create("cilium", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI})
	c.waitFor("cilium", "to lend the lock to its Job", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return len(op.Status.Machines) > 0 && op.Status.Machines[0].Step == executor.StepCilium
	})
	jobID := ichorv1.JobIdentity(cilium.Namespace, jobsOf(t, c.get("cilium"))[0].Name)
	foreign := c.lockJob("take-lock")
	foreignID := ichorv1.JobIdentity(c.ns, foreign.Name)
	testenv.Eventually(t, 2*time.Minute, foreignID+" to queue behind "+jobID, func(context.Context) (bool, error) {
		st := c.lockHolder()
		if st.Holder.Identity != jobID {
			return false, fmt.Errorf("the cluster lock is held by %q, want the operation's Job %s until it has run", st.Holder.Identity, jobID)
		}
		return slices.ContainsFunc(st.Waiting, func(w ichorv1.LockWaiter) bool { return w.Identity == foreignID }), nil
	})
	unhold()
	c.waitSucceeded("cilium", 3*time.Minute)
	c.waitJobSucceeded(foreign, 2*time.Minute)

	opID := ichorv1.OperationIdentity(c.ns, "cilium")
	if got, want := freeAgain(t, holders), []string{opID, jobID, opID, "", foreignID, ""}; !slices.Equal(got, want) {
		t.Errorf("the cluster lock's holders over time:\n %q\nwant\n %q", got, want)
	}
}

// lockJob starts a Job (someone else's, in the test's namespace) whose init
// container takes the cluster lock as Ichor's Jobs do and whose container
// releases it, both with the real binary.
func (c *cluster) lockJob(name string) *batchv1.Job {
	c.t.Helper()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name}}
	subjects := []rbacv1.Subject{{Kind: "ServiceAccount", Name: name, Namespace: c.ns}}
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: name},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "list", "watch", "create", "update"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: name},
		RoleRef: rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: name}, Subjects: subjects}
	// To judge whether the holder it waits for is done (README: the cluster lock).
	judge := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: c.ns + "-" + name},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{ichorv1.GroupVersion.Group}, Resources: []string{"talosoperations"}, Verbs: []string{"get", "list"}},
			{APIGroups: []string{"batch"}, Resources: []string{"jobs"}, Verbs: []string{"get"}},
			{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
		}}
	judgeBinding := &rbacv1.ClusterRoleBinding{ObjectMeta: judge.ObjectMeta,
		RoleRef: rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: judge.Name}, Subjects: subjects}
	lockCmd := func(args ...string) corev1.Container {
		return corev1.Container{
			Name: args[0], Image: testImage, Command: []string{executor.Binary},
			Args:                     append([]string{"lock", args[0], "--identity", ichorv1.JobIdentity(c.ns, name), "--namespace", c.ctrlNS}, args[1:]...),
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		}
	}
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name},
		Spec: batchv1.JobSpec{
			BackoffLimit: ptr.To[int32](0),
			Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				ServiceAccountName: name, RestartPolicy: corev1.RestartPolicyNever,
				InitContainers: []corev1.Container{lockCmd("acquire", "--wait")},
				Containers:     []corev1.Container{lockCmd("release")},
			}},
		},
	}
	for _, o := range []client.Object{sa, role, binding, judge, judgeBinding, job} {
		c.createObject(o)
	}
	c.t.Cleanup(func() {
		_ = env.Client.Delete(context.Background(), judgeBinding)
		_ = env.Client.Delete(context.Background(), judge)
	})
	return job
}

// waitJobSucceeded waits for the Job to succeed; its failure fails the test.
func (c *cluster) waitJobSucceeded(job *batchv1.Job, timeout time.Duration) {
	c.t.Helper()
	testenv.Eventually(c.t, timeout, "Job "+job.Name+" to succeed", func(ctx context.Context) (bool, error) {
		var j batchv1.Job
		if err := env.Client.Get(ctx, client.ObjectKeyFromObject(job), &j); err != nil {
			return false, err
		}
		for _, cond := range j.Status.Conditions {
			if cond.Type == batchv1.JobFailed && cond.Status == corev1.ConditionTrue {
				return false, fmt.Errorf("Job %s failed: %s", j.Name, cond.Message)
			}
		}
		return j.Status.Succeeded == 1, nil
	})
}

// The controller is killed right after it lent the cluster lock to its
// Job, before it wrote the step's end to status, or once status records
// that it waits for the rollout; the next controller goes on: it finds the
// Job it started and the lock already lent, starts no second Job, and the
// lock is never free until the end.
func TestCNIKilledAfterLend(t *testing.T) {
	for _, tc := range []struct {
		name string
		// at is where the controller is killed; step where status is then.
		at   func(do func()) controllerOption
		step string
	}{
		{"after the lend", afterLend, executor.StepCiliumJob},
		{"waiting for the rollout", afterStatusAt(executor.StepCilium), executor.StepCilium},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCiliumCluster(t, sim.Cluster("", 1, 1))
			holders := c.watchLockHolders()
			var killed atomic.Bool
			var first *controller
			first = c.startKillableWith(c.withImage(), tc.at(func() {
				if killed.CompareAndSwap(false, true) {
					first.Kill()
				}
			}))
			c.create("cilium", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI})
			testenv.Eventually(t, time.Minute, "the controller to be killed "+tc.name, func(context.Context) (bool, error) {
				return killed.Load(), nil
			})
			<-first.Exited()
			if op := c.get("cilium"); len(op.Status.Machines) == 0 || op.Status.Machines[0].Step != tc.step {
				t.Fatalf("the killed controller left status at another step than %s: %s", tc.step, boundary(op))
			}
			c.start(c.withImage())
			op := c.waitSucceeded("cilium", 3*time.Minute)

			if jobs := jobsOf(t, op); len(jobs) != 1 {
				t.Errorf("the operation started %d Jobs, want 1", len(jobs))
			}
			opID := ichorv1.OperationIdentity(c.ns, "cilium")
			jobID := ichorv1.JobIdentity(cilium.Namespace, jobsOf(t, op)[0].Name)
			if got, want := freeAgain(t, holders), []string{opID, jobID, opID, ""}; !slices.Equal(got, want) {
				t.Errorf("the cluster lock's holders over time:\n %q\nwant\n %q", got, want)
			}
			if img := agentImage(t); img != "quay.io/cilium/cilium:v1.19.6" {
				t.Errorf("agents run %s after the upgrade", img)
			}
		})
	}
}

// afterStatusAt calls do after each status write that records the
// operation's first machine at step.
func afterStatusAt(step string) func(do func()) controllerOption {
	return func(do func()) controllerOption {
		return afterWrite(http.MethodPut, "/status", func(obj runtime.Object) bool {
			op, ok := obj.(*ichorv1.TalosOperation)
			return ok && len(op.Status.Machines) > 0 && op.Status.Machines[0].Step == step
		}, do)
	}
}

// afterLend calls do after each write of the cluster lock Lease that lends
// it (it sets the lent-by annotation), once the API server accepted it and
// before the controller sees the answer: a kill there lands between the
// lend and what follows.
func afterLend(do func()) controllerOption {
	return afterWrite(http.MethodPut, "/leases/"+ichorv1.LockLeaseName, lent, do)
}

// lent reports whether obj is a cluster lock Lease that is lent.
func lent(obj runtime.Object) bool {
	lease, ok := obj.(*coordinationv1.Lease)
	return ok && lease.Annotations[lock.LentByAnnotation] != ""
}

// afterWrite calls do after each request of method to a path ending in
// path whose object (JSON or protobuf) matches, once the API server
// accepted it and before the controller sees the answer.
func afterWrite(method, path string, match func(runtime.Object) bool, do func()) controllerOption {
	return func(_ *app.Options, cfg **rest.Config) {
		(*cfg).Wrap(func(rt http.RoundTripper) http.RoundTripper {
			return roundTripper(func(req *http.Request) (*http.Response, error) {
				if req.Method != method || !strings.HasSuffix(req.URL.Path, path) {
					return rt.RoundTrip(req)
				}
				obj := requestObject(req)
				resp, err := rt.RoundTrip(req)
				if err != nil || resp.StatusCode >= http.StatusMultipleChoices {
					return resp, err
				}
				if obj != nil && match(obj) {
					do()
				}
				return resp, err
			})
		})
	}
}

// requestDecoder decodes the objects of the controller's requests, JSON or protobuf.
var requestDecoder = serializer.NewCodecFactory(app.Scheme).UniversalDeserializer()

// requestObject is the object a request sends, nil when it sends none
// that decodes.
func requestObject(req *http.Request) runtime.Object {
	raw, ok := requestBody(req)
	if !ok {
		return nil
	}
	obj, _, err := requestDecoder.Decode(raw, nil, nil)
	if err != nil {
		return nil
	}
	return obj
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// The switch to kube-proxy replacement: Cilium with replacement on while
// kube-proxy runs, cluster.proxy.disabled on every machine, kube-proxy's
// objects and inventory keys gone, every machine rebooted once within the
// budget. Then the way back brings kube-proxy back and Cilium without
// replacement, without reboots.
func TestSwitchKubeProxyReplacement(t *testing.T) {
	c := newKubeProxyCluster(t, sim.Cluster("", 1, 3))
	ctx := context.Background()
	c.start(c.withImage())
	c.create("kpr", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, MaxUnavailable: 2, CNI: &ichorv1.CNIChange{KubeProxyReplacement: ptr.To(true)}})
	c.waitSucceeded("kpr", 5*time.Minute)
	c.checkKubeProxyReplaced(t)
	rec := c.fleet.Recorder()
	if cps, workers := rec.MaxDown(); cps > 1 || workers > 2 {
		t.Errorf("at most %d control planes and %d workers were down at once; the budget is 1 and 2", cps, workers)
	}

	// The way back.
	rec.Reset()
	c.create("back", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, CNI: &ichorv1.CNIChange{KubeProxyReplacement: ptr.To(false)}})
	c.waitSucceeded("back", 5*time.Minute)
	cm := &corev1.ConfigMap{}
	if err := env.Client.Get(ctx, keyOf(cilium.Namespace, cilium.ConfigMap), cm); err != nil || cm.Data["kube-proxy-replacement"] != "false" {
		t.Errorf("after the way back cilium-config kube-proxy-replacement = %q (%v)", cm.Data["kube-proxy-replacement"], err)
	}
	ds := &appsv1.DaemonSet{}
	if err := env.Client.Get(ctx, keyOf("kube-system", "kube-proxy"), ds); err != nil || ds.Status.NumberAvailable != 4 {
		t.Errorf("kube-proxy after the way back: %d available (%v)", ds.Status.NumberAvailable, err)
	}
	for _, m := range c.fleet.Machines() {
		if !proxyEnabled(t, c, m.Name()) {
			t.Errorf("%s: cluster.proxy still disabled", m.Name())
		}
		if n := len(rec.Actions(m.Name())); n != 0 {
			t.Errorf("%s: %d disruptions on the way back", m.Name(), n)
		}
	}
}

// newKubeProxyCluster is newCiliumCluster with kube-proxy, as Talos
// applies it (its objects in the inventory).
func newKubeProxyCluster(t *testing.T, spec sim.Spec) *ciliumCluster {
	t.Helper()
	spec.KubeProxy = true
	c := newCiliumCluster(t, spec)
	testenv.Eventually(t, time.Minute, "Talos to apply kube-proxy", func(ctx context.Context) (bool, error) {
		tracked, err := inventory.Tracked(ctx, env.Client, inventory.KubeProxy...)
		return len(tracked) == 3, err
	})
	t.Cleanup(func() { removeKubeProxy(t) })
	return c
}

// checkKubeProxyReplaced checks the end of a switch to kube-proxy
// replacement: Cilium replaces kube-proxy, kube-proxy's objects are gone
// and out of Talos's inventory, cluster.proxy is disabled on every machine,
// and each machine rebooted exactly once.
func (c *ciliumCluster) checkKubeProxyReplaced(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	cm := &corev1.ConfigMap{}
	if err := env.Client.Get(ctx, keyOf(cilium.Namespace, cilium.ConfigMap), cm); err != nil || cm.Data["kube-proxy-replacement"] != "true" {
		t.Errorf("cilium-config kube-proxy-replacement = %q (%v)", cm.Data["kube-proxy-replacement"], err)
	}
	for _, o := range []client.Object{&appsv1.DaemonSet{}, &corev1.ServiceAccount{}} {
		if err := env.Client.Get(ctx, keyOf("kube-system", "kube-proxy"), o); !apierrors.IsNotFound(err) {
			t.Errorf("kube-proxy's %T is still there (%v)", o, err)
		}
	}
	if err := env.Client.Get(ctx, client.ObjectKey{Name: "kube-proxy"}, &rbacv1.ClusterRoleBinding{}); !apierrors.IsNotFound(err) {
		t.Errorf("kube-proxy's ClusterRoleBinding is still there (%v)", err)
	}
	if tracked, err := inventory.Tracked(ctx, env.Client, inventory.KubeProxy...); err != nil || len(tracked) > 0 {
		t.Errorf("Talos's inventory still tracks %v (%v)", tracked, err)
	}
	for _, m := range c.fleet.Machines() {
		if proxyEnabled(t, c, m.Name()) {
			t.Errorf("%s: cluster.proxy is not disabled", m.Name())
		}
		reboots := 0
		for _, a := range c.fleet.Recorder().Actions(m.Name()) {
			if a.Kind == sim.ActionReboot {
				reboots++
			}
		}
		if reboots != 1 {
			t.Errorf("%s rebooted %d times, want once", m.Name(), reboots)
		}
	}
}

// The switch to kube-proxy replacement with the controller killed at each
// of its steps, between the step's work and the status write that records
// it: Cilium's Job with replacement on (after the lend), cluster.proxy
// disabled on the machines, kube-proxy's objects removed, and a machine's
// reboot in the rolling reboot. The next controller resumes where status
// says, and the outcome is that of a switch nobody killed: one Cilium Job,
// every machine rebooted exactly once, kube-proxy gone, the proxy disabled
// everywhere, and the lock free.
func TestSwitchKubeProxyKilledAtEveryStep(t *testing.T) {
	afterStep := func(step string) func(kill func()) controllerOption {
		return func(kill func()) controllerOption {
			return func(o *app.Options, _ **rest.Config) {
				o.TestHookAfterRun = func(s operation.StepRun) {
					if s.Step == step && s.Err == nil {
						kill()
					}
				}
			}
		}
	}
	tests := []struct {
		name string
		// hook kills the first controller from inside its work: it calls kill.
		hook func(kill func()) controllerOption
		// step is where status stands once the killed controller is gone.
		step string
	}{
		{name: "Cilium with replacement on: after lending the lock to the Job", hook: afterLend, step: executor.StepCiliumJob},
		{name: "after disabling the proxy on every machine", hook: afterStep(executor.StepDisableKubeProxy), step: executor.StepDisableKubeProxy},
		{name: "after removing kube-proxy's objects", hook: afterStep(executor.StepRemoveKubeProxy), step: executor.StepRemoveKubeProxy},
		{name: "in the rolling reboot: after a reboot call", hook: afterStep(executor.StepReboot), step: executor.StepReboot},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newKubeProxyCluster(t, sim.Cluster("", 1, 1))
			holders := c.watchLockHolders()
			var killed atomic.Bool
			var first *controller
			first = c.startKillableWith(c.withImage(), tt.hook(func() {
				if killed.CompareAndSwap(false, true) {
					first.Kill()
				}
			}))
			c.create("kpr", ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, CNI: &ichorv1.CNIChange{KubeProxyReplacement: ptr.To(true)}})
			testenv.Eventually(t, 3*time.Minute, "the controller to be killed", func(context.Context) (bool, error) {
				return killed.Load(), nil
			})
			<-first.Exited()
			if op := c.get("kpr"); !slices.ContainsFunc(op.Status.Machines, func(m ichorv1.MachineStatus) bool { return m.Step == tt.step }) {
				t.Fatalf("the controller was killed elsewhere than at %s: %s", tt.step, boundary(op))
			}
			c.start(c.withImage())
			op := c.waitSucceeded("kpr", 5*time.Minute)

			c.checkKubeProxyReplaced(t)
			if jobs := jobsOf(t, op); len(jobs) != 1 {
				t.Errorf("the operation started %d Cilium Jobs, want 1", len(jobs))
			}
			if got := freeAgain(t, holders); got[len(got)-1] != "" {
				t.Errorf("the cluster lock is held by %q after the switch", got[len(got)-1])
			}
		})
	}
}

// proxyEnabled reads the machine's active configuration.
func proxyEnabled(t *testing.T, c *ciliumCluster, name string) bool {
	t.Helper()
	for _, m := range c.fleet.Machines() {
		if m.Name() == name {
			return m.Config().Cluster().Proxy().Enabled()
		}
	}
	t.Fatalf("no machine %s", name)
	return false
}

func removeKubeProxy(t testing.TB) {
	ctx := context.Background()
	bg := client.PropagationPolicy(metav1.DeletePropagationBackground)
	for _, o := range []client.Object{
		&appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy"}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy"}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: inventory.Namespace, Name: inventory.Name}},
	} {
		_ = env.Client.Delete(ctx, o, bg)
	}
	// The garbage collector deletes the DaemonSet's pods in the background,
	// maybe once the test's kubelets are gone and no longer finish a graceful
	// delete: the next test would count them among its own.
	testenv.Eventually(t, time.Minute, "kube-proxy's pods gone", func(ctx context.Context) (bool, error) {
		var pods corev1.PodList
		if err := env.Client.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-proxy"}); err != nil {
			return false, err
		}
		for i := range pods.Items {
			_ = env.Client.Delete(ctx, &pods.Items[i], client.GracePeriodSeconds(0))
		}
		return len(pods.Items) == 0, nil
	})
}

// Refused cni and ichor operations: each is Refused with a message that
// says what to do, and nothing changed: no Job, no lock, no new Helm
// revision, no machine configuration applied, no kube-proxy object gone.
// One cluster serves them all, one after the other, so each also shows
// that the refusals before it left the cluster as it was.
func TestCNIAndIchorRefusals(t *testing.T) {
	spec := sim.Cluster("", 1, 1)
	spec.KubeProxy = true
	c := newCiliumCluster(t, spec)
	testenv.Eventually(t, time.Minute, "Talos to apply kube-proxy", func(ctx context.Context) (bool, error) {
		tracked, err := inventory.Tracked(ctx, env.Client, inventory.KubeProxy...)
		return len(tracked) == 3, err
	})
	t.Cleanup(func() { removeKubeProxy(t) })
	c.start(c.withImage())
	ciliumDS := inventory.Ref("apps", "DaemonSet", cilium.Namespace, cilium.DaemonSet)
	tests := []struct {
		name  string
		spec  ichorv1.TalosOperationSpec
		setup func(t *testing.T)
		check string
		want  string
	}{
		{name: "a chart this Ichor does not ship", spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, CNI: &ichorv1.CNIChange{ChartVersion: "1.20.2"}},
			check: "CiliumChartShipped", want: "this Ichor ships the Cilium chart 1.19.6 only, not 1.20.2: leave spec.cni.chartVersion empty"},
		{name: "the mode in place", spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, CNI: &ichorv1.CNIChange{KubeProxyReplacement: ptr.To(false)}},
			check: "ActionAllowed", want: "the cluster already runs kube-proxy: leave spec.cni.kubeProxyReplacement unset"},
		{name: "Cilium in Talos's inventory", spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI},
			setup: func(t *testing.T) {
				patchInventory(t, map[string]any{inventory.Key(ciliumDS): ""})
				t.Cleanup(func() { patchInventory(t, map[string]any{inventory.Key(ciliumDS): nil}) })
			},
			check: "ActionAllowed", want: "Cilium is tracked in Talos's bootstrap inventory (ConfigMap kube-system/talos-bootstrap-manifests-inventory, key " +
				inventory.Key(ciliumDS) + "): the next `talosctl upgrade-k8s` would prune it. Remove Cilium's keys"},
		{name: "an Ichor pre-release", spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindIchor, Ichor: &ichorv1.IchorUpgrade{Version: "v0.2.0-rc.1"}},
			check: "IchorVersionFinal", want: "Ichor v0.2.0-rc.1 is not a final release; pick a release such as v0.2.0"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.setup != nil {
				tt.setup(t)
			}
			name := fmt.Sprintf("refused-%d", i)
			c.create(name, tt.spec)
			op := c.waitFor(name, "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
			cond := meta.FindStatusCondition(op.Status.Conditions, tt.check)
			if cond == nil || cond.Status != metav1.ConditionFalse || !strings.Contains(cond.Message, tt.want) {
				t.Errorf("condition %s = %+v, want a message with %q; all: %+v", tt.check, cond, tt.want, op.Status.Conditions)
			}
			if jobs := jobsOf(t, op); len(jobs) != 0 {
				t.Errorf("a refused operation started %d Jobs", len(jobs))
			}
			if h := c.lockHolder(); !h.Free() {
				t.Errorf("a refused operation holds the lock: %q", h.Holder.Identity)
			}
			var revisions corev1.SecretList
			if err := env.Client.List(context.Background(), &revisions, client.InNamespace(cilium.Namespace), client.MatchingLabels{"owner": "helm", "name": cilium.Release}); err != nil || len(revisions.Items) != 1 {
				t.Errorf("the Cilium release has %d revisions (%v), want the user's one", len(revisions.Items), err)
			}
			if n := c.fleet.Recorder().Calls("", "ApplyConfiguration"); n != 0 {
				t.Errorf("a refused operation applied %d machine configurations", n)
			}
			if tracked, err := inventory.Tracked(context.Background(), env.Client, inventory.KubeProxy...); err != nil || len(tracked) != 3 {
				t.Errorf("kube-proxy is tracked as %v (%v), want all 3 of its objects", tracked, err)
			}
		})
	}
}

// patchInventory merges data into Talos's inventory ConfigMap (nil removes a key).
func patchInventory(t *testing.T, data map[string]any) {
	t.Helper()
	patch, _ := json.Marshal(map[string]any{"data": data})
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: inventory.Namespace, Name: inventory.Name}}
	if err := env.Client.Patch(context.Background(), cm, client.RawPatch(types.MergePatchType, patch)); err != nil {
		t.Fatal(err)
	}
}
