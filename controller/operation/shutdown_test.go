package operation_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestShutdownWholeCluster shuts down a cluster whose control planes host
// its API (3 control planes, 2 workers), saving an etcd snapshot to a file
// first (it verifies, and was streamed before any machine stopped; the
// final message says to restore from it), with the controller "on" the
// first worker, killed right after the second worker's shutdown call was
// accepted and before status recorded it, and killed again once the
// control planes' call went out. Every machine ends off and the API gone;
// the status read once the machines are powered on again (control planes
// first) says Succeeded, that the control planes were shutting down, and,
// from the controller started then, when the cluster came back, with every
// machine back and the cordons lifted. Every machine got exactly one
// Shutdown, the controller's own worker after the other, and the control
// planes theirs in one call.
func TestShutdownWholeCluster(t *testing.T) {
	t.Parallel() // its own hosted fleet and API servers (see TestMain)
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 2), testenv.Components{ControllerManager: true, Scheduler: true, NodeLifecycle: true})
	ctx := context.Background()
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	ms := fleet.Machines()
	self, other := ms[3].Name(), ms[4].Name()

	var ctl atomic.Pointer[testcluster.Controller]
	var kills sync.Map // step -> chan struct{}
	killAfter := func(machine, step string) <-chan struct{} {
		ch := make(chan struct{})
		kills.Store(machine+"/"+step, ch)
		return ch
	}
	hook := func(s operation.StepRun) {
		if v, ok := kills.LoadAndDelete(s.Machine + "/" + s.Step); ok && s.Err == nil {
			ctl.Load().Kill()
			close(v.(chan struct{}))
		}
	}
	start := func() {
		ctl.Store(testcluster.StartKillable(t, henv.Config, app.Options{Namespace: ns, Node: self, TestHookAfterRun: hook}))
	}
	waitClosed := func(ch <-chan struct{}, what string) {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(3 * time.Minute):
			t.Fatalf("%s never ran", what)
		}
	}
	workerKilled := killAfter(other, executor.StepShutdown)
	cpsKilled := killAfter(ms[0].Name(), executor.StepShutdownControlPlanes)
	start()
	snap := filepath.Join(t.TempDir(), "before-shutdown.db")
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shutdown"},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{Snapshot: "file://" + snap}}}
	if err := henv.Client.Create(ctx, op); err != nil {
		t.Fatal(err)
	}
	waitClosed(workerKilled, other+"'s shutdown")
	ctl.Load().Stop()
	start()
	waitClosed(cpsKilled, "the control planes' shutdown")
	ctl.Load().Stop()

	testenv.Eventually(t, 2*time.Minute, "every machine off", func(context.Context) (bool, error) {
		for _, m := range ms {
			if !m.Off() {
				return false, nil
			}
		}
		return true, nil
	})
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if err := henv.Client.Get(gctx, client.ObjectKeyFromObject(op), &ichorv1.TalosOperation{}); err == nil {
		t.Error("the API still answers with every control plane off")
	}
	cancel()

	for _, m := range ms { // control planes first
		if err := m.PowerOn(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 3*time.Minute, "the API back", func(ctx context.Context) (bool, error) {
		return henv.Client.Get(ctx, client.ObjectKeyFromObject(op), &ichorv1.TalosOperation{}) == nil, nil
	})
	start()
	var got *ichorv1.TalosOperation
	testenv.Eventually(t, 3*time.Minute, "the cluster recorded back, every machine", func(ctx context.Context) (bool, error) {
		got = &ichorv1.TalosOperation{}
		if err := henv.Client.Get(ctx, client.ObjectKeyFromObject(op), got); err != nil {
			return false, nil // the API may not be back yet
		}
		c := meta.FindStatusCondition(got.Status.Conditions, ichorv1.ConditionClusterBack)
		return c != nil && c.Reason == executor.ReasonAllMachinesBack, nil
	})
	if !got.Succeeded() || !strings.Contains(got.Status.Message, "power on the control planes first") ||
		!strings.Contains(got.Status.Message, "kubectl ichor restore etcd --from file://"+snap) {
		t.Errorf("after power-on the operation is %s: %q", got.Status.Phase, got.Status.Message)
	}
	// The safety snapshot: saved, whole, before the first machine stopped.
	if st, err := snapshot.Verify(snap); err != nil || st.Revision == 0 {
		t.Errorf("the safety snapshot at %s: %+v, %v", snap, st, err)
	}
	back := meta.FindStatusCondition(got.Status.Conditions, ichorv1.ConditionClusterBack)
	if !back.LastTransitionTime.After(got.Status.CompletionTime.Time) || !strings.Contains(back.Message, "5/5 machines back") {
		t.Errorf("ClusterBack %s at %s, completed at %s", back.Message, back.LastTransitionTime, got.Status.CompletionTime)
	}
	rec := fleet.Recorder()
	snapshots := rec.Handled(ms[0].Name(), "EtcdSnapshot")
	if len(snapshots) == 0 {
		t.Errorf("%s streamed no etcd snapshot", ms[0].Name())
	}
	for _, m := range ms {
		if c := rec.Handled(m.Name(), "Shutdown"); len(snapshots) > 0 && len(c) > 0 && !snapshots[0].At.Before(c[0].At) {
			t.Errorf("%s was shut down at %s, before the safety snapshot at %s", m.Name(), c[0].At, snapshots[0].At)
		}
		if n := len(rec.Handled(m.Name(), "Shutdown")); n != 1 {
			t.Errorf("%s got %d Shutdown calls, want 1", m.Name(), n)
		}
		node := &corev1.Node{}
		if err := henv.Client.Get(ctx, client.ObjectKey{Name: m.Name()}, node); err != nil {
			t.Fatal(err)
		}
		if node.Spec.Unschedulable {
			t.Errorf("%s is still cordoned", m.Name())
		}
	}
	if a, b := rec.Handled(other, "Shutdown"), rec.Handled(self, "Shutdown"); len(a) == 1 && len(b) == 1 && !a[0].At.Before(b[0].At) {
		t.Errorf("the controller's own worker %s was shut down at %s, before %s at %s", self, b[0].At, other, a[0].At)
	}
	cps := rec.Handled(ms[0].Name(), "Shutdown")
	for _, m := range ms[1:3] {
		if c := rec.Handled(m.Name(), "Shutdown"); len(c) == 1 && len(cps) == 1 && c[0].At.Sub(cps[0].At).Abs() > time.Second {
			t.Errorf("%s was shut down at %s, %s at %s: not in one call", m.Name(), c[0].At, ms[0].Name(), cps[0].At)
		}
	}
}

// TestShutdownCallReachedSome: the control planes' shutdown call reaches
// every control plane but the one that made it (its part is refused), and
// the controller is killed before it records that failure. The others are
// powered on again before a controller runs. The next controller must not
// make the call again (it would shut down the machines just powered on):
// it records the cluster back, naming the one that kept running, and each
// of the others got exactly one Shutdown.
func TestShutdownCallReachedSome(t *testing.T) {
	spec := sim.Cluster("", 3, 0)
	// A machine is back once its Node says Ready after the operation's
	// completion, both to the second: booting takes longer than that.
	spec.Durations = sim.DefaultDurations()
	spec.Durations.Reboot = 2 * time.Second
	c := newCluster(t, spec)
	cps := c.fleet.Machines()
	lead := cps[0]
	lead.Inject(sim.Fault{Kind: sim.FaultError, Method: "Shutdown", Code: codes.FailedPrecondition, Once: true})
	killed := make(chan struct{})
	var ctl atomic.Pointer[testcluster.Controller]
	var once sync.Once
	hook := func(s operation.StepRun) {
		if s.Step == executor.StepShutdownControlPlanes {
			if s.Machine != lead.Name() || s.Err == nil {
				t.Errorf("the control planes' call from %s returned %v, want %s's part refused", s.Machine, s.Err, lead.Name())
			}
			once.Do(func() { ctl.Load().Kill(); close(killed) })
		}
	}
	ctl.Store(testcluster.StartKillable(t, env.Config, app.Options{Namespace: c.ctrlNS, TestHookAfterRun: hook}))
	c.create("shutdown", ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{}})
	select {
	case <-killed:
	case <-time.After(2 * time.Minute):
		t.Fatal("the control planes' shutdown never ran")
	}
	ctl.Load().Stop()
	testenv.Eventually(t, time.Minute, "the others off", func(context.Context) (bool, error) { return cps[1].Off() && cps[2].Off(), nil })
	for _, m := range cps[1:] {
		if err := m.PowerOn(); err != nil {
			t.Fatal(err)
		}
	}

	c.start()
	var got *ichorv1.TalosOperation
	shutdowns := func(m *sim.Machine) int { return len(c.fleet.Recorder().Handled(m.Name(), "Shutdown")) }
	testenv.Eventually(t, 2*time.Minute, "the cluster recorded back", func(ctx context.Context) (bool, error) {
		for _, m := range cps[1:] {
			if n := shutdowns(m); n != 1 {
				return false, fmt.Errorf("%s got %d Shutdown calls, want 1 (the call was made again)", m.Name(), n)
			}
		}
		got = c.get("shutdown")
		back := meta.FindStatusCondition(got.Status.Conditions, ichorv1.ConditionClusterBack)
		return back != nil && back.Reason == executor.ReasonAllMachinesBack, nil
	})
	back := meta.FindStatusCondition(got.Status.Conditions, ichorv1.ConditionClusterBack)
	if !got.Succeeded() || !strings.Contains(back.Message, lead.Name()+" kept running: its part of the shutdown call failed") {
		t.Errorf("the operation is %s, ClusterBack %q", got.Status.Phase, back.Message)
	}
	for _, m := range cps {
		if m.Off() {
			t.Errorf("%s is off", m.Name())
		}
	}
}
