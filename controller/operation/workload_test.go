package operation_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/kubectl/pkg/util/podutils"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// The tests in this file run in a working cluster: the real
// kube-controller-manager and kube-scheduler (TestMain), the simulated
// machines' kubelets running the pods.

func labels(app string) map[string]string { return map[string]string{"app": app} }

// podTemplate is a pod of app that becomes ready readyAfter after it starts.
func podTemplate(app string, readyAfter time.Duration) corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: labels(app), Annotations: map[string]string{sim.ReadyAfterAnnotation: readyAfter.String()}},
		Spec: corev1.PodSpec{
			Containers:                    []corev1.Container{{Name: app, Image: "registry.k8s.io/pause:3.10"}},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
		},
	}
}

func (c *cluster) deployment(app string, replicas int32, readyAfter time.Duration) {
	c.t.Helper()
	c.createObject(deploymentOf(c.ns, app, replicas, readyAfter))
}

func deploymentOf(ns, app string, replicas int32, readyAfter time.Duration) *appsv1.Deployment {
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: app},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas, Selector: &metav1.LabelSelector{MatchLabels: labels(app)}, Template: podTemplate(app, readyAfter),
		},
	}
}

func (c *cluster) statefulSet(app string, replicas int32, readyAfter time.Duration) {
	c.t.Helper()
	s := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: app},
		Spec: appsv1.StatefulSetSpec{
			Replicas: &replicas, Selector: &metav1.LabelSelector{MatchLabels: labels(app)}, Template: podTemplate(app, readyAfter),
			ServiceName: app, PodManagementPolicy: appsv1.ParallelPodManagement,
		},
	}
	c.createObject(s)
}

func (c *cluster) daemonSet(app string) {
	c.t.Helper()
	c.createObject(daemonSetOf(c.ns, app))
}

func daemonSetOf(ns, app string) *appsv1.DaemonSet {
	return &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: app},
		Spec:       appsv1.DaemonSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels(app)}, Template: podTemplate(app, 0)},
	}
}

// pdb guards app with minAvailable or (when min is negative) maxUnavailable -min.
func (c *cluster) pdb(app string, min int) {
	c.t.Helper()
	c.createObject(pdbOf(c.ns, app, min))
}

func pdbOf(ns, app string, min int) *policyv1.PodDisruptionBudget {
	p := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: app},
		Spec:       policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels(app)}},
	}
	if min >= 0 {
		p.Spec.MinAvailable = ptr.To(intstr.FromInt(min))
	} else {
		p.Spec.MaxUnavailable = ptr.To(intstr.FromInt(-min))
	}
	return p
}

func (c *cluster) createObject(obj client.Object) {
	c.t.Helper()
	if err := env.Client.Create(context.Background(), obj); err != nil {
		c.t.Fatalf("create %T %s: %v", obj, obj.GetName(), err)
	}
}

func (c *cluster) pods(app string) []corev1.Pod {
	c.t.Helper()
	return podsOf(c.t, env.Client, c.ns, app)
}

func podsOf(t testing.TB, cl client.Client, ns, app string) []corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	if err := cl.List(context.Background(), &pods, client.InNamespace(ns), client.MatchingLabels(labels(app))); err != nil {
		t.Fatal(err)
	}
	return pods.Items
}

// healthy is a pod the disruption controller counts: Ready and not terminating.
func healthy(p *corev1.Pod) bool {
	return p.DeletionTimestamp == nil && podutils.IsPodReady(p)
}

// waitHealthy waits until app has n healthy pods.
func (c *cluster) waitHealthy(app string, n int) {
	c.t.Helper()
	waitHealthy(c.t, env.Client, c.ns, app, n)
}

func waitHealthy(t testing.TB, cl client.Client, ns, app string, n int) {
	t.Helper()
	testenv.Eventually(t, time.Minute, fmt.Sprintf("%d healthy %s pods", n, app), func(ctx context.Context) (bool, error) {
		var pods corev1.PodList
		if err := cl.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(labels(app))); err != nil {
			return false, nil //nolint:nilerr // a hosted fleet's endpoint may be between API servers
		}
		ok := 0
		for _, p := range pods.Items {
			if healthy(&p) {
				ok++
			}
		}
		return ok == n, nil
	})
}

// setCordon cordons or uncordons a Node as an operator does.
func (c *cluster) setCordon(node string, on bool) {
	c.t.Helper()
	c.patchNode(node, fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on))
}

// readiness follows the pods of the test's namespace and keeps, per app,
// the fewest healthy pods seen since it started, and the pods made since.
type readiness struct {
	mu      sync.Mutex
	pods    map[string]*corev1.Pod
	fewest  map[string]int
	started bool
	// made are the names of each app's pods first seen since it started,
	// that is not among those there then (initial).
	made    map[string]map[string]bool
	initial map[string]bool
	// worst says, for each app, which of its pods were not healthy when it
	// had its fewest healthy ones, and why: a broken budget's message.
	worst map[string]string
}

func (c *cluster) followReadiness(apps ...string) *readiness {
	c.t.Helper()
	return followReadiness(c.t, env.Kube, c.ns, apps...)
}

// followReadiness follows the pods of ns from an informer, which lists
// again when its watch breaks (a hosted fleet's API servers restart): a
// change within such a gap is not seen.
func followReadiness(t testing.TB, kc kubernetes.Interface, ns string, apps ...string) *readiness {
	t.Helper()
	r := &readiness{pods: map[string]*corev1.Pod{}, fewest: map[string]int{}, made: map[string]map[string]bool{}, worst: map[string]string{}}
	for _, app := range apps {
		r.fewest[app] = -1
		r.made[app] = map[string]bool{}
	}
	inf := informers.NewSharedInformerFactoryWithOptions(kc, 0, informers.WithNamespace(ns)).Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { r.seen(obj, false) },
		UpdateFunc: func(_, obj any) { r.seen(obj, false) },
		DeleteFunc: func(obj any) { r.seen(obj, true) },
	}); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go inf.Run(stop)
	if !toolscache.WaitForCacheSync(stop, inf.HasSynced) {
		t.Fatal("the pods' informer never synced")
	}
	r.mu.Lock()
	r.started = true
	r.initial = map[string]bool{}
	for name := range r.pods {
		r.initial[name] = true
	}
	r.count()
	r.mu.Unlock()
	return r
}

// seen records a pod's change, and the fewest healthy pods once started.
func (r *readiness) seen(obj any, gone bool) {
	if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj, gone = d.Obj, true
	}
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if gone {
		delete(r.pods, p.Name)
	} else {
		r.pods[p.Name] = p
	}
	if r.started {
		if made := r.made[p.Labels["app"]]; made != nil && !r.initial[p.Name] {
			made[p.Name] = true
		}
		r.count()
	}
}

func (r *readiness) count() {
	counts := map[string]int{}
	for _, q := range r.pods {
		if healthy(q) {
			counts[q.Labels["app"]]++
		}
	}
	for app, n := range r.fewest {
		if n < 0 || counts[app] < n {
			r.fewest[app] = counts[app]
			r.worst[app] = r.unhealthy(app)
		}
	}
}

// unhealthy names app's pods that are not healthy, each with its node and
// its Ready condition (or that it is being deleted).
func (r *readiness) unhealthy(app string) string {
	var out []string
	for _, p := range r.pods {
		if p.Labels["app"] != app || healthy(p) {
			continue
		}
		why := "no Ready condition"
		if p.DeletionTimestamp != nil {
			why = "being deleted"
		} else if i := slices.IndexFunc(p.Status.Conditions, func(c corev1.PodCondition) bool { return c.Type == corev1.PodReady }); i >= 0 {
			c := p.Status.Conditions[i]
			why = fmt.Sprintf("Ready %s %s %s", c.Status, c.Reason, c.Message)
		}
		out = append(out, fmt.Sprintf("%s on %q: %s", p.Name, p.Spec.NodeName, why))
	}
	slices.Sort(out)
	return strings.Join(out, "; ")
}

// broken says how app's fewest healthy pods came about, for a test's
// message when that broke its budget.
func (r *readiness) broken(app string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return fmt.Sprintf("%d healthy pods at one point (not healthy then: %s)", r.fewest[app], r.worst[app])
}

func (r *readiness) least(app string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fewest[app]
}

// madeSince is how many pods of app were made since it started (a pod
// made and gone within a gap of the watch is not counted).
func (r *readiness) madeSince(app string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.made[app])
}

// watchMessages records every message the operation gave the machine.
func (c *cluster) watchMessages(name, machine string) func() []string {
	c.t.Helper()
	wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		c.t.Fatal(err)
	}
	w, err := wc.Watch(context.Background(), &ichorv1.TalosOperationList{}, client.InNamespace(c.ns))
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(w.Stop)
	var mu sync.Mutex
	var msgs []string
	go func() {
		for ev := range w.ResultChan() {
			op, ok := ev.Object.(*ichorv1.TalosOperation)
			if !ok || op.Name != name {
				continue
			}
			if m := entryOf(op, machine); m != nil && m.Message != "" {
				mu.Lock()
				msgs = append(msgs, m.Step+": "+m.Message)
				mu.Unlock()
			}
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), msgs...)
	}
}

// TestDrainWaitsForBudget: a drain that a PodDisruptionBudget holds back
// waits until the replacement (made by the real ReplicaSet controller,
// placed on another machine by the real scheduler) is Ready, then
// finishes; the machine's message says which budget it waits for and for
// how many pods; the budget is never broken.
func TestDrainWaitsForBudget(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w1, w2, w3 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name(), c.fleet.Machines()[3].Name()
	// Both replicas on w1: the others are cordoned while they are placed.
	c.setCordon(w2, true)
	c.setCordon(w3, true)
	c.deployment("web", 2, 2*time.Second)
	c.pdb("web", 1)
	c.waitHealthy("web", 2)
	c.setCordon(w2, false)
	c.setCordon(w3, false)
	ready := c.followReadiness("web")
	since := time.Now()
	c.start(as(testenv.AuditedUser, "system:masters"))
	messages := c.watchMessages("reboot", w1)
	c.create("reboot", rebootSpec(w1))
	c.waitSucceeded("reboot", 2*time.Minute)
	noPodLists(t, since)

	// The budget's expected pods may count the first eviction's replacement
	// before it is Ready (1 of 3), or not yet (1 of 2): what matters is that
	// one healthy pod held the second eviction.
	want := regexp.MustCompile(`PodDisruptionBudget ` + regexp.QuoteMeta(c.ns) + `/web \(minAvailable 1, 1 of [23] healthy\) holds 1 pod`)
	found := false
	for _, m := range messages() {
		found = found || strings.HasPrefix(m, executor.StepDrain+": ") && want.MatchString(m)
	}
	if !found {
		t.Errorf("the drain never said it waited for the budget (%q); its messages: %q", want, messages())
	}
	if n := ready.least("web"); n < 1 {
		t.Errorf("web's budget (minAvailable 1) was broken: %s", ready.broken("web"))
	}
	c.waitHealthy("web", 2)
	for _, p := range c.pods("web") {
		if p.Spec.NodeName == w1 {
			t.Errorf("pod %s is back on the drained %s", p.Name, w1)
		}
	}
}

// noPodLists fails t if the controller, running as testenv.AuditedUser,
// sent a LIST of pods since: a drain reads the machine's pods as a
// watch-list (a watch of every namespace's), which the API server answers
// from its watch cache.
func noPodLists(t *testing.T, since time.Time) {
	t.Helper()
	reqs, err := env.AuditedRequests()
	if err != nil {
		t.Fatal(err)
	}
	watched := false
	for _, r := range reqs {
		if r.Resource != "pods" || r.At.Before(since) {
			continue
		}
		if r.Verb == "list" {
			t.Errorf("the controller listed pods (namespace %q) at %s: a drain reads a machine's pods as a watch-list", r.Namespace, r.At)
		}
		watched = watched || r.Verb == "watch" && r.Namespace == ""
	}
	if !watched {
		t.Error("the controller never watched the pods of every namespace: did the drain read the machine's pods?")
	}
}

// TestDrainReadsAsOfItsCordon: a drain lists the machine's pods as of its
// Node cordoned (resourceVersionMatch NotOlderThan the Node's version), not
// as of now, which makes the API server's watch cache wait for etcd's next
// progress notification whenever another read has just asked for one. The
// version it names is one at which the Node was cordoned, and the pod that
// was on it is evicted.
func TestDrainReadsAsOfItsCordon(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	worker, before := c.webOnTheWorker()
	versions := nodeHistory(t, worker)
	var mu sync.Mutex
	var reads []url.Values
	c.start(beforeRequest(func(req *http.Request) bool {
		return req.URL.Path == "/api/v1/pods" && req.URL.Query().Get("watch") == "true"
	}, func(req *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		reads = append(reads, req.URL.Query())
	}))
	c.create("reboot", rebootSpec(worker))
	c.waitSucceeded("reboot", 2*time.Minute)

	mu.Lock()
	defer mu.Unlock()
	if len(reads) == 0 {
		t.Fatal("the controller never read the pods of every namespace: did the drain run?")
	}
	for _, q := range reads {
		if m := q.Get("resourceVersionMatch"); m != string(metav1.ResourceVersionMatchNotOlderThan) {
			t.Errorf("the drain read its pods with resourceVersionMatch %q, want %s", m, metav1.ResourceVersionMatchNotOlderThan)
		}
		at := nodeAt(t, versions(), q.Get("resourceVersion"))
		if !at.Spec.Unschedulable {
			t.Errorf("the drain read its pods as of resourceVersion %q, when %s (version %s) was not cordoned", q.Get("resourceVersion"), worker, at.ResourceVersion)
		}
	}
	for _, p := range c.pods("web") {
		if p.UID == before.UID {
			t.Errorf("web's pod %s is still there after the drain", p.Name)
		}
	}
}

// TestDrainFollowsItsCordon: the Confirm of the cluster lock made before a
// run's cordon covers the drain that follows it in the same run, as it
// covers config's cordon and drain, one step: with every write of the
// Lease held at the controller's transport from the moment the Node is
// cordoned, the pod on it is evicted all the same.
func TestDrainFollowsItsCordon(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	worker, pod := c.webOnTheWorker()
	hold, whileHeld := holdingFirst(func(req *http.Request) bool {
		n := &corev1.Node{}
		return req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/leases/"+ichorv1.LockLeaseName) &&
			env.Client.Get(context.Background(), keyOfNode(worker), n) == nil && n.Spec.Unschedulable
	}, func(*http.Request) bool { return evictedWithin(pod, 30*time.Second) })
	c.start(hold)
	c.create("reboot", rebootSpec(worker))
	select {
	case ok := <-whileHeld:
		if !ok {
			t.Errorf("web's pod on %s not evicted 30 s into the held Lease write that followed the cordon: the drain waited for a Confirm of its own", worker)
		}
	case <-time.After(3 * time.Minute):
		t.Fatal("the controller wrote no Lease after the cordon")
	}
	c.waitSucceeded("reboot", 2*time.Minute)
}

// webOnTheWorker runs one pod of a Deployment web on a fleet of a control
// plane and a worker, where it lands on the worker (the control plane is
// tainted), and returns the worker and the pod.
func (c *cluster) webOnTheWorker() (string, corev1.Pod) {
	c.t.Helper()
	worker := c.fleet.Machines()[1].Name()
	c.deployment("web", 1, 0)
	c.waitHealthy("web", 1)
	pod := c.pods("web")[0]
	if pod.Spec.NodeName != worker {
		c.t.Fatalf("web's pod is on %s, want the worker %s", pod.Spec.NodeName, worker)
	}
	return worker, pod
}

// evictedWithin reports whether pod is gone, or going, within d.
func evictedWithin(pod corev1.Pod, d time.Duration) bool {
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, d, true, func(ctx context.Context) (bool, error) {
		p := &corev1.Pod{}
		err := env.Client.Get(ctx, client.ObjectKeyFromObject(&pod), p)
		return apierrors.IsNotFound(err) || err == nil && (p.UID != pod.UID || p.DeletionTimestamp != nil), nil
	})
	return err == nil
}

// nodeHistory follows the named Node from now and returns the versions of
// it seen so far: the one it has now, then each change.
func nodeHistory(t *testing.T, name string) func() []corev1.Node {
	t.Helper()
	cs := kubernetes.NewForConfigOrDie(env.Config)
	byName := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()}
	list, err := cs.CoreV1().Nodes().List(context.Background(), byName)
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("read node %s: %v (%d found)", name, err, len(list.Items))
	}
	byName.ResourceVersion = list.ResourceVersion
	w, err := cs.CoreV1().Nodes().Watch(context.Background(), byName)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Stop)
	var mu sync.Mutex
	seen := []corev1.Node{list.Items[0]}
	go func() {
		for ev := range w.ResultChan() {
			if n, ok := ev.Object.(*corev1.Node); ok {
				mu.Lock()
				seen = append(seen, *n)
				mu.Unlock()
			}
		}
	}()
	return func() []corev1.Node {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

// nodeAt is the Node as it was at resourceVersion rv: the last of versions
// not after it. Versions are etcd's revisions here, so they compare as
// numbers.
func nodeAt(t *testing.T, versions []corev1.Node, rv string) corev1.Node {
	t.Helper()
	at, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		t.Fatalf("resourceVersion %q: %v", rv, err)
	}
	var found *corev1.Node
	for i := range versions {
		v, err := strconv.ParseUint(versions[i].ResourceVersion, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if v <= at {
			found = &versions[i]
		}
	}
	if found == nil {
		t.Fatalf("no version of the Node at or before resourceVersion %s was seen", rv)
	}
	return *found
}

// TestDrainTimeout: a drain that cannot finish in time (the budget allows
// no eviction at all) fails the step, or, with onTimeout: force, deletes
// the pods that are left and goes on.
func TestDrainTimeout(t *testing.T) {
	for _, tt := range []struct {
		name      string
		onTimeout ichorv1.DrainTimeoutAction
	}{
		{"fail", ichorv1.DrainFail},
		{"force", ichorv1.DrainForce},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 2))
			w1, w2 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
			c.setCordon(w2, true)
			c.deployment("db", 1, 0)
			c.pdb("db", 1)
			c.waitHealthy("db", 1)
			c.setCordon(w2, false)
			c.start()
			spec := rebootSpec(w1)
			spec.Drain = &ichorv1.Drain{Timeout: &metav1.Duration{Duration: 3 * time.Second}, OnTimeout: tt.onTimeout}
			c.create("reboot", spec)
			if tt.onTimeout == ichorv1.DrainFail {
				op := c.waitFor("reboot", "to fail its drain", time.Minute, (*ichorv1.TalosOperation).StepFailed)
				if op.Status.FailureReason != "DrainFailed" || entryOf(op, w1).Step != executor.StepDrain {
					t.Fatalf("failed with %s on %s: %s", op.Status.FailureReason, entryOf(op, w1).Step, op.Status.Message)
				}
				if c.fleet.Recorder().Calls(w1, "Reboot") != 0 {
					t.Fatal("the machine was rebooted after its drain failed")
				}
				return
			}
			c.waitSucceeded("reboot", time.Minute)
			c.waitHealthy("db", 1)
			if p := c.pods("db"); len(p) != 1 || p[0].Spec.NodeName != w2 {
				t.Errorf("after a forced drain the db pod should run on %s: %+v", w2, p)
			}
		})
	}
}

// TestUpgradeKeepsBudgets: during a whole Talos upgrade of a cluster with
// workloads (a Deployment and a StatefulSet, each with a budget, and a
// DaemonSet), no budget is ever broken, judged from the pods' readiness
// over time as the API server saw it.
func TestUpgradeKeepsBudgets(t *testing.T) {
	spec := sim.Cluster("", 1, 3)
	spec.Durations.Reboot = 200 * time.Millisecond
	c := newCluster(t, spec)
	c.deployment("web", 4, time.Second)
	c.pdb("web", 3)
	c.statefulSet("db", 3, time.Second)
	c.pdb("db", -1)
	c.daemonSet("agent")
	c.waitHealthy("web", 4)
	c.waitHealthy("db", 3)
	c.waitHealthy("agent", 3)
	ready := c.followReadiness("web", "db")
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitSucceeded("upgrade", 5*time.Minute)
	if n := ready.least("web"); n < 3 {
		t.Errorf("web's budget (minAvailable 3) was broken: %s", ready.broken("web"))
	}
	if n := ready.least("db"); n < 2 {
		t.Errorf("db's budget (maxUnavailable 1 of 3) was broken: %s", ready.broken("db"))
	}
	for _, m := range c.fleet.Machines() {
		if m.Version() != "v1.13.7" {
			t.Errorf("%s runs %s", m.Name(), m.Version())
		}
	}
	c.waitHealthy("web", 4)
	c.waitHealthy("db", 3)
}

// TestJobRunsIchor: a Job of Ichor's image runs the real ichor-controller
// binary as its ServiceAccount: its init container takes the cluster lock
// under the Job's identity and its container releases it; the Job
// completes (the real Job controller says so).
func TestJobRunsIchor(t *testing.T) {
	spec := sim.Cluster("", 1, 1)
	spec.Kubelet.Binaries = testcluster.IchorBinaries(t, env)
	c := newCluster(t, spec)
	identity := "job/" + c.ns + "/take-lock"
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "installer"}}
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: "lock"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "list", "watch", "create", "update"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: "lock"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "lock"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "installer", Namespace: c.ns}}}
	// It reads its own Job, and judges the holder and the waiters before it
	// from their objects: operations, Nodes, Jobs.
	reader := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: c.ns + "-lock-taker"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{"batch"}, Resources: []string{"jobs"}, Verbs: []string{"get"}},
			{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
			{APIGroups: []string{ichorv1.GroupVersion.Group}, Resources: []string{"talosoperations"}, Verbs: []string{"get", "list"}}}}
	readerBinding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: c.ns + "-lock-taker"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: reader.Name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "installer", Namespace: c.ns}}}
	for _, o := range []client.Object{reader, readerBinding} {
		c.createObject(o)
		c.t.Cleanup(func() { _ = env.Client.Delete(context.Background(), o) })
	}
	for _, o := range []client.Object{sa, role, binding} {
		c.createObject(o)
	}
	holders := c.watchLockHolders()
	lockCmd := func(verb string) corev1.Container {
		return corev1.Container{
			Name: verb, Image: "ghcr.io/maesh-dev/ichor-controller:v0.1.0", Command: []string{"/ichor-controller"},
			Args:                     []string{"lock", verb, "--identity", "job/$(NAMESPACE)/take-lock", "--namespace", c.ctrlNS},
			Env:                      []corev1.EnvVar{{Name: "NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}}},
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		}
	}
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "take-lock"},
		Spec: batchv1.JobSpec{
			BackoffLimit: ptr.To[int32](0),
			Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				ServiceAccountName: "installer", RestartPolicy: corev1.RestartPolicyNever,
				InitContainers: []corev1.Container{lockCmd("acquire")},
				Containers:     []corev1.Container{lockCmd("release")},
			}},
		},
	}
	c.createObject(job)
	testenv.Eventually(t, 2*time.Minute, "the Job to complete", func(ctx context.Context) (bool, error) {
		var j batchv1.Job
		if err := env.Client.Get(ctx, keyOf(c.ns, "take-lock"), &j); err != nil {
			return false, err
		}
		for _, cond := range j.Status.Conditions {
			if cond.Type == batchv1.JobFailed && cond.Status == corev1.ConditionTrue {
				return false, fmt.Errorf("the Job failed: %s", cond.Message)
			}
		}
		return j.Status.Succeeded == 1, nil
	})
	if got := holders(); len(got) != 2 || got[0] != identity || got[1] != "" {
		t.Fatalf("the cluster lock's holders over time: %q; want %q then free", got, identity)
	}
}

// watchLockHolders records each holder the cluster lock Lease had, from
// the first.
func (c *cluster) watchLockHolders() func() []string {
	c.t.Helper()
	w, err := env.Kube.CoordinationV1().Leases(c.ctrlNS).Watch(context.Background(), metav1.ListOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(w.Stop)
	var mu sync.Mutex
	var holders []string
	go func() {
		for ev := range w.ResultChan() {
			l, ok := ev.Object.(*coordinationv1.Lease)
			if !ok || l.Name != ichorv1.LockLeaseName {
				continue
			}
			h := ptr.Deref(l.Spec.HolderIdentity, "")
			mu.Lock()
			// The Lease may be created free first (the membership baseline).
			if (len(holders) == 0 && h != "") || (len(holders) > 0 && holders[len(holders)-1] != h) {
				holders = append(holders, h)
			}
			mu.Unlock()
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), holders...)
	}
}

// freeAgain waits until the holders that watchLockHolders records end with
// the lock free, and returns them: an operation lets go of the lock right
// after it writes Succeeded, a moment after waitSucceeded has seen that.
func freeAgain(t testing.TB, holders func() []string) []string {
	t.Helper()
	var got []string
	testenv.Eventually(t, time.Minute, "the cluster lock let go", func(context.Context) (bool, error) {
		got = holders()
		return len(got) > 0 && got[len(got)-1] == "", nil
	})
	return got
}

// TestMachineStaysDown: a machine that does not come back from a reboot
// stops renewing its Node Lease, the real node-lifecycle controller marks
// its Node Unknown and taints it unreachable, and Ichor's wait for the
// machine fails with that reason in its message.
func TestMachineStaysDown(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	defer w.Inject(sim.Fault{Kind: sim.FaultNoReturn})()
	// A reboot wait shorter than the step's 15 minutes, long enough for
	// the node-lifecycle controller's grace period.
	c.start(shorterWait(executor.StepRebooted, testenv.NodeGracePeriod+20*time.Second))
	c.create("reboot", rebootSpec(w.Name()))
	testenv.Eventually(t, time.Minute, "the node-lifecycle controller to mark "+w.Name()+" Unknown and taint it", func(ctx context.Context) (bool, error) {
		var n corev1.Node
		if err := env.Client.Get(ctx, keyOfNode(w.Name()), &n); err != nil {
			return false, err
		}
		unknown, tainted := false, false
		for _, cond := range n.Status.Conditions {
			unknown = unknown || cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionUnknown && cond.Reason == "NodeStatusUnknown"
		}
		for _, taint := range n.Spec.Taints {
			tainted = tainted || taint.Key == corev1.TaintNodeUnreachable
		}
		return unknown && tainted, nil
	})
	op := c.waitFor("reboot", "to fail waiting for the machine", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	if op.Status.FailureReason != "WaitRebootedFailed" || !strings.Contains(op.Status.Message, "Node Ready=Unknown: NodeStatusUnknown: Kubelet stopped posting node status.") {
		t.Fatalf("failed with %s: %s", op.Status.FailureReason, op.Status.Message)
	}
}

// shorterWait gives the named step another timeout, for a test that waits
// for it to run out.
func shorterWait(step string, d time.Duration) controllerOption {
	return func(o *app.Options, _ **rest.Config) {
		out := executor.Registry{}
		for kind, e := range o.Executors {
			out[kind] = timeoutOf{e, step, d}
		}
		o.Executors = out
	}
}

type timeoutOf struct {
	executor.Executor
	step    string
	timeout time.Duration
}

func (t timeoutOf) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []executor.Step {
	steps := t.Executor.Steps(op, m)
	for i := range steps {
		if steps[i].Name == t.step {
			steps[i].Timeout = t.timeout
		}
	}
	return steps
}

// LockIdentity forwards to the wrapped executor when it has one.
func (t timeoutOf) LockIdentity(op *ichorv1.TalosOperation, role ichorv1.MachineRole) string {
	if li, ok := t.Executor.(executor.LockIdentifier); ok {
		return li.LockIdentity(op, role)
	}
	return ""
}
