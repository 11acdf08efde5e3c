package operation_test

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"google.golang.org/grpc/codes"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// withStepTimeout bounds the steps that set no timeout of their own.
func withStepTimeout(d time.Duration) controllerOption {
	return func(o *app.Options, _ **rest.Config) { o.StepTimeout = d }
}

// podOn runs a pod named name on the Node, for drains to move. It reports
// the pod Running, as its kubelet would: the API server lets evictions of
// pods that do not run ignore their disruption budgets.
func (c *cluster) podOn(node, name string) {
	c.t.Helper()
	ctx := context.Background()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}
	if err := env.Client.Create(ctx, pod); err != nil {
		c.t.Fatal(err)
	}
	// The Node's name comes back in the next test's fleet: so must not the pod.
	c.t.Cleanup(func() { _ = env.Client.Delete(context.Background(), pod, client.GracePeriodSeconds(0)) })
	// The simulated kubelet writes the pod's status too: write on the latest.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			return err
		}
		pod.Status.Phase = corev1.PodRunning
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		return env.Client.Status().Update(ctx, pod)
	})
	if err != nil {
		c.t.Fatal(err)
	}
}

// budget puts a PodDisruptionBudget named name over the pod app: with no
// disruption controller to observe it, the API server refuses every
// eviction it covers. It returns the function that deletes it.
func (c *cluster) budget(name, app string) (remove func()) {
	c.t.Helper()
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name},
		Spec: policyv1.PodDisruptionBudgetSpec{MinAvailable: ptrTo(intstr.FromInt32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": app}}}}
	if err := env.Client.Create(context.Background(), pdb); err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { _ = env.Client.Delete(context.Background(), pdb) })
	return func() {
		c.t.Helper()
		if err := env.Client.Delete(context.Background(), pdb); err != nil {
			c.t.Fatal(err)
		}
	}
}

func ptrTo[T any](v T) *T { return &v }

// holdDrain keeps the drain of node going until the returned function is
// called: a pod whose eviction a PodDisruptionBudget refuses.
func (c *cluster) holdDrain(node string) (release func()) {
	c.podOn(node, "held")
	return c.budget("held", "held")
}

// atStep waits until the operation's only machine is in progress at step.
func (c *cluster) atStep(name, step string) {
	c.t.Helper()
	c.waitFor(name, "to reach "+step, time.Minute, func(op *ichorv1.TalosOperation) bool {
		return len(op.Status.Machines) == 1 && op.Status.Machines[0].Phase == ichorv1.MachineInProgress && op.Status.Machines[0].Step == step
	})
}

func (c *cluster) waitFailed(name, reason string) *ichorv1.TalosOperation {
	c.t.Helper()
	return c.waitFor(name, "to fail with "+reason, time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Succeeded() {
			c.t.Fatalf("%s succeeded; want it to fail with %s", name, reason)
		}
		return op.Status.FailureReason == reason
	})
}

// TestEtcdCheckedRightBeforeTheCall: etcd turning unhealthy during a control
// plane's drain, after the early check passed, stops the reboot: the check
// that counts comes right before the call. A retry, once etcd is healthy,
// reboots it once.
func TestEtcdCheckedRightBeforeTheCall(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 0))
	cp := c.fleet.ControlPlanes()[1]
	release := c.holdDrain(cp.Name())
	c.start()
	c.create("reboot", rebootSpec(cp.Name()))
	c.atStep("reboot", "drain")
	healthy := c.fleet.ControlPlanes()[2].Inject(sim.Fault{Kind: sim.FaultEtcdUnhealthy})
	release()
	op := c.waitFailed("reboot", "EtcdUnhealthy")
	if m := op.Status.Machines[0]; m.Step != "reboot" {
		t.Errorf("failed at step %s, want reboot", m.Step)
	}
	if n := c.fleet.Recorder().Calls(cp.Name(), "MachineService/Reboot"); n != 0 {
		t.Fatalf("%s was rebooted %d times while etcd was unhealthy", cp.Name(), n)
	}
	healthy()
	c.kubectl("annotate", "talosoperation", "reboot", ichorv1.RetryAnnotation+"=true")
	c.waitSucceeded("reboot", time.Minute)
	if n := c.fleet.Recorder().Calls(cp.Name(), "MachineService/Reboot"); n != 1 {
		t.Errorf("%s was rebooted %d times after the retry, want once", cp.Name(), n)
	}
}

// TestRetryRebootsAfterAnotherReboot: a reboot that failed after it
// recorded the boot ID (etcd unhealthy) and is retried after another
// operation rebooted the machine still sends its Reboot: the new boot is
// not its own, since no run of its reboot step could have made it.
func TestRetryRebootsAfterAnotherReboot(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 0))
	cp := c.fleet.ControlPlanes()[1]
	c.start()
	healthy := c.fleet.ControlPlanes()[2].Inject(sim.Fault{Kind: sim.FaultEtcdUnhealthy})
	c.create("first", rebootSpec(cp.Name()))
	c.waitFailed("first", "EtcdUnhealthy")
	healthy()
	c.create("second", rebootSpec(cp.Name()))
	c.waitSucceeded("second", time.Minute)
	c.kubectl("annotate", "talosoperation", "first", ichorv1.RetryAnnotation+"=true")
	c.waitSucceeded("first", time.Minute)
	if n := c.fleet.Recorder().Calls(cp.Name(), "MachineService/Reboot"); n != 2 {
		t.Errorf("%s was rebooted %d times by two reboots, want 2", cp.Name(), n)
	}
}

// TestUnreachableIsNeverDone: a machine whose Talos API stops answering
// right before the reboot, shutdown or reset is not taken as done: the step
// keeps looking, and once the machine answers it makes the call, once.
func TestUnreachableIsNeverDone(t *testing.T) {
	tests := []struct {
		action ichorv1.NodeActionType
		method string
		done   func(m *sim.Machine, bootBefore string) bool
	}{
		{ichorv1.NodeReboot, "MachineService/Reboot", func(m *sim.Machine, before string) bool { return m.BootID() != before }},
		{ichorv1.NodeShutdown, "MachineService/Shutdown", func(m *sim.Machine, _ string) bool { return m.Off() }},
		{ichorv1.NodeReset, "MachineService/Reset", func(m *sim.Machine, _ string) bool { return m.Off() }},
	}
	for _, tt := range tests {
		t.Run(string(tt.action), func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 1))
			w := c.fleet.Machines()[1]
			release := c.holdDrain(w.Name())
			c.start()
			before := w.BootID()
			c.create("action", nodeSpec(w.Name(), tt.action))
			c.atStep("action", "drain")
			rec := c.fleet.Recorder()
			asked := rec.Calls(w.Name(), "*")
			answers := w.Inject(sim.Fault{Kind: sim.FaultError, Method: "*", Code: codes.Unavailable})
			release()
			testenv.Eventually(t, time.Minute, "the step to look at the silent machine again", func(context.Context) (bool, error) {
				return rec.Calls(w.Name(), "*") >= asked+4, nil
			})
			if op := c.get("action"); op.Succeeded() || rec.Calls(w.Name(), tt.method) != 0 {
				t.Fatalf("with the machine silent: phase %s, %d %s calls", op.Status.Phase, rec.Calls(w.Name(), tt.method), tt.method)
			}
			answers()
			c.waitSucceeded("action", time.Minute)
			if n := rec.Calls(w.Name(), tt.method); n != 1 || !tt.done(w, before) {
				t.Errorf("%d %s calls (want 1), done %v", n, tt.method, tt.done(w, before))
			}
		})
	}
}

// TestDrainTimeoutHonoured: spec.drain.timeout governs the drain, not the
// controller's default step timeout, which is shorter here than the drain.
func TestDrainTimeoutHonoured(t *testing.T) {
	spec := sim.Cluster("", 1, 1)
	// The pod takes this long to go once evicted.
	spec.Durations.PodGrace = 2 * time.Second
	c := newCluster(t, spec)
	w := c.fleet.Machines()[1].Name()
	c.podOn(w, "app")
	c.start(withStepTimeout(200 * time.Millisecond))
	s := rebootSpec(w)
	s.Drain = &ichorv1.Drain{Timeout: &metav1.Duration{Duration: time.Minute}}
	c.create("reboot", s)
	c.waitSucceeded("reboot", time.Minute)
}

// TestDrainForcedOnlyOnTimeout: onTimeout: force deletes pods only when the
// drain ran out of time; an eviction the API server refuses for another
// reason (two budgets over one pod) fails the step and the pod stays.
func TestDrainForcedOnlyOnTimeout(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1].Name()
	c.podOn(w, "app")
	c.budget("one", "app")
	c.budget("two", "app")
	c.start()
	s := rebootSpec(w)
	s.Drain = &ichorv1.Drain{Timeout: &metav1.Duration{Duration: time.Minute}, OnTimeout: ichorv1.DrainForce}
	c.create("reboot", s)
	op := c.waitFailed("reboot", "DrainFailed")
	if msg := op.Status.Machines[0].Message; !strings.Contains(msg, "more than one PodDisruptionBudget") {
		t.Errorf("message %q does not say why the drain failed", msg)
	}
	if err := env.Client.Get(context.Background(), keyOf(c.ns, "app"), &corev1.Pod{}); err != nil {
		t.Errorf("the pod was deleted although the drain did not time out: %v", err)
	}
	if n := c.fleet.Recorder().Calls(w, "MachineService/Reboot"); n != 0 {
		t.Errorf("%d reboots after a failed drain", n)
	}
}

// TestNodeWithoutAddress: a Node that reports no InternalIP fails the step
// with NoNodeAddress, saying so, and nothing is sent to any machine.
func TestNodeWithoutAddress(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1].Name()
	node := &corev1.Node{}
	node.Name = w
	patch := `{"status":{"addresses":[{"type":"Hostname","address":"` + w + `"}]}}`
	if err := env.Client.Status().Patch(context.Background(), node, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		t.Fatal(err)
	}
	c.start()
	c.create("reboot", rebootSpec(w))
	op := c.waitFailed("reboot", "NoNodeAddress")
	if !strings.Contains(op.Status.Message, "has no InternalIP") {
		t.Errorf("message %q", op.Status.Message)
	}
	if n := c.fleet.Recorder().Calls("", "*"); n != 0 {
		t.Errorf("%d Talos calls for a machine without an address: %v", n, c.fleet.Recorder().CallCounts())
	}
}

// TestCallNotSentTwiceAfterACrash: a controller killed between a reset's or
// shutdown's call and the status write that records it leaves the next
// controller to run the step again. That one sends nothing more, whether
// the machine still answers, stopping (Talos keeps answering while it
// stops), or is already gone: the run count status recorded before the
// call says it may have been made.
func TestCallNotSentTwiceAfterACrash(t *testing.T) {
	tests := []struct {
		name   string
		action ichorv1.NodeActionType
		step   string
		method string
		// gone: the next controller starts once the machine is off.
		gone bool
		// back: a reset with reboot, and the next controller starts once
		// the machine has come back (it went down while nobody watched).
		back bool
	}{
		{"reset, machine still stopping", ichorv1.NodeReset, "reset", "MachineService/Reset", false, false},
		{"reset, machine gone", ichorv1.NodeReset, "reset", "MachineService/Reset", true, false},
		{"reset with reboot, machine back", ichorv1.NodeReset, "reset", "MachineService/Reset", false, true},
		{"shutdown, machine still stopping", ichorv1.NodeShutdown, "shutdown", "MachineService/Shutdown", false, false},
		{"shutdown, machine gone", ichorv1.NodeShutdown, "shutdown", "MachineService/Shutdown", true, false},
		{"reboot, machine gone", ichorv1.NodeReboot, "reboot", "MachineService/Reboot", true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 1, 1)
			if !tt.gone && !tt.back {
				// Long enough for the next controller to find it stopping.
				spec.Durations.Stop = 10 * time.Second
			}
			c := newCluster(t, spec)
			w := c.fleet.Machines()[1]
			if tt.gone && tt.action == ichorv1.NodeReboot {
				w.Inject(sim.Fault{Kind: sim.FaultNoReturn})
			}
			killed := c.startKilledAfter(tt.step, func(s operation.StepRun) bool { return s.Step == tt.step })
			s := nodeSpec(w.Name(), tt.action)
			s.Drain = &ichorv1.Drain{Disabled: true}
			if tt.back {
				s.Node.Reset = &ichorv1.ResetOptions{Reboot: true}
			}
			c.create("action", s)
			killed()
			if tt.gone {
				testenv.Eventually(t, time.Minute, w.Name()+" gone", func(context.Context) (bool, error) { return w.Down(), nil })
			}
			if tt.back {
				testenv.Eventually(t, time.Minute, w.Name()+" reset and back", func(context.Context) (bool, error) {
					acts := c.fleet.Recorder().Actions(w.Name())
					return len(acts) == 1 && !acts[0].End.IsZero() && !w.Down(), nil
				})
			}
			c.start()
			if tt.gone && tt.action == ichorv1.NodeReboot {
				c.atStep("action", "wait-rebooted")
				w.ClearFaults()
			}
			c.waitSucceeded("action", time.Minute)
			if n := c.fleet.Recorder().Calls(w.Name(), tt.method); n != 1 {
				t.Errorf("%d %s calls, want 1", n, tt.method)
			}
		})
	}
}

// startKillable runs a controller that Kill stops at once, as SIGKILL
// would, with hook called after each Run step returns and before status
// records it.
func (c *cluster) startKillable(hook func(operation.StepRun)) *testcluster.Controller {
	c.t.Helper()
	o := app.Options{Namespace: c.ctrlNS, Executors: executor.Default(), TestHookAfterRun: hook}
	return testcluster.StartKillable(c.t, env.Config, o)
}

// startKilledAfter runs a controller (startKillable) that is killed right
// after the first Run step that match accepts returns without an error,
// before status records it. The function it returns waits for that kill;
// step names the step in the failure when it never comes.
func (c *cluster) startKilledAfter(step string, match func(operation.StepRun) bool) (killed func()) {
	c.t.Helper()
	var first atomic.Pointer[testcluster.Controller]
	done := make(chan struct{})
	var once sync.Once
	first.Store(c.startKillable(func(s operation.StepRun) {
		if s.Err == nil && match(s) {
			once.Do(func() { first.Load().Kill(); close(done) })
		}
	}))
	return func() {
		c.t.Helper()
		select {
		case <-done:
		case <-time.After(time.Minute):
			c.t.Fatalf("the %s step never returned", step)
		}
	}
}

// TestStepsOfAMachineBoundKind: the steps of a kind whose steps read only
// their own machine (a Talos upgrade, executor.MachineBound) see the
// operation without the other machines' entries and without the Nodes,
// so that a step in flight keeps nothing of them in memory; and an
// upgrade so run still succeeds. The same kind's steps, not declared
// bound, see every machine and every Node, as they always did.
func TestStepsOfAMachineBoundKind(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bound bool
	}{{"bound", true}, {"not declared bound", false}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 2))
			rec := &envRecorder{bound: tc.bound}
			c.start(func(o *app.Options, _ **rest.Config) {
				rec.Executor = o.Executors[ichorv1.KindTalos]
				o.Executors[ichorv1.KindTalos] = rec
			})
			c.create("upgrade", talosSpec("v1.13.7"))
			c.waitSucceeded("upgrade", 2*time.Minute)
			machines, nodes := rec.seen()
			// Not bound, a step sees the operation as persisted status has it:
			// the first, started beside the write that plans the machines, none.
			if tc.bound && (!slices.Equal(machines, []int{0}) || !slices.Equal(nodes, []int{0})) {
				t.Errorf("the steps saw %v machine entries and %v Nodes, want none", machines, nodes)
			}
			if !tc.bound && (slices.Max(machines) != 3 || !slices.Equal(nodes, []int{3})) {
				t.Errorf("the steps saw %v machine entries and %v Nodes, want all 3 Nodes and, once planned, all 3 entries", machines, nodes)
			}
		})
	}
}

// envRecorder is an executor whose steps record how many machine entries
// and Nodes their Env had; MachineBound is the wrapped executor's when
// bound, false when not.
type envRecorder struct {
	executor.Executor
	bound           bool
	mu              sync.Mutex
	machines, nodes map[int]bool
}

func (r *envRecorder) MachineBound() bool {
	mb, ok := r.Executor.(executor.MachineBound)
	return r.bound && ok && mb.MachineBound()
}

func (r *envRecorder) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []executor.Step {
	steps := r.Executor.Steps(op, m)
	for i := range steps {
		if run := steps[i].Run; run != nil {
			steps[i].Run = func(ctx context.Context, e *executor.Env) (executor.Outcome, error) {
				r.record(e)
				return run(ctx, e)
			}
		}
		if wait := steps[i].Wait; wait != nil {
			steps[i].Wait = func(ctx context.Context, e *executor.Env) (bool, executor.Outcome, error) {
				r.record(e)
				return wait(ctx, e)
			}
		}
	}
	return steps
}

func (r *envRecorder) record(e *executor.Env) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.machines == nil {
		r.machines, r.nodes = map[int]bool{}, map[int]bool{}
	}
	r.machines[len(e.Op.Status.Machines)] = true
	r.nodes[len(e.Nodes)] = true
}

// seen is the counts of machine entries and Nodes the steps saw, sorted.
func (r *envRecorder) seen() (machines, nodes []int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.machines)), slices.Sorted(maps.Keys(r.nodes))
}
