package operation_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// boundary is where an operation stands: each machine's phase, step and attempt.
func boundary(op *ichorv1.TalosOperation) string {
	var b strings.Builder
	for _, m := range op.Status.Machines {
		fmt.Fprintf(&b, "%s=%s/%s/%d ", m.Name, m.Phase, m.Step, m.Attempts)
	}
	return b.String()
}

// TestControllerRestarts kills the controller after every step of a Talos
// upgrade, between the step's call and the status write that records it,
// and starts a new one: the operation completes, every step was killed
// after once, and every machine was upgraded, and rebooted, exactly once.
func TestControllerRestarts(t *testing.T) {
	for _, from := range []string{"v1.12.4", "v1.13.2"} {
		t.Run("from "+from, func(t *testing.T) {
			spec := sim.Cluster("", 1, 2)
			for i := range spec.Machines {
				spec.Machines[i].Talos = from
			}
			c := newCluster(t, spec)
			c.create("upgrade", talosSpec("v1.13.7"))
			killed := killAtEach(t, env.Client, keyOf(c.ns, "upgrade"), 40, 2*time.Minute, func(_ *ichorv1.TalosOperation, s operation.StepRun) (string, bool) {
				return s.Machine + "/" + s.Step, true
			}, c.startKillable)
			op := c.get("upgrade")
			rec := c.fleet.Recorder()
			for _, m := range c.fleet.Machines() {
				reboots := 0
				for _, a := range rec.Actions(m.Name()) {
					if a.Kind == sim.ActionReboot || a.Kind == sim.ActionUpgrade {
						reboots++
					}
				}
				if n := rec.UpgradesApplied(m.Name()); n != 1 || reboots != 1 || m.Version() != "v1.13.7" {
					t.Errorf("%s: %d upgrades, %d reboots, on %s; want 1, 1, v1.13.7", m.Name(), n, reboots, m.Version())
				}
			}
			// Every step the operation ran was killed after, once: the
			// history of each machine's steps is in its status.
			for _, m := range op.Status.Machines {
				for _, step := range []string{executor.StepInspect, executor.StepCordon, executor.StepDrain, executor.StepInstall, executor.StepUncordon} {
					if !killed[m.Name+"/"+step] {
						t.Errorf("no controller was killed after %s's %s; killed after %v", m.Name, step, killed)
					}
				}
			}
			t.Logf("%d controllers killed after %v", len(killed), killed)
		})
	}
}

// TestLeaderElection: of two replicas only the leader acts; stopping it
// hands over to the other, which finishes the next operation.
func TestLeaderElection(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 2))
	a := c.start(withLeaderElection())
	b := c.start(withLeaderElection())
	c.create("one", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitSucceeded("one", time.Minute)
	leader, standby := a, b
	if b.steps.total() > 0 {
		leader, standby = b, a
	}
	if leader.steps.total() == 0 || standby.steps.total() != 0 {
		t.Fatalf("steps run: leader %d, standby %d; exactly one replica must act", leader.steps.total(), standby.steps.total())
	}
	lease := leaderLease(t, c)
	if lease.Annotations[ichorv1.VersionAnnotation] != "v0.0.0-test" {
		t.Errorf("leader Lease version annotation %q", lease.Annotations[ichorv1.VersionAnnotation])
	}

	leader.Stop()
	c.create("two", rebootSpec(c.fleet.Machines()[2].Name()))
	c.waitSucceeded("two", time.Minute)
	if standby.steps.total() == 0 {
		t.Fatalf("the new leader ran no step")
	}
}

func leaderLease(t testing.TB, c *cluster) *coordinationv1.Lease {
	t.Helper()
	l := &coordinationv1.Lease{}
	testenv.Eventually(t, 30*time.Second, "the leader Lease to carry the version", func(ctx context.Context) (bool, error) {
		err := env.Client.Get(ctx, client.ObjectKey{Namespace: c.ctrlNS, Name: ichorv1.LeaderLeaseName}, l)
		return err == nil && l.Annotations[ichorv1.VersionAnnotation] != "", client.IgnoreNotFound(err) // until a replica leads
	})
	return l
}

// TestTalosconfigMissing: without the Secret the operation says so in a
// condition (no crash loop); once the Secret exists it runs.
func TestTalosconfigMissing(t *testing.T) {
	c := newClusterWithoutTalosconfig(t, sim.Cluster("", 1, 1))
	c.start()
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	op := c.waitFor("reboot", "to say the talosconfig is missing", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return meta.FindStatusCondition(op.Status.Conditions, "TalosAPIReady") != nil
	})
	cond := meta.FindStatusCondition(op.Status.Conditions, "TalosAPIReady")
	if cond.Reason != "TalosconfigMissing" || !strings.Contains(cond.Message, "kubectl -n "+c.ctrlNS+" create secret generic ichor-talosconfig") {
		t.Errorf("condition %+v", cond)
	}
	// A Secret that holds no usable talosconfig says so too.
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: ichorv1.TalosconfigSecret},
		Data: map[string][]byte{ichorv1.TalosconfigKey: []byte("context: nope\ncontexts: {nope: {endpoints: []}}\n")}}
	if err := env.Client.Create(context.Background(), secret); err != nil {
		t.Fatal(err)
	}
	op = c.waitFor("reboot", "to say the talosconfig is unusable", time.Minute, func(op *ichorv1.TalosOperation) bool {
		cond := meta.FindStatusCondition(op.Status.Conditions, "TalosAPIReady")
		return cond != nil && cond.Reason == "TalosconfigInvalid"
	})
	if n := c.fleet.Recorder().Calls("", "*"); n != 0 {
		t.Errorf("%d Talos API calls without a usable talosconfig", n)
	}
	if err := env.Client.Delete(context.Background(), secret); err != nil {
		t.Fatal(err)
	}
	c.writeTalosconfig()
	op = c.waitSucceeded("reboot", time.Minute)
	if meta.FindStatusCondition(op.Status.Conditions, "TalosAPIReady") != nil {
		t.Errorf("the TalosAPIReady condition stayed after the Secret appeared")
	}
	var evs []corev1.Event = c.events("reboot")
	if len(evs) == 0 {
		t.Errorf("no Events recorded")
	}
}

// TestTalosconfigChangeKeepsStepsInFlight: a change of the talosconfig
// Secret never breaks a step in flight. A change that keeps the talosconfig
// (a label, a refresh that writes the same data) keeps the client; a new
// talosconfig (a rotated client certificate) gives the steps that start
// next a new client, while the step in flight finishes on the old one.
func TestTalosconfigChangeKeepsStepsInFlight(t *testing.T) {
	spec := sim.Cluster("", 1, 0)
	spec.Machines[0].Talos = "v1.13.2"
	c := newCluster(t, spec)
	m := c.fleet.Machines()[0]
	// The pull hangs until cleared: the pull step is in flight meanwhile.
	clear := m.Inject(sim.Fault{Kind: sim.FaultHang, Method: "ImageService/Pull"})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	testenv.Eventually(t, time.Minute, "the installer pull to be in flight", func(context.Context) (bool, error) {
		return c.fleet.Recorder().Calls(m.Name(), "ImageService/Pull") == 1, nil
	})

	key := client.ObjectKey{Namespace: c.ctrlNS, Name: ichorv1.TalosconfigSecret}
	secret := &corev1.Secret{}
	if err := env.Client.Get(context.Background(), key, secret); err != nil {
		t.Fatal(err)
	}
	original := secret.Data[ichorv1.TalosconfigKey]
	// write stores data (and labels) in the Secret and waits until the
	// controller has read it: an unusable talosconfig shows as a condition,
	// a usable one lifts it.
	write := func(data []byte, labels map[string]string, usable bool) {
		t.Helper()
		s := &corev1.Secret{}
		if err := env.Client.Get(context.Background(), key, s); err != nil {
			t.Fatal(err)
		}
		s.Data[ichorv1.TalosconfigKey], s.Labels = data, labels
		if err := env.Client.Update(context.Background(), s); err != nil {
			t.Fatal(err)
		}
		c.waitFor("upgrade", fmt.Sprintf("to see the Secret (usable %v)", usable), time.Minute, func(op *ichorv1.TalosOperation) bool {
			return (meta.FindStatusCondition(op.Status.Conditions, "TalosAPIReady") == nil) == usable
		})
	}
	unusable := []byte("context: nope\ncontexts: {nope: {endpoints: []}}\n")
	// The same talosconfig under a new resourceVersion, with a label.
	write(unusable, nil, false)
	write(original, map[string]string{"refreshed": "yes"}, true)
	// A new talosconfig: another admin certificate for the same fleet.
	rotated, err := c.fleet.Talosconfig().Bytes()
	if err != nil {
		t.Fatal(err)
	}
	write(unusable, nil, false)
	write(rotated, nil, true)

	clear()
	c.waitSucceeded("upgrade", time.Minute)
	rec := c.fleet.Recorder()
	// Once by the pull step (the one in flight, not run again) and once,
	// from the machine's cache, by the install.
	if n := rec.Calls(m.Name(), "ImageService/Pull"); n != 2 {
		t.Errorf("the installer was pulled %d times, want twice (the pull step, the install)", n)
	}
	if n := rec.UpgradesApplied(m.Name()); n != 1 || m.Version() != "v1.13.7" {
		t.Errorf("%s: %d upgrades applied, on %s", m.Name(), n, m.Version())
	}
}
