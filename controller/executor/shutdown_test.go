package executor

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestShutdownSteps: the workers are drained unless force (then they are
// cordoned and only the controller's own pod moves), the control planes' stage ends the
// operation with one irreversible call.
func TestShutdownSteps(t *testing.T) {
	op := func(force bool, stage string) *ichorv1.TalosOperation {
		return &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{Force: force}},
			Status: ichorv1.TalosOperationStatus{Stage: stage}}
	}
	tests := []struct {
		name string
		op   *ichorv1.TalosOperation
		want []string
	}{
		{"worker", op(false, StageWorkers), []string{StepRecordBoot, StepCordon, StepDrain, StepShutdown, StepWaitDown}},
		{"worker, force", op(true, StageWorkers), []string{StepRecordBoot, StepCordon, StepEvictSelf, StepShutdown, StepWaitDown}},
		{"control planes", op(false, StageControlPlanes), []string{StepCheckControlPlanes, StepShutdownControlPlanes}},
		{"safety snapshot", op(false, StageSnapshot), []string{StepSaveSnapshot}},
	}
	for _, tt := range tests {
		steps := ClusterShutdown{}.Steps(tt.op, &ichorv1.MachineStatus{})
		var got []string
		for _, s := range steps {
			got = append(got, s.Name)
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: steps %v, want %v", tt.name, got, tt.want)
		}
		last := steps[len(steps)-1]
		if ends := tt.op.Status.Stage == StageControlPlanes; ends != (last.Ends != "" && last.Irreversible) {
			t.Errorf("%s: last step %s Ends %q, Irreversible %v", tt.name, last.Name, last.Ends, last.Irreversible)
		}
	}
}

// TestShutdownStages: the safety snapshot's stage comes first, once,
// where spec.shutdown.snapshot names a location; the final message says
// where the snapshot is, or that none was taken.
func TestShutdownStages(t *testing.T) {
	for _, tt := range []struct {
		snapshot string
		stages   []string
		says     string
	}{
		{"", []string{StageWorkers, StageControlPlanes}, NoSnapshotLocation},
		{"s3://backups/before.db", []string{StageSnapshot, StageWorkers, StageControlPlanes}, "kubectl ichor restore etcd --from s3://backups/before.db"},
	} {
		op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{Snapshot: tt.snapshot}}}
		var got []string
		for _, st := range (ClusterShutdown{}).Stages(op) {
			got = append(got, st.Name)
			if st.Name == StageSnapshot && st.Order != ichorv1.StageOnce {
				t.Errorf("the snapshot stage's order is %s, want Once", st.Order)
			}
		}
		if !reflect.DeepEqual(got, tt.stages) {
			t.Errorf("snapshot %q: stages %v, want %v", tt.snapshot, got, tt.stages)
		}
		if ends := ShutdownEnds(op); !strings.Contains(ends, tt.says) {
			t.Errorf("snapshot %q: the final message %q does not say %q", tt.snapshot, ends, tt.says)
		}
	}
}

// TestShutdownScope: the whole cluster, and nothing else: a selector or a
// held control plane (they all stop together) refuses it, saying what to do.
func TestShutdownScope(t *testing.T) {
	node := func(name string, cp, held bool) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}, Annotations: map[string]string{}}}
		if cp {
			n.Labels["node-role.kubernetes.io/control-plane"] = ""
		}
		if held {
			n.Annotations[ichorv1.UpgradeHoldAnnotation] = "true"
		}
		return n
	}
	op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown}}
	if got, err := (ClusterShutdown{}).Scope(op, []*corev1.Node{node("cp", true, false), node("w", false, true)}); err != nil || len(got) != 2 {
		t.Errorf("a held worker: %d machines, %v", len(got), err)
	}
	if _, err := (ClusterShutdown{}).Scope(op, []*corev1.Node{node("cp", true, true)}); err == nil || !strings.Contains(err.Error(), "kubectl annotate node cp "+ichorv1.UpgradeHoldAnnotation+"-") {
		t.Errorf("a held control plane: %v", err)
	}
	op.Spec.Machines = &metav1.LabelSelector{}
	if _, err := (ClusterShutdown{}).Scope(op, nil); err == nil || !strings.Contains(err.Error(), "remove spec.machines") {
		t.Errorf("spec.machines: %v", err)
	}
}

// TestCameBack: the time is the first one recorded; a machine is back once
// its Node has been Ready since the shutdown, not on the Ready it reported
// before it.
func TestCameBack(t *testing.T) {
	ended := metav1.NewTime(time.Now().Add(-time.Minute))
	ready := func(name string, at time.Time) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{
			{Type: corev1.NodeReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.NewTime(at), LastTransitionTime: metav1.NewTime(at)}}}}
	}
	op := &ichorv1.TalosOperation{Status: ichorv1.TalosOperationStatus{CompletionTime: &ended,
		Machines: []ichorv1.MachineStatus{{Name: "cp"}, {Name: "w1"}, {Name: "w2"}}}}
	e := &Env{Op: op, Nodes: []*corev1.Node{ready("cp", time.Now()), ready("w1", ended.Add(-time.Second))}}
	c := cameBack(e, "")
	if c.Reason != ReasonMachinesMissing || !strings.Contains(c.Message, "1/3 machines back") || !strings.HasSuffix(c.Message, "w1, w2") {
		t.Errorf("first look: %s %s", c.Reason, c.Message)
	}
	first := metav1.NewTime(time.Now().Add(-10 * time.Second).Truncate(time.Second))
	c.LastTransitionTime = first
	op.Status.Conditions = []metav1.Condition{c}
	e.Nodes = []*corev1.Node{ready("cp", time.Now()), ready("w1", time.Now()), ready("w2", time.Now())}
	c = cameBack(e, "")
	if c.Reason != ReasonAllMachinesBack || !c.LastTransitionTime.Equal(&first) || !strings.Contains(c.Message, first.UTC().Format(time.RFC3339)) {
		t.Errorf("all back: %s %s at %s, want the first time %s", c.Reason, c.Message, c.LastTransitionTime, first)
	}
}

// TestEndedAfterAPartialCall: the shutdown call of every control plane
// went out, but the control plane that made it kept running (its part was
// refused) and no controller recorded that. While the call had reached
// nobody, the step runs again; once it has reached the others, never:
// while they are off it looks again, and once they are powered on again
// the cluster is back, with the one that kept running named.
func TestEndedAfterAPartialCall(t *testing.T) {
	f, c := fleet(t, sim.Cluster("", 3, 0))
	cps := f.ControlPlanes()
	lead := cps[0]
	e := env(f, c, lead, ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{}})
	ended := metav1.Now()
	e.Op.Status.CompletionTime = &ended
	for _, m := range cps {
		entry := ichorv1.MachineStatus{Name: m.Name(), Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, BootID: m.BootID()}
		if m == lead {
			entry.Step, entry.Calls = StepShutdownControlPlanes, 1
		}
		e.Op.Status.Machines = append(e.Op.Status.Machines, entry)
	}
	// Nodes that say where each machine answers, Ready; the others' said so
	// just now, the lead's (up all along) last before the shutdown.
	nodes := func() {
		e.Nodes = nil
		for _, m := range cps {
			said := metav1.Now()
			if m == lead {
				said = metav1.NewTime(ended.Add(-time.Minute))
			}
			e.Nodes = append(e.Nodes, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: m.Name()}, Status: corev1.NodeStatus{
				Addresses:  []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: m.Address()}},
				Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, LastHeartbeatTime: said, LastTransitionTime: said}}}})
		}
	}
	nodes()
	ctx := context.Background()
	ended1 := func(what string) EndState {
		t.Helper()
		got, err := ClusterShutdown{}.Ended(ctx, e)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return got
	}

	if got := ended1("nothing reached"); !got.Relaunch || got.Condition != nil {
		t.Errorf("every control plane runs as before: %+v, want a relaunch", got)
	}

	for _, m := range cps[1:] {
		if err := talos.Shutdown(ctx, c, m.Address(), true); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, time.Minute, "the others off", func(context.Context) (bool, error) { return cps[1].Off() && cps[2].Off(), nil })
	if got := ended1("the others off"); got.Relaunch || got.Condition != nil || got.Recheck == 0 {
		t.Errorf("the others are off: %+v, want to look again later, no relaunch", got)
	}

	for _, m := range cps[1:] {
		if err := m.PowerOn(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, time.Minute, "the others back", func(ctx context.Context) (bool, error) {
		for _, m := range cps[1:] {
			if _, err := talos.BootID(ctx, c, m.Address()); err != nil {
				return false, nil
			}
		}
		return true, nil
	})
	nodes()
	got := ended1("the others back")
	if got.Relaunch || got.Condition == nil || got.Condition.Reason != ReasonAllMachinesBack || !got.Done || !got.Uncordon ||
		!strings.Contains(got.Condition.Message, lead.Name()+" kept running: its part of the shutdown call failed") {
		t.Errorf("the others powered on again: %+v, want the cluster back, %s named as kept running, no relaunch", got, lead.Name())
	}
}
