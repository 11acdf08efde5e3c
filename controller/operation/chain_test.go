package operation_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

const envPatch = "machine:\n  env:\n    HTTP_PROXY: http://proxy.internal:3128\n"

// rebootOn is a config rollout that reboots m alone: inspect, then the
// Chained cordon-and-drain, then the apply.
func rebootOn(m *sim.Machine) ichorv1.TalosOperationSpec {
	op := configSpec(ichorv1.ConfigModeAuto, envPatch)
	op.Machines = onlyMachine(m)
	return op
}

// TestChainedStepsStopWithTheOperation: a pause that arrives while inspect
// runs stops the run before the drain chained after it: the machine waits,
// stopped, at drain, neither cordoned nor applied; resuming runs the drain
// and the rest, and the machine reboots once.
func TestChainedStepsStopWithTheOperation(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	// The hook holds the run between inspect and the drain chained after
	// it until the controller has seen the pause.
	inspected, paused := make(chan struct{}), make(chan struct{})
	var once sync.Once
	hook := func(s operation.StepRun) {
		if s.Machine == w.Name() && s.Step == executor.StepInspect && s.Err == nil {
			once.Do(func() { close(inspected); <-paused })
		}
	}
	c.startWith(testcluster.StartController, func(o *app.Options, _ **rest.Config) { o.TestHookAfterRun = hook })
	c.create("paused", rebootOn(w))
	select {
	case <-inspected:
	case <-time.After(time.Minute):
		t.Fatal("inspect never returned")
	}
	c.patchSpec("paused", `{"paused":true}`)
	c.waitFor("paused", "to be paused", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonPausedByOperator
	})
	close(paused)
	op := c.waitFor("paused", "to stop at drain", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := op.Status.Machines[0]
		return m.Step == executor.StepDrain && m.Stopped
	})
	if cordoned(t, w.Name()) {
		t.Errorf("%s cordoned while paused: the drain ran after the pause", w.Name())
	}
	if n := reboots(c.fleet.Recorder(), w.Name()); n != 0 {
		t.Errorf("%s rebooted %d times while paused", w.Name(), n)
	}
	if m := op.Status.Machines[0]; m.BootID == "" {
		t.Errorf("inspect's boot ID was not recorded at the pause: %+v", m)
	}
	c.patchSpec("paused", `{"paused":false}`)
	c.waitSucceeded("paused", time.Minute)
	if n := reboots(c.fleet.Recorder(), w.Name()); n != 1 {
		t.Errorf("%s rebooted %d times, want once", w.Name(), n)
	}
}

// TestChainedStepShownWhileItRuns: status names the Chained step that runs
// (a drain a PodDisruptionBudget holds), not the step its run began with.
func TestChainedStepShownWhileItRuns(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	release := c.holdDrain(w.Name())
	c.start()
	c.create("held", rebootOn(w))
	c.atStep("held", executor.StepDrain)
	release()
	c.waitSucceeded("held", time.Minute)
}

// TestKilledInAChain: a controller killed after the drain chained after
// inspect, before status recorded either's end, is replaced by one that
// runs the chain again from the step status records: the machine is
// drained again (harmless), applied and rebooted once, and uncordoned.
func TestKilledInAChain(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	killed := c.startKilledAfter(executor.StepDrain, func(s operation.StepRun) bool {
		return s.Machine == w.Name() && s.Step == executor.StepDrain
	})
	c.create("killed", rebootOn(w))
	killed()
	c.start()
	c.waitSucceeded("killed", time.Minute)
	if n := reboots(c.fleet.Recorder(), w.Name()); n != 1 {
		t.Errorf("%s rebooted %d times, want once", w.Name(), n)
	}
	testenv.Eventually(t, 30*time.Second, w.Name()+" uncordoned", func(context.Context) (bool, error) {
		return !cordoned(t, w.Name()), nil
	})
}

// TestPausedWhileDownStopsBeforeVerify: a pause that arrives while a
// rebooted machine is down is watched through: the machine comes back, its
// reboot's Wait ends, and it stops before the verify (and uncordon) that
// follows, which, being Chained, would start beside the status write of
// the turn that saw it back; resuming runs it. Nothing reads the machine's
// configuration between its return and the resume: a verify begun while
// paused would, before the resume, which follows the status that shows
// the machine stopped. (The Wait reads the boot ID, not the configuration.)
func TestPausedWhileDownStopsBeforeVerify(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	comeBack := w.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	c.start()
	ops := watchOps(t, c.ns)
	c.create("down", rebootOn(w))
	ops.until(t, "down", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return len(op.Status.Machines) == 1 && op.Status.Machines[0].Step == executor.StepRebooted
	})
	c.patchSpec("down", `{"paused":true}`)
	ops.until(t, "down", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonPausedByOperator
	})
	back := time.Now()
	comeBack()
	ops.until(t, "down", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := op.Status.Machines[0]
		return m.Step == executor.StepVerify && m.Stopped
	})
	resumed := time.Now()
	c.patchSpec("down", `{"paused":false}`)
	c.waitSucceeded("down", time.Minute)
	for _, call := range c.fleet.Recorder().Handled(w.Name(), "State/Get") {
		if call.At.After(back) && call.At.Before(resumed) {
			t.Errorf("%s's configuration read at %s, while the operation was paused after its reboot: the verify ran", w.Name(), call.At.Format(time.StampMicro))
		}
	}
}

// TestUncordonBesideItsWrite: the uncordon after a reboot is Chained: it
// starts beside the status write of the turn that saw the machine back, not
// a round trip after it. With that write held at the controller's
// transport, the machine is uncordoned all the same; once the write goes
// through, the next turn records the uncordon's result and the operation
// succeeds with the machine schedulable.
func TestUncordonBesideItsWrite(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	m := c.fleet.Machines()[1]
	w := m.Name()
	whileHeld := c.upgradeHoldingWrite(m, recordsUncordon, func() bool { return schedulableWithin(w, 30*time.Second) })
	select {
	case ok := <-whileHeld:
		if !ok {
			t.Errorf("%s still cordoned 30 s into the held status write that records its uncordon: the uncordon waited for the write", w)
		}
	case <-time.After(3 * time.Minute):
		t.Fatal("no status write recorded the uncordon")
	}
	c.waitSucceeded("upgrade", time.Minute)
	if cordoned(t, w) {
		t.Errorf("%s cordoned after the operation succeeded", w)
	}
}

// upgradeHoldingWrite starts the controller and a Talos upgrade of machine m
// alone, holds at the controller's transport the first status write that
// records says is the one, and sends what during answers while it is held.
func (c *cluster) upgradeHoldingWrite(m *sim.Machine, records func(*http.Request) bool, during func() bool) <-chan bool {
	hold, whileHeld := holdingFirst(func(req *http.Request) bool {
		return req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/status") && records(req)
	}, func(*http.Request) bool { return during() })
	c.startWith(testcluster.StartController, hold)
	op := talosSpec("v1.13.7")
	op.Machines = onlyMachine(m)
	c.create("upgrade", op)
	return whileHeld
}

// holdingFirst holds at the controller's transport the first of its
// requests that match says is the one, and sends what during answers while
// that request is held.
func holdingFirst[T any](match func(*http.Request) bool, during func(*http.Request) T) (controllerOption, <-chan T) {
	isFirst, do, answer := first(match, during)
	return beforeRequest(isFirst, do), answer
}

// afterFirstAnswer lets the first of the controller's requests that match
// says is the one go to the API server, and once its answer is back, before
// the controller has it, sends what during answers.
func afterFirstAnswer[T any](match func(*http.Request) bool, during func(*http.Request) T) (controllerOption, <-chan T) {
	isFirst, do, answer := first(match, during)
	return afterAnswer(isFirst, do), answer
}

// first passes the first request that match passes, and its do sends what
// during answers for that request on the channel it returns.
func first[T any](match func(*http.Request) bool, during func(*http.Request) T) (func(*http.Request) bool, func(*http.Request), <-chan T) {
	var seen atomic.Bool
	answer := make(chan T, 1)
	return func(req *http.Request) bool { return match(req) && seen.CompareAndSwap(false, true) },
		func(req *http.Request) { answer <- during(req) }, answer
}

// recordsUncordon reports whether a status write's body has a machine at the uncordon step.
func recordsUncordon(req *http.Request) bool {
	return bodyContains(req, `"step":"`+executor.StepUncordon+`"`)
}

// beforeRequest calls do before each of the controller's requests that
// match says, then sends it: a test holds a request there, or races it.
func beforeRequest(match func(*http.Request) bool, do func(*http.Request)) controllerOption {
	return func(_ *app.Options, cfg **rest.Config) {
		(*cfg).Wrap(func(rt http.RoundTripper) http.RoundTripper {
			return roundTripper(func(req *http.Request) (*http.Response, error) {
				if match(req) {
					do(req)
				}
				return rt.RoundTrip(req)
			})
		})
	}
}

// afterAnswer sends each of the controller's requests, then, for those
// that match says, calls do before the controller has the answer.
func afterAnswer(match func(*http.Request) bool, do func(*http.Request)) controllerOption {
	return func(_ *app.Options, cfg **rest.Config) {
		(*cfg).Wrap(func(rt http.RoundTripper) http.RoundTripper {
			return roundTripper(func(req *http.Request) (*http.Response, error) {
				resp, err := rt.RoundTrip(req)
				if match(req) {
					do(req)
				}
				return resp, err
			})
		})
	}
}

// bodyContains reports whether the request's body contains s.
func bodyContains(req *http.Request, s string) bool {
	raw, ok := requestBody(req)
	return ok && strings.Contains(string(raw), s)
}

// requestBody is a copy of the request's body, read without consuming it.
func requestBody(req *http.Request) ([]byte, bool) {
	if req.GetBody == nil {
		return nil, false
	}
	body, err := req.GetBody()
	if err != nil {
		return nil, false
	}
	defer body.Close()
	raw, err := io.ReadAll(body)
	return raw, err == nil
}

// schedulableWithin reports whether the Node is schedulable, and no longer
// marked as cordoned by an operation, within d.
func schedulableWithin(name string, d time.Duration) bool {
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, d, true, func(ctx context.Context) (bool, error) {
		n := &corev1.Node{}
		if err := env.Client.Get(ctx, keyOfNode(name), n); err != nil {
			return false, nil
		}
		_, marked := n.Annotations[executor.CordonedByAnnotation]
		return !n.Spec.Unschedulable && !marked, nil
	})
	return err == nil
}

// TestInspectBesideTheStart: a machine's first step, a read (the Talos
// upgrade's inspect, and the pull Chained after it), starts beside the
// status write that starts the machine, not a round trip after it: the
// installer is pulled while that write is held at the controller's
// transport.
func TestInspectBesideTheStart(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	m := c.fleet.Machines()[1]
	rec := c.fleet.Recorder()
	recordsInspect := func(req *http.Request) bool { return bodyContains(req, `"step":"`+executor.StepInspect+`"`) }
	whileHeld := c.upgradeHoldingWrite(m, recordsInspect, func() bool {
		return wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return rec.Calls(m.Name(), "ImageService/Pull") > 0, nil
		}) == nil
	})
	select {
	case ok := <-whileHeld:
		if !ok {
			t.Errorf("%s's installer not pulled 30 s into the held status write that starts it: its inspect waited for the write", m.Name())
		}
	case <-time.After(3 * time.Minute):
		t.Fatal("no status write started the machine at inspect")
	}
	c.waitSucceeded("upgrade", time.Minute)
}
