package operation_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func configSpec(mode ichorv1.ConfigMode, patches ...string) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindConfig, Config: &ichorv1.ConfigRollout{Patches: patches, Mode: mode}}
}

const zoneLabel = "machine:\n  nodeLabels:\n    ichor.test/zone: a\n"

// reboots counts the reboots the recorder saw on a machine.
func reboots(rec *sim.Recorder, machine string) int {
	n := 0
	for _, a := range rec.Actions(machine) {
		if a.Kind == sim.ActionReboot {
			n++
		}
	}
	return n
}

func bootIDs(f *sim.Fleet) map[string]string {
	ids := map[string]string{}
	for _, m := range f.Machines() {
		ids[m.Name()] = m.BootID()
	}
	return ids
}

func fingerprints(t *testing.T, f *sim.Fleet) map[string]string {
	t.Helper()
	fps := map[string]string{}
	for _, m := range f.Machines() {
		fp, err := machineconfig.Fingerprint(m.Config())
		if err != nil {
			t.Fatal(err)
		}
		fps[m.Name()] = fp
	}
	return fps
}

func machineMessages(op *ichorv1.TalosOperation) map[string]string {
	out := map[string]string{}
	for _, m := range op.Status.Machines {
		out[m.Name] = m.Message
	}
	return out
}

// TestConfigLabelLive: a patch that adds a node label, in mode auto,
// reaches every machine without a single reboot, and the label is on every
// Node.
func TestConfigLabelLive(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 3))
	before := bootIDs(c.fleet)
	c.start()
	op := configSpec(ichorv1.ConfigModeAuto, zoneLabel)
	op.MaxUnavailable = 2
	c.create("label", op)
	got := c.waitSucceeded("label", 2*time.Minute)
	if got.Status.Target != "config (1 patch, auto)" {
		t.Errorf("target %q", got.Status.Target)
	}
	for name, msg := range machineMessages(got) {
		if msg != "applied live" {
			t.Errorf("%s: %q, want applied live", name, msg)
		}
	}
	rec := c.fleet.Recorder()
	for _, m := range c.fleet.Machines() {
		if m.BootID() != before[m.Name()] || reboots(rec, m.Name()) != 0 {
			t.Errorf("%s rebooted", m.Name())
		}
		if m.Config().Machine().NodeLabels()["ichor.test/zone"] != "a" {
			t.Errorf("%s: the label is not in the active configuration", m.Name())
		}
	}
	testenv.Eventually(t, 30*time.Second, "the label on every Node", func(ctx context.Context) (bool, error) {
		for _, m := range c.fleet.Machines() {
			n := &corev1.Node{}
			if err := env.Client.Get(ctx, keyOfNode(m.Name()), n); err != nil || n.Labels["ichor.test/zone"] != "a" || n.Spec.Unschedulable {
				return false, err
			}
		}
		return true, nil
	})
}

// TestConfigRebootAuto: a patch of machine.env in mode auto reboots every
// machine exactly once, drained first: control planes one at a time before
// any worker, workers within maxUnavailable.
func TestConfigRebootAuto(t *testing.T) {
	spec := sim.Cluster("", 3, 4)
	// Long enough that the two workers of a batch are down together.
	spec.Durations.Reboot = 300 * time.Millisecond
	c := newCluster(t, spec)
	c.start()
	op := configSpec(ichorv1.ConfigModeAuto, "machine:\n  env:\n    HTTP_PROXY: http://proxy.internal:3128\n")
	op.MaxUnavailable = 2
	c.create("env", op)
	got := c.waitSucceeded("env", 3*time.Minute)

	rec := c.fleet.Recorder()
	if cps, workers := rec.MaxDown(); cps != 1 || workers != 2 {
		t.Errorf("at most 1 control plane and 2 workers down at once; got %d and %d", cps, workers)
	}
	var lastCP, firstWorker time.Time
	for _, m := range c.fleet.Machines() {
		if n := reboots(rec, m.Name()); n != 1 {
			t.Errorf("%s rebooted %d times, want once", m.Name(), n)
		}
		if m.Config().Machine().Env()["HTTP_PROXY"] != "http://proxy.internal:3128" {
			t.Errorf("%s: machine.env not active", m.Name())
		}
		for _, a := range rec.Actions(m.Name()) {
			if m.Role() == sim.ControlPlane && a.End.After(lastCP) {
				lastCP = a.End
			}
			if m.Role() == sim.Worker && (firstWorker.IsZero() || a.Start.Before(firstWorker)) {
				firstWorker = a.Start
			}
		}
	}
	if !lastCP.Before(firstWorker) {
		t.Errorf("a worker rebooted at %s, before the last control plane was back at %s", firstWorker, lastCP)
	}
	if o := rec.Overlaps(sim.ActionReboot); slices.ContainsFunc(o, func(o sim.Overlap) bool {
		return c.fleet.Machine(o.A.Machine).Role() == sim.ControlPlane || c.fleet.Machine(o.B.Machine).Role() == sim.ControlPlane
	}) {
		t.Errorf("a control plane rebooted together with another machine: %v", o)
	}
	for name, msg := range machineMessages(got) {
		if msg != "applied, rebooted" {
			t.Errorf("%s: %q, want applied, rebooted", name, msg)
		}
	}
	nodes := &corev1.NodeList{}
	if err := env.Client.List(context.Background(), nodes); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes.Items {
		if n.Spec.Unschedulable {
			t.Errorf("%s left cordoned", n.Name)
		}
	}
}

// TestConfigRefused: a patch that does not validate refuses the operation,
// naming the machine and quoting Talos; no machine's configuration changed.
// A patch that does not apply to a machine's configuration, or names a
// field Talos does not know, is refused too.
func TestConfigRefused(t *testing.T) {
	tests := []struct {
		name, patch, reason, quote string
	}{
		{"does not validate", "machine:\n  kubelet:\n    image: ghcr.io/siderolabs/kubelet:v1.40.0\n",
			"Talos does not accept the patched configuration", `Talos says "1 error occurred:\n\t* kubelet image is not valid`},
		{"does not apply", `[{"op": "replace", "path": "/machine/nope/x", "value": "x"}]`,
			"patch 1 does not apply", "missing value"},
		{"an unknown field", "machine:\n  nodeLabelz:\n    ichor.test/zone: a\n",
			"spec.config.patches: patch 1 is not a machine-configuration patch", "unknown keys found during decoding"},
		{"an unknown field through a JSON patch", `[{"op": "add", "path": "/machine/nodeLabelz", "value": {"a": "b"}}]`,
			"patch 1 does not apply", "unknown keys found during decoding"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 2))
			before := fingerprints(t, c.fleet)
			c.start()
			c.create("bad", configSpec(ichorv1.ConfigModeAuto, tt.patch))
			got := c.waitFor("bad", "to be refused", time.Minute, func(op *ichorv1.TalosOperation) bool { return op.Refused() })
			cond := meta.FindStatusCondition(got.Status.Conditions, "ActionAllowed")
			if cond == nil || cond.Status != metav1.ConditionFalse {
				t.Fatalf("conditions %+v", got.Status.Conditions)
			}
			var names []string
			for _, m := range c.fleet.Machines() {
				names = append(names, m.Name())
			}
			if want := strings.Join(names, ", ") + ": " + tt.reason; !strings.Contains(cond.Message, want) {
				t.Errorf("the refusal does not name the machines (%q): %s", want, cond.Message)
			}
			if !strings.Contains(cond.Message, tt.quote) {
				t.Errorf("the refusal does not quote Talos (%q): %s", tt.quote, cond.Message)
			}
			if after := fingerprints(t, c.fleet); !equalMaps(before, after) {
				t.Errorf("a machine's configuration changed: %v -> %v", before, after)
			}
			if got.Status.Lock != "" {
				t.Errorf("a refused operation took the lock: %s", got.Status.Lock)
			}
		})
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestConfigPausedPlan: an operation created paused shows per machine
// whether the patches change its configuration and whether that needs a
// reboot, with nothing applied; resumed, it does what it showed.
func TestConfigPausedPlan(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	cp, w1, w2 := c.fleet.Machines()[0], c.fleet.Machines()[1], c.fleet.Machines()[2]
	const env1 = "machine:\n  env:\n    HTTP_PROXY: http://proxy.internal:3128\n"
	// w1 carries machine.env already, cp the whole change; w2 nothing.
	applyDirect(t, c.fleet, w1, machineconfig.Reboot, env1)
	applyDirect(t, c.fleet, cp, machineconfig.Reboot, env1, zoneLabel)
	before, fps := bootIDs(c.fleet), fingerprints(t, c.fleet)
	c.start()
	op := configSpec(ichorv1.ConfigModeAuto, env1, zoneLabel)
	op.Paused = true
	c.create("plan", op)
	want := map[string]string{cp.Name(): "plan: no change", w1.Name(): "plan: changes, applies live", w2.Name(): "plan: changes, needs a reboot"}
	c.waitFor("plan", "to show its plan", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return equalMaps(machineMessages(op), want) && op.Status.Reason == ichorv1.ReasonPausedByOperator
	})
	if after := fingerprints(t, c.fleet); !equalMaps(fps, after) {
		t.Fatalf("a paused operation changed a configuration: %v -> %v", fps, after)
	}
	c.patchSpec("plan", `{"paused":false}`)
	got := c.waitSucceeded("plan", 2*time.Minute)
	want = map[string]string{cp.Name(): "already applied", w1.Name(): "applied live", w2.Name(): "applied, rebooted"}
	if msgs := machineMessages(got); !equalMaps(msgs, want) {
		t.Errorf("messages %v, want %v", msgs, want)
	}
	rec := c.fleet.Recorder()
	for _, m := range []*sim.Machine{cp, w1} {
		if m.BootID() != before[m.Name()] {
			t.Errorf("%s rebooted", m.Name())
		}
	}
	if w2.BootID() == before[w2.Name()] || reboots(rec, w2.Name()) != 1 {
		t.Errorf("%s: %d reboots", w2.Name(), reboots(rec, w2.Name()))
	}
}

// applyDirect applies patches to a machine with the Talos API, as an
// operator with talosctl would, and waits until it runs them.
func applyDirect(t *testing.T, f *sim.Fleet, m *sim.Machine, mode machineconfig.Mode, patches ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tc, err := client.New(ctx, client.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	ps, err := machineconfig.ParsePatches(patches)
	if err != nil {
		t.Fatal(err)
	}
	mc := machineconfig.Machine{Talos: tc, Node: m.Address()}
	ch, err := mc.Plan(ctx, ps)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mc.Apply(ctx, ch.Config, mode); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, m.Name()+" running the applied configuration", func(context.Context) (bool, error) {
		fp, err := machineconfig.Fingerprint(m.Config())
		return !m.Down() && fp == ch.To, err
	})
}

// TestConfigKilledAfterApply kills the controller right after each
// machine's apply, before status records it, and starts a new one: the
// patch appends to a list, so an apply made twice would show twice, and a
// reboot made twice would be counted. Neither happens.
func TestConfigKilledAfterApply(t *testing.T) {
	const san = `[{"op": "add", "path": "/machine/certSANs/-", "value": "config.ichor.test"}]`
	for _, tt := range []struct {
		mode    ichorv1.ConfigMode
		reboots int
	}{{ichorv1.ConfigModeAuto, 0}, {ichorv1.ConfigModeReboot, 1}} {
		t.Run(string(tt.mode), func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", 1, 2))
			c.create("san", configSpec(tt.mode, san))
			killed := killAtEach(t, env.Client, keyOf(c.ns, "san"), 10, 2*time.Minute, func(_ *ichorv1.TalosOperation, s operation.StepRun) (string, bool) {
				return s.Machine, s.Step == executor.StepApply
			}, c.startKillable)
			if len(killed) != len(c.fleet.Machines()) {
				t.Errorf("killed after the apply of %v, want once after each machine's", killed)
			}
			rec := c.fleet.Recorder()
			for _, m := range c.fleet.Machines() {
				sans := m.Config().Machine().Security().CertSANs()
				if n := strings.Count(strings.Join(sans, ","), "config.ichor.test"); n != 1 {
					t.Errorf("%s: certSANs %v: the patch was applied %d times", m.Name(), sans, n)
				}
				if n := reboots(rec, m.Name()); n != tt.reboots {
					t.Errorf("%s rebooted %d times, want %d", m.Name(), n, tt.reboots)
				}
			}
		})
	}
}

// TestConfigChangedMidway: someone else changes the machine's configuration
// while it is drained for the apply. The apply is not sent: the step fails
// with ConfigChanged, saying so, and none of the patches reaches the
// machine. A retry inspects it again and applies them, once, on top of
// what it runs then.
func TestConfigChangedMidway(t *testing.T) {
	c, w, got := changedMidway(t)
	// The step a retry begins with is inspect.
	if m := got.Status.Machines[0]; m.Step != executor.StepInspect || !strings.Contains(m.Message, "someone else applied one; a retry inspects the machine again") {
		t.Errorf("failed with step %s next: %q", m.Step, m.Message)
	}
	rec := c.fleet.Recorder()
	if w.Config().Machine().NodeLabels()["ichor.test/zone"] != "" || reboots(rec, w.Name()) != 0 {
		t.Fatalf("the apply was sent over someone else's change: labels %v, %d reboots", w.Config().Machine().NodeLabels(), reboots(rec, w.Name()))
	}
	c.kubectl("annotate", "talosoperation", "zone", ichorv1.RetryAnnotation+"=true")
	got = c.waitSucceeded("zone", 2*time.Minute)
	if labels := w.Config().Machine().NodeLabels(); labels["ichor.test/zone"] != "a" || labels["ichor.test/other"] != "b" {
		t.Errorf("labels after the retry: %v", labels)
	}
	if n := reboots(rec, w.Name()); n != 1 || got.Status.Machines[0].Message != "applied, rebooted" {
		t.Errorf("%d reboots, message %q", n, got.Status.Machines[0].Message)
	}
}

// changedMidway runs operation zone (the zone label, mode reboot) on a
// cluster's one worker and, while it is drained, applies another label to
// it as an operator would: the step fails with ConfigChanged, the worker
// cordoned.
func changedMidway(t *testing.T) (*cluster, *sim.Machine, *ichorv1.TalosOperation) {
	t.Helper()
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	release := c.holdDrain(w.Name())
	c.start()
	op := configSpec(ichorv1.ConfigModeReboot, zoneLabel)
	op.Machines = onlyMachine(w)
	c.create("zone", op)
	c.atStep("zone", executor.StepDrain)
	applyDirect(t, c.fleet, w, machineconfig.NoReboot, "machine:\n  nodeLabels:\n    ichor.test/other: b\n")
	release()
	return c, w, c.waitFailed("zone", machineconfig.ReasonDiverged)
}

// onlyMachine selects one machine by its Node's hostname label.
func onlyMachine(m *sim.Machine) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/hostname": m.Name()}}
}

// zoneFails starts a controller with hook and runs operation zone (the
// zone label, in mode) on machine m alone until it fails with reason; it
// returns m's status then.
func (c *cluster) zoneFails(m *sim.Machine, mode ichorv1.ConfigMode, hook func(operation.StepRun), reason string) ichorv1.MachineStatus {
	c.t.Helper()
	c.startWith(testcluster.StartController, func(o *app.Options, _ **rest.Config) { o.TestHookAfterRun = hook })
	op := configSpec(mode, zoneLabel)
	op.Machines = onlyMachine(m)
	c.create("zone", op)
	return c.waitFailed("zone", reason).Status.Machines[0]
}

// TestConfigVerifyAfterReboot: the machine came back from the reboot
// without the change (someone else's apply replaced the label right after
// it booted). Verify finds it: the step fails with ConfigNotActive, saying
// so, the machine is not reported applied and stays cordoned. The operator
// puts the change back; a retry inspects the machine again, finds it
// applied, sends nothing and lifts the cordon.
func TestConfigVerifyAfterReboot(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	boot := w.BootID()
	const other = "machine:\n  nodeLabels:\n    ichor.test/zone: b\n"
	var once sync.Once
	hook := func(s operation.StepRun) {
		if s.Step != executor.StepApply || s.Err != nil || s.Machine != w.Name() {
			return
		}
		once.Do(func() {
			testenv.Eventually(t, time.Minute, w.Name()+" back from the reboot", func(context.Context) (bool, error) {
				return !w.Down() && w.BootID() != boot, nil
			})
			applyDirect(t, c.fleet, w, machineconfig.NoReboot, other)
		})
	}
	m := c.zoneFails(w, ichorv1.ConfigModeReboot, hook, machineconfig.ReasonNotActive)
	if m.Step != executor.StepInspect || !strings.Contains(m.Message, "the machine runs configuration") || !strings.Contains(m.Message, "a retry inspects the machine again") {
		t.Errorf("failed with step %s next: %q", m.Step, m.Message)
	}
	if strings.Contains(m.Message, "applied, rebooted") || m.Phase == ichorv1.MachineSucceeded {
		t.Errorf("a machine without the change is reported applied: %s %q", m.Phase, m.Message)
	}
	if !cordoned(t, w.Name()) {
		t.Errorf("%s was uncordoned without the change", w.Name())
	}
	applyDirect(t, c.fleet, w, machineconfig.NoReboot, zoneLabel)
	rec := c.fleet.Recorder()
	applies := rec.Calls(w.Name(), "ApplyConfiguration")
	c.kubectl("annotate", "talosoperation", "zone", ichorv1.RetryAnnotation+"=true")
	got := c.waitSucceeded("zone", 2*time.Minute)
	if msg := got.Status.Machines[0].Message; msg != "already applied" {
		t.Errorf("after the retry: message %q", msg)
	}
	if n := rec.Calls(w.Name(), "ApplyConfiguration"); n != applies || reboots(rec, w.Name()) != 1 {
		t.Errorf("the retry sent %d applies, and there were %d reboots, for a change already there", n-applies, reboots(rec, w.Name()))
	}
	if cordoned(t, w.Name()) {
		t.Errorf("%s left cordoned by a retry that found the change applied", w.Name())
	}
}

// cordoned reads whether the Node is unschedulable.
func cordoned(t *testing.T, name string) bool {
	t.Helper()
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(name), n); err != nil {
		t.Fatal(err)
	}
	return n.Spec.Unschedulable
}

// TestConfigDeletedLiftsCordon: a config operation that failed with its
// machine drained, then deleted, lifts the cordon it made (config lifts it
// in verify, not in an uncordon step of its own).
func TestConfigDeletedLiftsCordon(t *testing.T) {
	c, w, _ := changedMidway(t)
	if !cordoned(t, w.Name()) {
		t.Fatalf("%s not cordoned after a failed drained step", w.Name())
	}
	c.kubectl("delete", "talosoperation", "zone", "--wait=false")
	testenv.Eventually(t, time.Minute, "the operation gone and its cordon lifted", func(ctx context.Context) (bool, error) {
		err := env.Client.Get(ctx, ctrlclient.ObjectKey{Namespace: c.ns, Name: "zone"}, &ichorv1.TalosOperation{})
		return apierrors.IsNotFound(err) && !cordoned(t, w.Name()), ctrlclient.IgnoreNotFound(err)
	})
}

// TestConfigTalosRefusalFailsStep: Talos refusing the apply itself (here
// PermissionDenied, as for a talosconfig whose role was changed to
// os:reader after preflight) fails the step with a reason of its own, a
// message that quotes Talos and says what to do, and nothing applied; a
// retry, once Talos accepts, applies it.
func TestConfigTalosRefusalFailsStep(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w := c.fleet.Machines()[1]
	before := fingerprints(t, c.fleet)
	var once sync.Once
	hook := func(s operation.StepRun) {
		if s.Step == executor.StepInspect && s.Err == nil && s.Machine == w.Name() {
			once.Do(func() {
				w.Inject(sim.Fault{Kind: sim.FaultError, Method: "ApplyConfiguration", Code: codes.PermissionDenied, Once: true})
			})
		}
	}
	m := c.zoneFails(w, ichorv1.ConfigModeAuto, hook, machineconfig.ReasonNotPermitted)
	for _, want := range []string{`apply the machine configuration: Talos says "simulated fault`, "needs the os:admin role"} {
		if !strings.Contains(m.Message, want) {
			t.Errorf("the failed step's message lacks %q: %q", want, m.Message)
		}
	}
	if after := fingerprints(t, c.fleet); !equalMaps(before, after) {
		t.Errorf("a refused apply changed a configuration: %v -> %v", before, after)
	}
	c.kubectl("annotate", "talosoperation", "zone", ichorv1.RetryAnnotation+"=true")
	got := c.waitSucceeded("zone", 2*time.Minute)
	if w.Config().Machine().NodeLabels()["ichor.test/zone"] != "a" || got.Status.Machines[0].Message != "applied live" {
		t.Errorf("after the retry: labels %v, message %q", w.Config().Machine().NodeLabels(), got.Status.Machines[0].Message)
	}
}
