package operation_test

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func (c *cluster) patchNode(name, patch string) {
	c.t.Helper()
	n := &corev1.Node{}
	n.Name = name
	if err := env.Client.Patch(context.Background(), n, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		c.t.Fatalf("patch node %s: %v", name, err)
	}
}

// TestTalosUpgrade: control planes strictly one at a time and first, never
// more than maxUnavailable workers down, every machine upgraded exactly
// once, a held machine skipped, the order label honoured. Both upgrade
// paths run: legacy MachineService.Upgrade from 1.12, and ImageService.Pull
// plus LifecycleService.Upgrade plus Reboot within 1.13.
func TestTalosUpgrade(t *testing.T) {
	tests := []struct {
		name, from, to string
		// legacy and lifecycle are the upgrade calls each machine takes.
		legacy, lifecycle int
	}{
		{"legacy API from 1.12 to 1.13", "v1.12.4", "v1.13.7", 1, 0},
		{"lifecycle API within 1.13", "v1.13.2", "v1.13.7", 0, 1},
		// Before 1.13.0-beta.0 LifecycleService answers Unimplemented: a
		// pre-release of 1.13 upgrades as 1.12 does.
		{"legacy API from an early 1.13", "v1.13.0-alpha.2", "v1.13.7", 1, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 3, 5)
			for i := range spec.Machines {
				spec.Machines[i].Talos = tt.from
			}
			// Long enough that the two workers of a batch are down together.
			spec.Durations.Reboot = 300 * time.Millisecond
			c := newCluster(t, spec)
			w := func(i int) string { return c.fleet.Machines()[2+i].Name() }
			held := w(5)
			c.patchNode(held, `{"metadata":{"annotations":{"ichor.maesh.dev/upgrade-hold":"waiting for a disk"}}}`)
			c.patchNode(w(4), `{"metadata":{"labels":{"ichor.maesh.dev/upgrade-order":"1"}}}`)
			c.patchNode(w(3), `{"metadata":{"labels":{"ichor.maesh.dev/upgrade-order":"2"}}}`)
			c.start()

			op := talosSpec(tt.to)
			op.MaxUnavailable = 2
			c.create("upgrade", op)
			got := c.waitSucceeded("upgrade", 2*time.Minute)

			rec := c.fleet.Recorder()
			cps, workers := rec.MaxDown()
			// The budget is an upper bound: how many workers are down together
			// below it depends on how fast each one drains on a loaded machine.
			if cps != 1 || workers < 1 || workers > 2 {
				t.Errorf("at most 1 control plane and 2 workers down at once; got %d and %d", cps, workers)
			}
			for _, m := range c.fleet.Machines() {
				want, wantVersion := 1, tt.to
				if m.Name() == held {
					want, wantVersion = 0, tt.from
				}
				if n := rec.UpgradesApplied(m.Name()); n != want {
					t.Errorf("%s: %d upgrades took effect, want %d", m.Name(), n, want)
				}
				if m.Version() != wantVersion {
					t.Errorf("%s runs %s, want %s", m.Name(), m.Version(), wantVersion)
				}
				if want := "factory.talos.dev/metal-installer/" + sim.EmptySchematic + ":" + tt.to; m.Name() != held && m.Image() != want {
					t.Errorf("%s installed from %s, want %s", m.Name(), m.Image(), want)
				}
				node := &corev1.Node{}
				if err := env.Client.Get(context.Background(), client.ObjectKey{Name: m.Name()}, node); err != nil {
					t.Fatal(err)
				}
				if v := machine.TalosVersion(node); v != wantVersion || node.Spec.Unschedulable {
					t.Errorf("Node %s: Talos %s, unschedulable %v; want %s, schedulable", m.Name(), v, node.Spec.Unschedulable, wantVersion)
				}
			}
			if n := rec.Calls("", "MachineService/Upgrade"); n != 7*tt.legacy {
				t.Errorf("MachineService.Upgrade called %d times, want %d", n, 7*tt.legacy)
			}
			if n := rec.Calls("", "LifecycleService/Upgrade"); n != 7*tt.lifecycle {
				t.Errorf("LifecycleService.Upgrade called %d times, want %d", n, 7*tt.lifecycle)
			}

			// Control planes first and one at a time; workers after, in label order.
			disruptive := map[sim.ActionKind]bool{sim.ActionReboot: true, sim.ActionUpgrade: true}
			var order []string
			var lastCPEnd time.Time
			firstWorker := time.Time{}
			for _, a := range rec.Actions("") {
				if !disruptive[a.Kind] {
					continue
				}
				order = append(order, a.Machine)
				if c.fleet.Machine(a.Machine).Role() == sim.ControlPlane {
					if a.End.After(lastCPEnd) {
						lastCPEnd = a.End
					}
				} else if firstWorker.IsZero() {
					firstWorker = a.Start
				}
			}
			if !firstWorker.After(lastCPEnd) {
				t.Errorf("a worker went down at %s, before the last control plane was back at %s", firstWorker, lastCPEnd)
			}
			if overlaps := rec.Overlaps(sim.ActionReboot, sim.ActionUpgrade); len(cpOverlaps(c, overlaps)) > 0 {
				t.Errorf("control planes disrupted at once: %+v", cpOverlaps(c, overlaps))
			}
			// With a budget of two, the two labelled workers start together,
			// first: the first worker down is one of them (which one goes down
			// second depends on how fast each drains, so it is not checked).
			if len(order) < 5 {
				t.Fatalf("disruption order %v: want at least 5 disruptions", order)
			}
			if first := order[3]; first != w(4) && first != w(3) {
				t.Errorf("disruption order %v: a labelled worker, %s or %s, must go first", order, w(4), w(3))
			}

			// Status: every machine done, the held one Skipped with why.
			if n := len(got.Status.Machines); n != 8 {
				t.Fatalf("status lists %d machines, want the 8 of the cluster", n)
			}
			for _, m := range got.Status.Machines {
				want := ichorv1.MachineSucceeded
				if m.Name == held {
					want = ichorv1.MachineSkipped
					if m.Message != "held by annotation ichor.maesh.dev/upgrade-hold: waiting for a disk" {
						t.Errorf("held machine's message: %q", m.Message)
					}
				}
				if m.Phase != want {
					t.Errorf("%s is %s, want %s", m.Name, m.Phase, want)
				}
				if m.Name != held && (m.From != tt.from || m.To != tt.to || m.StartedAt == nil || m.FinishedAt == nil) {
					t.Errorf("%s: from %q to %q started %v finished %v", m.Name, m.From, m.To, m.StartedAt, m.FinishedAt)
				}
			}
			if got.Status.Progress != "7/8, 1 held" || got.Status.Lock != "" || got.Status.CompletionTime == nil {
				t.Errorf("summary: progress %q lock %q completion %v", got.Status.Progress, got.Status.Lock, got.Status.CompletionTime)
			}
			// The message and the Ready condition say 7 of 8 and name the held one.
			wantMsg := "talos " + tt.to + " done on 7/8 machine(s), 1 held: " + held + " (held by annotation ichor.maesh.dev/upgrade-hold: waiting for a disk)"
			ready := meta.FindStatusCondition(got.Status.Conditions, ichorv1.ConditionReady)
			if got.Status.Message != wantMsg || ready == nil || ready.Message != wantMsg {
				t.Errorf("message %q, Ready %+v; want %q", got.Status.Message, ready, wantMsg)
			}
			testenv.Eventually(t, 30*time.Second, "a MachineSkipped Event for "+held, func(context.Context) (bool, error) {
				for _, e := range c.events("upgrade") {
					if e.Reason == "MachineSkipped" && strings.HasPrefix(e.Message, held+": held by annotation") {
						return true, nil
					}
				}
				return false, nil
			})
			names := []string{}
			for _, m := range got.Status.Machines {
				names = append(names, m.Name)
			}
			if !sort.SliceIsSorted(names[:3], func(i, j int) bool { return names[i] < names[j] }) || names[3] != w(4) || names[4] != w(3) {
				t.Errorf("status order %v", names)
			}
		})
	}
}

func cpOverlaps(c *cluster, os []sim.Overlap) []sim.Overlap {
	var out []sim.Overlap
	for _, o := range os {
		if c.fleet.Machine(o.A.Machine).Role() == sim.ControlPlane || c.fleet.Machine(o.B.Machine).Role() == sim.ControlPlane {
			out = append(out, o)
		}
	}
	return out
}

// TestAlreadyOnTarget: a machine already on the target is recorded
// Succeeded without being touched.
func TestAlreadyOnTarget(t *testing.T) {
	spec := sim.Cluster("", 1, 2)
	spec.Machines[2].Talos = "v1.13.7"
	c := newCluster(t, spec)
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	got := c.waitSucceeded("upgrade", time.Minute)
	already := spec.Machines[2].Name
	rec := c.fleet.Recorder()
	if n := rec.Calls(already, "Reboot") + rec.Calls(already, "Upgrade"); n != 0 || len(rec.Actions(already)) != 0 {
		t.Errorf("%s was touched: %d reboot/upgrade calls, actions %+v", already, n, rec.Actions(already))
	}
	for _, m := range got.Status.Machines {
		if m.Name == already && (m.Phase != ichorv1.MachineSucceeded || m.Message != "already on v1.13.7") {
			t.Errorf("%s: %s %q", m.Name, m.Phase, m.Message)
		}
	}
}

// TestHoldAfterStart: a hold annotation put on a machine after the
// operation started skips it if its work has not begun (Skipped, with the
// reason), and leaves it untouched.
func TestHoldAfterStart(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	release := c.fleet.Machine(w(1)).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Upgrade"})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to hang in "+w(1)+"'s install", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w(1))
		return m != nil && m.Step == "install"
	})
	c.patchNode(w(3), `{"metadata":{"annotations":{"ichor.maesh.dev/upgrade-hold":"a disk is replaced"}}}`)
	release()
	op := c.waitSucceeded("upgrade", time.Minute)
	if m := entryOf(op, w(3)); m.Phase != ichorv1.MachineSkipped || m.Message != "held by annotation ichor.maesh.dev/upgrade-hold: a disk is replaced" || m.StartedAt != nil {
		t.Errorf("%s: %s %q started %v; want Skipped with the hold's reason, never started", w(3), m.Phase, m.Message, m.StartedAt)
	}
	rec := c.fleet.Recorder()
	if n := rec.Calls(w(3), "*"); n != 0 || c.fleet.Machine(w(3)).Version() != sim.DefaultTalos {
		t.Errorf("%s was touched: %d Talos calls, runs %s", w(3), n, c.fleet.Machine(w(3)).Version())
	}
	if n := rec.UpgradesApplied(w(2)); n != 1 {
		t.Errorf("%s: %d upgrades, want 1", w(2), n)
	}
}

// TestPullFailsBeforeDisruption: an installer the registry does not have (a
// typo, v1.13.70) is
// found on the first machine before anything is disrupted: the pull (the
// legacy MachineService.ImagePull on hosts below 1.13) is a failed step on
// a machine still in service, every Node stays schedulable, and nothing is
// drained, installed or rebooted.
func TestPullFailsBeforeDisruption(t *testing.T) {
	tests := []struct{ name, from, method string }{
		{"ImageService within 1.13", "v1.13.2", "ImageService/Pull"},
		{"legacy ImagePull from 1.12", "v1.12.4", "MachineService/ImagePull"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 1, 2)
			spec.Unpublished = []string{"v1.13.70"}
			for i := range spec.Machines {
				spec.Machines[i].Talos = tt.from
			}
			c := newCluster(t, spec)
			c.start()
			c.create("typo", talosSpec("v1.13.70"))
			got := c.waitFor("typo", "to fail on the pull", time.Minute, func(op *ichorv1.TalosOperation) bool { return op.StepFailed() })
			first := c.fleet.Machines()[0].Name()
			if got.Status.FailureReason != "PullFailed" {
				t.Errorf("failureReason %q, want PullFailed", got.Status.FailureReason)
			}
			for _, m := range got.Status.Machines {
				switch {
				case m.Name == first && (m.Phase != ichorv1.MachineFailed || m.Step != "pull" || !strings.Contains(m.Message, "the machine was not disturbed")):
					t.Errorf("%s: %s at %s: %q; want Failed at pull", m.Name, m.Phase, m.Step, m.Message)
				case m.Name != first && m.Phase != ichorv1.MachinePending:
					t.Errorf("%s is %s, want Pending", m.Name, m.Phase)
				}
			}
			rec := c.fleet.Recorder()
			if n := rec.Calls(first, tt.method); n == 0 {
				t.Errorf("%s was never asked to pull through %s", first, tt.method)
			}
			for _, m := range c.fleet.Machines() {
				node := &corev1.Node{}
				if err := env.Client.Get(context.Background(), client.ObjectKey{Name: m.Name()}, node); err != nil {
					t.Fatal(err)
				}
				if node.Spec.Unschedulable {
					t.Errorf("Node %s was cordoned", m.Name())
				}
				for _, method := range []string{"MachineService/Upgrade", "LifecycleService/Upgrade", "Reboot"} {
					if n := rec.Calls(m.Name(), method); n != 0 {
						t.Errorf("%s: %s called %d times", m.Name(), method, n)
					}
				}
				if a := rec.Actions(m.Name()); len(a) != 0 {
					t.Errorf("%s was disrupted: %+v", m.Name(), a)
				}
			}
		})
	}
}

// TestEarlyUpgradeNotSentTwiceAfterACrash: a machine on a 1.13 pre-release
// without LifecycleService upgrades through the legacy call, which reboots
// it by itself. A controller killed between that call and the status write
// that records it leaves the next controller to run the step again, once
// the machine is back on the target: that one upgrades and reboots nothing
// more, as status counted the run before the call.
func TestEarlyUpgradeNotSentTwiceAfterACrash(t *testing.T) {
	const from, to = "v1.13.0-alpha.2", "v1.13.7"
	spec := sim.Cluster("", 1, 0)
	spec.Machines[0].Talos = from
	c := newCluster(t, spec)
	m := c.fleet.Machines()[0]
	killed := c.startKilledAfter(executor.StepInstall, func(s operation.StepRun) bool { return s.Step == executor.StepInstall })
	c.create("upgrade", talosSpec(to))
	killed()
	testenv.Eventually(t, time.Minute, m.Name()+" back on "+to, func(context.Context) (bool, error) {
		return !m.Down() && m.Version() == to, nil
	})
	c.start()
	c.waitSucceeded("upgrade", time.Minute)
	rec := c.fleet.Recorder()
	for _, method := range []string{"MachineService/Upgrade", "LifecycleService/Upgrade", "MachineService/Reboot"} {
		want := 0
		if method == "MachineService/Upgrade" {
			want = 1
		}
		if n := rec.Calls(m.Name(), method); n != want {
			t.Errorf("%s: %d %s calls, want %d", m.Name(), n, method, want)
		}
	}
	if n := rec.UpgradesApplied(m.Name()); n != 1 {
		t.Errorf("%s: %d upgrades took effect, want 1", m.Name(), n)
	}
}
