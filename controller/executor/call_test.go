package executor

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"google.golang.org/grpc/codes"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// fleet starts a fleet without a Kubernetes side: the steps here only talk
// to Talos.
func fleet(t *testing.T, spec sim.Spec) (*sim.Fleet, *talosclient.Client) {
	t.Helper()
	spec.Logf = t.Logf
	f, err := sim.Start(context.Background(), spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	c, err := talosclient.New(context.Background(), talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return f, c
}

// env is what the reconciler hands a step on m: status recorded m's boot ID
// and counts this run as the first (Calls 1).
func env(f *sim.Fleet, c *talosclient.Client, m *sim.Machine, spec ichorv1.TalosOperationSpec) *Env {
	role := ichorv1.RoleWorker
	if m.Role() == sim.ControlPlane {
		role = ichorv1.RoleControlPlane
	}
	var cps []string
	for _, cp := range f.ControlPlanes() {
		cps = append(cps, cp.Address())
	}
	return &Env{
		Op:      &ichorv1.TalosOperation{Spec: spec},
		Machine: ichorv1.MachineStatus{Name: m.Name(), Role: role, BootID: m.BootID(), Calls: 1},
		Address: m.Address(), ControlPlanes: cps, Talos: c, Log: logr.Discard(),
	}
}

func resetSpec(m *sim.Machine, reboot bool) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{
		Machine: m.Name(), Action: ichorv1.NodeReset, Reset: &ichorv1.ResetOptions{Reboot: reboot}}}
}

func rebootSpec(m *sim.Machine) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: m.Name(), Action: ichorv1.NodeReboot}}
}

// goneBeforeTheCall is c made to a machine that stops between the look
// that finds it up and the call: the call finds no machine to connect to.
func goneBeforeTheCall(c call) call {
	send := c.send
	c.send = func(ctx context.Context, e *Env) (Outcome, error) {
		if err := talos.Shutdown(ctx, e.Talos, e.Address, true); err != nil {
			return Outcome{}, err
		}
		for {
			if _, err := talos.BootID(ctx, e.Talos, e.Address); talos.Unreachable(err) {
				return send(ctx, e)
			}
			if err := pause(ctx, poll); err != nil {
				return Outcome{}, err
			}
		}
	}
	return c
}

// setShowTime sets showTime for one test.
func setShowTime(t *testing.T, d time.Duration) {
	old := showTime
	showTime = d
	t.Cleanup(func() { showTime = old })
}

func withTimeout(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d)
}

// TestCallDecidesFromEvidence drives the reset and reboot calls against
// simulated machines: the call goes out once, only to a machine that
// answers and is not already doing it, and "does not answer" is never
// "done" unless an earlier run may have made the call.
func TestCallDecidesFromEvidence(t *testing.T) {
	poll = 20 * time.Millisecond
	unreachable := sim.Fault{Kind: sim.FaultError, Method: "*", Code: codes.Unavailable}
	tests := []struct {
		name string
		// stop is how long the machine takes to stop once a sequence began.
		stop time.Duration
		// start is how long it takes to enter the sequence's stage after
		// answering the call.
		start time.Duration
		// before prepares the machine and the step's env; the step runs
		// within timeout.
		before  func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env)
		call    call
		timeout time.Duration
		// calls is how many Reset or Reboot calls the machine must have had.
		calls      int
		wantReason string
		wantMsg    string
	}{
		{name: "a machine that answers gets the call", call: reset, calls: 1, wantMsg: "reset sent"},
		{name: "a machine already resetting does not get it again", stop: time.Minute, start: 300 * time.Millisecond, call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				// An earlier run made the call; its result was never recorded.
				if _, err := reset.make(context.Background(), e); err != nil {
					t.Fatal(err)
				}
				e.Machine.Calls = 2
			}, wantMsg: "reset under way (stage resetting)"},
		{name: "a machine gone after an earlier run's call is not called again", call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				if _, err := reset.make(context.Background(), e); err != nil {
					t.Fatal(err)
				}
				testenv.Eventually(t, 30*time.Second, "the machine off", func(context.Context) (bool, error) { return m.Off(), nil })
				e.Machine.Calls = 2
			}, wantMsg: "reset: the machine no longer answers since the call was made"},
		{name: "a first run on a machine that does not answer fails", call: reset, timeout: 2 * time.Second, calls: 0,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				m.Inject(unreachable)
			}, wantReason: "Unreachable", wantMsg: "does not answer the Talos API"},
		{name: "a machine that answers again gets the call", call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				clear := m.Inject(unreachable)
				go func() {
					for f.Recorder().Calls(m.Name(), "Read") < 3 {
						time.Sleep(5 * time.Millisecond)
					}
					clear()
				}()
			}, wantMsg: "reset sent"},
		{name: "a call whose answer was lost is not sent again before the machine can show it", stop: time.Minute, start: 100 * time.Millisecond,
			call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				// The machine answers only after showTime has passed since the
				// run began; then the call takes effect and its answer is lost.
				setShowTime(t, 200*time.Millisecond)
				clear := m.Inject(unreachable)
				go func() {
					for f.Recorder().Calls(m.Name(), "Read") < 15 {
						time.Sleep(5 * time.Millisecond)
					}
					clear()
				}()
				m.Inject(sim.Fault{Kind: sim.FaultLost, Method: "Reset", Once: true})
			}, wantMsg: "reset under way (stage resetting)"},
		{name: "a call refused by a machine gone meanwhile is not taken for made", call: goneBeforeTheCall(reset), timeout: 8 * time.Second,
			calls: 1, wantReason: "Unreachable", wantMsg: "so no reset was made"},
		{name: "a call that never answers fails saying it may have been made", call: reset, timeout: 2 * time.Second, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				m.Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reset"})
			}, wantReason: "Unreachable", wantMsg: "may have been made"},
		{name: "a machine booted since an earlier run of the attempt has rebooted", call: nodeReboot, calls: 0,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				e.Machine.BootID, e.Machine.Calls = "the boot before", 2
			}, wantMsg: "reboot done: the machine has booted again since"},
		{name: "a new boot is someone else's reboot on a first run", call: nodeReboot, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				// Another operation rebooted it between a failed attempt and its retry.
				e.Machine.BootID, e.Machine.Calls = "the boot before", 1
			}, wantMsg: "reboot sent"},
		{name: "a new boot is no reset on a first run", call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				e.Machine.BootID = "the boot before"
			}, wantMsg: "reset sent"},
		{name: "someone else's reboot is no upgrade on a first run", call: legacyUpgrade, stop: 500 * time.Millisecond, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				// Talos shows a legacy upgrade's kexec as Rebooting too.
				e.Op.Spec = ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7"}}
				if err := talos.Reboot(context.Background(), e.Talos, e.Address, false); err != nil {
					t.Fatal(err)
				}
				testenv.Eventually(t, 10*time.Second, "the machine rebooting", func(context.Context) (bool, error) {
					return m.Stage() == runtime.MachineStageRebooting, nil
				})
			}, wantMsg: "upgrade sent"},
		{name: "Talos refuses the call", call: reset, calls: 1,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				m.Inject(sim.Fault{Kind: sim.FaultError, Method: "Reset", Code: codes.InvalidArgument})
			}, wantReason: "ResetFailed", wantMsg: "simulated fault"},
		{name: "no InternalIP is no call and no guess", call: reset, calls: 0,
			before: func(t *testing.T, f *sim.Fleet, m *sim.Machine, e *Env) {
				e.Address = ""
			}, wantReason: "NoNodeAddress", wantMsg: "has no InternalIP"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("call", 1, 1)
			spec.Durations.Stop = tt.stop
			spec.Durations.SequenceStart = tt.start
			f, c := fleet(t, spec)
			m := f.Machines()[1]
			e := env(f, c, m, resetSpec(m, false))
			if tt.call.what == "reboot" {
				e.Op.Spec = rebootSpec(m)
			}
			if tt.before != nil {
				tt.before(t, f, m, e)
			}
			timeout := tt.timeout
			if timeout == 0 {
				timeout = 30 * time.Second
			}
			ctx, cancel := withTimeout(timeout)
			defer cancel()
			out, err := tt.call.make(ctx, e)
			switch {
			case tt.wantReason != "":
				if err == nil || Reason("step", err) != tt.wantReason || !strings.Contains(err.Error(), tt.wantMsg) {
					t.Errorf("got %v (outcome %+v), want %s: ...%s...", err, out, tt.wantReason, tt.wantMsg)
				}
			case err != nil:
				t.Errorf("got %v, want %q", err, tt.wantMsg)
			case out.Message != tt.wantMsg:
				t.Errorf("message %q, want %q", out.Message, tt.wantMsg)
			}
			method := map[string]string{"reboot": "Reboot", "upgrade": "Upgrade"}[tt.call.what]
			if method == "" {
				method = "Reset"
			}
			if n := f.Recorder().Calls(m.Name(), "MachineService/"+method); n != tt.calls {
				t.Errorf("%d %s calls, want %d", n, method, tt.calls)
			}
		})
	}
}

// TestEtcdCheckRightBeforeTheCall: a control plane is not rebooted while
// etcd is unhealthy, whatever an earlier check found.
func TestEtcdCheckRightBeforeTheCall(t *testing.T) {
	f, c := fleet(t, sim.Cluster("etcd", 3, 0))
	cp := f.ControlPlanes()[1]
	e := env(f, c, cp, rebootSpec(cp))
	if _, err := etcdHealthStep().Run(context.Background(), e); err != nil {
		t.Fatalf("the early check: %v", err)
	}
	f.ControlPlanes()[2].Inject(sim.Fault{Kind: sim.FaultEtcdUnhealthy})
	ctx, cancel := withTimeout(30 * time.Second)
	defer cancel()
	_, err := nodeReboot.make(ctx, e)
	if Reason("reboot", err) != "EtcdUnhealthy" {
		t.Errorf("got %v, want EtcdUnhealthy", err)
	}
	if n := f.Recorder().Calls(cp.Name(), "MachineService/Reboot"); n != 0 {
		t.Errorf("%d reboots of a control plane while etcd is unhealthy", n)
	}
}

// TestRecoveryResetNotSentTwice: the etcd restore's reset of every control
// plane, run again after an earlier run made it (its result never
// recorded), sends nothing more while the recovering machine still
// answers from its reset, on its old boot; it waits for the control
// planes to come back from that one reset.
func TestRecoveryResetNotSentTwice(t *testing.T) {
	poll = 20 * time.Millisecond
	spec := sim.Cluster("recovery", 3, 0)
	spec.Durations.Stop = 2 * time.Second
	f, c := fleet(t, spec)
	rec := f.ControlPlanes()[0]
	e := env(f, c, rec, ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore})
	ctx, cancel := withTimeout(time.Minute)
	defer cancel()
	// The earlier run's call.
	if err := talos.ResetForRecovery(ctx, c, e.ControlPlanes); err != nil {
		t.Fatal(err)
	}
	e.Machine.Calls = 2
	if _, err := runResetAll(ctx, e); err != nil {
		t.Fatal(err)
	}
	for _, cp := range f.ControlPlanes() {
		if n := f.Recorder().Calls(cp.Name(), "MachineService/Reset"); n != 1 {
			t.Errorf("%s: %d resets, want 1", cp.Name(), n)
		}
	}
}
