package operation_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var env *testenv.Env

// The package's world is a working cluster: the real controller manager
// (node lifecycle too: the fleets renew their Node Leases) and scheduler.
// The tests on a hosted fleet of their own (testcluster.StartHostedFleet:
// their own etcd, API servers and controllers) call t.Parallel: they are
// the package's longest, and one after another they made it the longest
// chain of make test; the tests on the shared API server run one after
// another before them.
func TestMain(m *testing.M) {
	os.Exit(testenv.Main(m, &env, testenv.With(testenv.Components{ControllerManager: true, Scheduler: true, NodeLifecycle: true})))
}

// cluster is one test's world: a simulated fleet whose Nodes live in the
// shared API server, a controller namespace with the fleet's talosconfig,
// and a namespace for the test's operations. Tests run one after another;
// each removes its Nodes and operations when it ends, so the next one's
// controller sees only its own.
type cluster struct {
	t     testing.TB
	fleet *sim.Fleet
	// ns holds the operations; ctrlNS the lock, the leader Lease and the Secret.
	ns, ctrlNS string
}

func newCluster(t testing.TB, spec sim.Spec) *cluster {
	t.Helper()
	c := newClusterWithoutTalosconfig(t, spec)
	c.writeTalosconfig()
	return c
}

// newClusterWithoutTalosconfig is newCluster without the Secret.
func newClusterWithoutTalosconfig(t testing.TB, spec sim.Spec) *cluster {
	t.Helper()
	return newClusterIn(t, spec, env.Namespace(t))
}

// newClusterIn is newCluster without the Secret, with the controller in ctrlNS.
func newClusterIn(t testing.TB, spec sim.Spec, ctrlNS string) *cluster {
	t.Helper()
	c := &cluster{t: t, ns: env.Namespace(t), ctrlNS: ctrlNS}
	c.fleet = testcluster.StartFleet(t, env, spec, c.ns)
	return c
}

func (c *cluster) writeTalosconfig() { testcluster.WriteTalosconfig(c.t, env, c.fleet, c.ctrlNS) }

// controller is one running ichor-controller, with the steps it ran.
type controller struct {
	*testcluster.Controller
	steps *stepCounter
}

type controllerOption func(*app.Options, **rest.Config)

// as runs the controller as another user (its ServiceAccount, say).
func as(user string, groups ...string) controllerOption {
	return func(_ *app.Options, cfg **rest.Config) {
		uc, err := env.User(user, groups...)
		if err != nil {
			panic(err)
		}
		*cfg = uc
	}
}

func withLeaderElection() controllerOption {
	return func(o *app.Options, _ **rest.Config) {
		o.LeaderElection = true
		o.LeaseDuration, o.RenewDeadline, o.RetryPeriod = 2*time.Second, 1500*time.Millisecond, 200*time.Millisecond
	}
}

// start runs a controller for this cluster, in-process, as ichor-controller would.
func (c *cluster) start(opts ...controllerOption) *controller {
	c.t.Helper()
	return c.startWith(testcluster.StartController, opts...)
}

// startKillableWith is start with a controller that Kill kills as SIGKILL would.
func (c *cluster) startKillableWith(opts ...controllerOption) *controller {
	c.t.Helper()
	return c.startWith(testcluster.StartKillable, opts...)
}

func (c *cluster) startWith(run func(testing.TB, *rest.Config, app.Options) *testcluster.Controller, opts ...controllerOption) *controller {
	c.t.Helper()
	steps := &stepCounter{counts: map[string]int{}}
	o := app.Options{Namespace: c.ctrlNS, Executors: countingRegistry(executor.Default(), steps)}
	cfg := rest.CopyConfig(env.Config)
	for _, opt := range opts {
		opt(&o, &cfg)
	}
	return &controller{Controller: run(c.t, cfg, o), steps: steps}
}

// stepCounter counts the steps a controller ran, to tell replicas apart.
type stepCounter struct {
	mu     sync.Mutex
	counts map[string]int
}

func (s *stepCounter) add(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.counts[key]++
}

// count is how many times key ran.
func (s *stepCounter) count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts[key]
}

func (s *stepCounter) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, v := range s.counts {
		n += v
	}
	return n
}

type counting struct {
	executor.Executor
	steps *stepCounter
}

func countingRegistry(r executor.Registry, steps *stepCounter) executor.Registry {
	out := executor.Registry{}
	for k, e := range r {
		if _, ok := e.(executor.Planner); ok {
			out[k] = countingPlanner{counting{e, steps}}
			continue
		}
		out[k] = counting{e, steps}
	}
	return out
}

// countingPlanner is counting for an executor that is a Planner.
type countingPlanner struct{ counting }

func (c countingPlanner) Plan(ctx context.Context, e *executor.Env) (string, []string) {
	return c.Executor.(executor.Planner).Plan(ctx, e)
}

func (c counting) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []executor.Step {
	steps := c.Executor.Steps(op, m)
	for i := range steps {
		s := steps[i]
		if s.Run != nil {
			run := s.Run
			steps[i].Run = func(ctx context.Context, e *executor.Env) (executor.Outcome, error) {
				c.steps.add(e.Machine.Name + "/" + s.Name)
				return run(ctx, e)
			}
		}
		if s.Wait != nil {
			wait := s.Wait
			steps[i].Wait = func(ctx context.Context, e *executor.Env) (bool, executor.Outcome, error) {
				c.steps.add(waitKey(e.Machine.Name, s.Name))
				return wait(ctx, e)
			}
		}
	}
	return steps
}

// waitKey counts the checks of a Wait step on a machine.
func waitKey(machine, step string) string { return machine + "/" + step + " (wait)" }

// Stages forwards to the wrapped executor when it is a Stager.
func (c counting) Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus {
	if s, ok := c.Executor.(executor.Stager); ok {
		return s.Stages(op)
	}
	return nil
}

// StopsMachines forwards to the wrapped executor when it has one.
func (c counting) StopsMachines() bool {
	s, ok := c.Executor.(executor.StopsMachines)
	return ok && s.StopsMachines()
}

// Ended forwards to the wrapped executor when it is an EndRecorder.
func (c counting) Ended(ctx context.Context, e *executor.Env) (executor.EndState, error) {
	if r, ok := c.Executor.(executor.EndRecorder); ok {
		return r.Ended(ctx, e)
	}
	return executor.EndState{Done: true}, nil
}

// MachineBound forwards to the wrapped executor when it has one.
func (c counting) MachineBound() bool {
	mb, ok := c.Executor.(executor.MachineBound)
	return ok && mb.MachineBound()
}

// LockIdentity forwards to the wrapped executor when it has one.
func (c counting) LockIdentity(op *ichorv1.TalosOperation, role ichorv1.MachineRole) string {
	if li, ok := c.Executor.(executor.LockIdentifier); ok {
		return li.LockIdentity(op, role)
	}
	return ""
}

// create creates an operation in the test namespace.
func (c *cluster) create(name string, spec ichorv1.TalosOperationSpec) *ichorv1.TalosOperation {
	c.t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name}, Spec: spec}
	if err := env.Client.Create(context.Background(), op); err != nil {
		c.t.Fatalf("create %s: %v", name, err)
	}
	return op
}

func (c *cluster) get(name string) *ichorv1.TalosOperation {
	c.t.Helper()
	op := &ichorv1.TalosOperation{}
	if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: c.ns, Name: name}, op); err != nil {
		c.t.Fatalf("get %s: %v", name, err)
	}
	return op
}

// waitFor waits until the named operation satisfies cond.
func (c *cluster) waitFor(name, what string, timeout time.Duration, cond func(op *ichorv1.TalosOperation) bool) *ichorv1.TalosOperation {
	c.t.Helper()
	var last *ichorv1.TalosOperation
	defer func() {
		if c.t.Failed() && last != nil {
			c.t.Logf("%s last seen: phase %s reason %s lock %s/%s failure %q message %q", name, last.Status.Phase,
				last.Status.Reason, last.Status.Lock, last.Status.LockHolder, last.Status.FailureReason, last.Status.Message)
			for _, m := range last.Status.Machines {
				c.t.Logf("  %s %s %s step=%s attempts=%d %q", m.Name, m.Role, m.Phase, m.Step, m.Attempts, m.Message)
			}
		}
	}()
	testenv.Eventually(c.t, timeout, name+" "+what, func(ctx context.Context) (bool, error) {
		op := &ichorv1.TalosOperation{}
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: c.ns, Name: name}, op); err != nil {
			return false, err
		}
		last = op
		return cond(op), nil
	})
	if last == nil {
		c.t.Fatalf("%s: never read", name)
	}
	return last
}

func (c *cluster) waitSucceeded(name string, timeout time.Duration) *ichorv1.TalosOperation {
	c.t.Helper()
	op := c.waitFor(name, "to succeed", timeout, func(op *ichorv1.TalosOperation) bool {
		if op.Failed() {
			c.t.Fatalf("%s stopped: phase %s, %s: %s", name, op.Status.Phase, op.Status.FailureReason, op.Status.Message)
		}
		return op.Succeeded()
	})
	ready := meta.FindStatusCondition(op.Status.Conditions, ichorv1.ConditionReady)
	if ready == nil || ready.Status != metav1.ConditionTrue || ready.ObservedGeneration != op.Generation {
		c.t.Errorf("%s succeeded but its Ready condition is %+v", name, ready)
	}
	return op
}

// annotate sets an annotation with the real kubectl, as an operator would.
func (c *cluster) kubectl(args ...string) string {
	c.t.Helper()
	out, _, err := env.Kubectl(context.Background(), nil, append(args, "-n", c.ns)...)
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// patchSpec merge-patches an operation's spec, as `kubectl ichor pause` does.
func (c *cluster) patchSpec(name, spec string) {
	c.t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name}}
	patch := fmt.Sprintf(`{"spec":%s}`, spec)
	if err := env.Client.Patch(context.Background(), op, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		c.t.Fatalf("patch %s: %v", name, err)
	}
}

func (c *cluster) events(name string) []corev1.Event {
	var evs corev1.EventList
	if err := env.Client.List(context.Background(), &evs, client.InNamespace(c.ns)); err != nil {
		c.t.Fatal(err)
	}
	var out []corev1.Event
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == name {
			out = append(out, e)
		}
	}
	return out
}

func notFound(err error) bool { return apierrors.IsNotFound(err) }

func talosSpec(version string) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: version}}
}

func keyOfNode(name string) client.ObjectKey { return client.ObjectKey{Name: name} }

func keyOf(ns, name string) client.ObjectKey { return client.ObjectKey{Namespace: ns, Name: name} }

// killInEachStage runs controllers, each started by start with a hook,
// until the operation at key succeeds: each is killed right after a step
// of a stage no controller was killed in yet has run. It returns the
// stages killed in, and fails the test if the operation fails or more
// than most controllers are needed. A read of the operation that fails is
// tried again (a hosted fleet's endpoint may be between API servers).
func killInEachStage(t *testing.T, c client.Reader, key client.ObjectKey, most int, each time.Duration, start func(hook func(operation.StepRun)) *testcluster.Controller) map[string]bool {
	t.Helper()
	return killAtEach(t, c, key, most, each, func(op *ichorv1.TalosOperation, _ operation.StepRun) (string, bool) { return op.Status.Stage, true }, start)
}

// killAtEachStep is killInEachStage at every step boundary: each
// controller is killed right after a step (of a stage) that no controller
// was killed after yet has run, before its result is recorded. It returns
// the steps killed after, as stage/step.
func killAtEachStep(t *testing.T, c client.Reader, key client.ObjectKey, most int, each time.Duration, start func(hook func(operation.StepRun)) *testcluster.Controller) map[string]bool {
	t.Helper()
	return killAtEach(t, c, key, most, each, func(op *ichorv1.TalosOperation, s operation.StepRun) (string, bool) {
		return op.Status.Stage + "/" + s.Step, true
	}, start)
}

// killAtEach runs controllers until the operation at key succeeds, each
// killed right after a step run at a boundary (as boundary names it, for
// the steps it says are one) no controller was killed at yet.
func killAtEach(t *testing.T, c client.Reader, key client.ObjectKey, most int, each time.Duration,
	boundary func(op *ichorv1.TalosOperation, s operation.StepRun) (string, bool), start func(hook func(operation.StepRun)) *testcluster.Controller) map[string]bool {
	t.Helper()
	var mu sync.Mutex
	killedAt := map[string]bool{}
	for n := 0; ; n++ {
		if n >= most {
			t.Fatalf("%s still not done after %d controllers (killed at %v)", key.Name, most, killedAt)
		}
		var killable atomic.Pointer[testcluster.Controller]
		gone := make(chan struct{})
		var once sync.Once
		hook := func(s operation.StepRun) {
			mu.Lock()
			defer mu.Unlock()
			if s.Operation.Name != key.Name || s.Err != nil {
				return
			}
			op := &ichorv1.TalosOperation{}
			if err := c.Get(context.Background(), key, op); err != nil {
				return
			}
			if at, ok := boundary(op, s); ok && !killedAt[at] {
				once.Do(func() { // a step in flight beside it may return after the kill
					killedAt[at] = true
					killable.Load().Kill()
					close(gone)
				})
			}
		}
		killable.Store(start(hook))
		done := false
		testenv.Eventually(t, each, "the controller killed at a stage boundary, or "+key.Name+" done", func(ctx context.Context) (bool, error) {
			select {
			case <-gone:
				return true, nil
			default:
			}
			op := &ichorv1.TalosOperation{}
			if err := c.Get(ctx, key, op); err != nil {
				return false, nil //nolint:nilerr // tried again
			}
			if op.Failed() {
				t.Fatalf("%s failed: %s: %s", key.Name, op.Status.FailureReason, op.Status.Message)
			}
			done = op.Succeeded()
			return done, nil
		})
		killable.Load().Stop()
		if done {
			mu.Lock()
			defer mu.Unlock()
			return killedAt
		}
	}
}
