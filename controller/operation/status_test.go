package operation

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	kstatus "sigs.k8s.io/cli-utils/pkg/kstatus/status"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/manifests/argocd"
)

var (
	t0      = metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	started = &t0
)

// op builds an operation in a state: its machines' phases (first a control
// plane, then workers) and changes.
func opIn(phases []ichorv1.MachinePhase, change ...func(*ichorv1.TalosOperation)) *ichorv1.TalosOperation {
	op := &ichorv1.TalosOperation{}
	op.Generation = 3
	op.Status.Target = "talos v1.13.7"
	for i, p := range phases {
		role, name := ichorv1.RoleWorker, "w"+string(rune('0'+i))
		if i == 0 {
			role, name = ichorv1.RoleControlPlane, "cp"
		}
		m := ichorv1.MachineStatus{Name: name, Role: role, Phase: p}
		if p == ichorv1.MachineInProgress || p == ichorv1.MachineFailed {
			m.Step = "install"
		}
		if p == ichorv1.MachineFailed {
			m.Message = "rpc error: code = Internal"
		}
		op.Status.Machines = append(op.Status.Machines, m)
	}
	for _, c := range change {
		c(op)
	}
	return op
}

const (
	pending    = ichorv1.MachinePending
	inProgress = ichorv1.MachineInProgress
	succeeded  = ichorv1.MachineSucceeded
	skipped    = ichorv1.MachineSkipped
	failed     = ichorv1.MachineFailed
)

func isStarted(op *ichorv1.TalosOperation) { op.Status.StartTime = started }
func failedWith(reason string) func(*ichorv1.TalosOperation) {
	return func(op *ichorv1.TalosOperation) { isStarted(op); op.Status.FailureReason = reason }
}
func pausedSpec(op *ichorv1.TalosOperation) { op.Spec.Paused = true }
func retryAnnotated(op *ichorv1.TalosOperation) {
	op.Annotations = map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}
}
func waitingFor(holder string) func(*ichorv1.TalosOperation) {
	return func(op *ichorv1.TalosOperation) { op.Status.Lock, op.Status.LockHolder = ichorv1.LockWaiting, holder }
}
func refusedBy(check, msg string) func(*ichorv1.TalosOperation) {
	return func(op *ichorv1.TalosOperation) {
		setChecks(op, []preflight.Failure{{Check: check, Message: msg}}, false)
	}
}
func cancelledBy(who string) func(*ichorv1.TalosOperation) {
	return func(op *ichorv1.TalosOperation) {
		isStarted(op)
		op.Annotations = map[string]string{ichorv1.CancelAnnotation: who}
	}
}
func talosconfigMissing(op *ichorv1.TalosOperation) {
	meta.SetStatusCondition(&op.Status.Conditions, metav1.Condition{Type: ConditionTalosAPI, Status: metav1.ConditionFalse, Reason: "TalosconfigMissing", Message: "create the Secret"})
}

// phaseCases are the states every condition's test reads, with the phase,
// reason and message deriveStatus gives each.
var phaseCases = []struct {
	name           string
	op             *ichorv1.TalosOperation
	why            string
	phase          ichorv1.Phase
	reason, prefix string
}{
	{"new", opIn([]ichorv1.MachinePhase{pending, pending}), "", ichorv1.PhasePending, "", "checking"},
	{"no talosconfig yet", opIn([]ichorv1.MachinePhase{pending}, talosconfigMissing), "", ichorv1.PhasePending, "TalosconfigMissing", "create the Secret"},
	{"waiting for the lock", opIn([]ichorv1.MachinePhase{pending}, waitingFor("job/a/b")), "waiting for the cluster lock, held by job/a/b since then", ichorv1.PhasePaused, ichorv1.ReasonClusterLockHeld, "waiting for the cluster lock, held by job/a/b since"},
	{"waiting for the lock, read again", opIn([]ichorv1.MachinePhase{pending}, waitingFor("job/a/b")), "", ichorv1.PhasePaused, ichorv1.ReasonClusterLockHeld, "waiting for the cluster lock, held by job/a/b"},
	{"running", opIn([]ichorv1.MachinePhase{succeeded, inProgress}, isStarted), "", ichorv1.PhaseRunning, "", "running"},
	{"running, held back by the budget", opIn([]ichorv1.MachinePhase{succeeded, pending}, isStarted), "waiting for workers to come back", ichorv1.PhaseRunning, "", "waiting for workers to come back"},
	{"running without a talosconfig", opIn([]ichorv1.MachinePhase{succeeded, inProgress}, isStarted, talosconfigMissing), "", ichorv1.PhaseRunning, "TalosconfigMissing", "create the Secret"},
	{"paused by an operator", opIn([]ichorv1.MachinePhase{succeeded, pending}, isStarted, pausedSpec), "", ichorv1.PhasePaused, ichorv1.ReasonPausedByOperator, pausedByYou},
	{"paused by an operator before the start", opIn([]ichorv1.MachinePhase{pending}, pausedSpec, waitingFor("x")), "", ichorv1.PhasePaused, ichorv1.ReasonPausedByOperator, pausedByYou},
	{"failed", opIn([]ichorv1.MachinePhase{succeeded, failed}, failedWith("InstallFailed")), "", ichorv1.PhasePaused, ichorv1.ReasonStepFailed, "InstallFailed on w1 (install): rpc error: code = Internal"},
	{"failed, a reboot still settling", opIn([]ichorv1.MachinePhase{succeeded, failed, inProgress}, failedWith("InstallFailed")), "", ichorv1.PhasePaused, ichorv1.ReasonStepFailed, "InstallFailed on w1 (install): rpc error: code = Internal; nothing new starts, and the steps in flight settle first: w2: install"},
	{"failed twice", opIn([]ichorv1.MachinePhase{succeeded, failed, failed}, failedWith("InstallFailed")), "", ichorv1.PhasePaused, ichorv1.ReasonStepFailed, "InstallFailed on w1 (install): rpc error: code = Internal; 2 machines failed: w1,w2"},
	{"failed and paused, retry waits", opIn([]ichorv1.MachinePhase{failed}, failedWith("EtcdUnhealthy"), pausedSpec, retryAnnotated), "", ichorv1.PhasePaused, ichorv1.ReasonStepFailed, "EtcdUnhealthy on cp (install): rpc error: code = Internal" + retryWaits},
	{"succeeded", opIn([]ichorv1.MachinePhase{succeeded, skipped}, isStarted), "", ichorv1.PhaseSucceeded, "Succeeded", "talos v1.13.7 done on 1/2 machine(s), 1 skipped: w1"},
	{"every machine skipped, not started", opIn([]ichorv1.MachinePhase{skipped}), "", ichorv1.PhasePending, "", "checking"},
	{"refused", opIn([]ichorv1.MachinePhase{pending}, refusedBy(preflight.TalosVersionNewer, "v1.12.2 is not newer")), "", ichorv1.PhaseRefused, preflight.ConditionReason, "preflight refused it, nothing ran: check TalosVersionNewer failed (its condition says what would pass); to run it anyway, an ichor-admin sets spec.override: true"},
	{"refused, not overridable", opIn(nil, refusedBy(CheckKindSupported, "kind etcd-restore")), "", ichorv1.PhaseRefused, preflight.ConditionReason, "preflight refused it, nothing ran: check KindSupported failed (its condition says what would pass)"},
	{"cancelled, a step settling", opIn([]ichorv1.MachinePhase{succeeded, inProgress, pending}, cancelledBy("alice")), "", ichorv1.PhaseCancelled, "Cancelled",
		"cancelled by alice; done on 1/3 machine(s): cp; the steps in flight settle before the cordons are lifted and the cluster lock is let go: w1: install"},
	{"cancelled", opIn([]ichorv1.MachinePhase{succeeded, succeeded, skipped, pending}, cancelledBy("")), "", ichorv1.PhaseCancelled, "Cancelled",
		"cancelled by an operator; done on 2/4 machine(s): cp, w1"},
}

func derived(t *testing.T, i int) *ichorv1.TalosOperation {
	t.Helper()
	op := phaseCases[i].op.DeepCopy()
	deriveStatus(op, t0, phaseCases[i].why)
	return op
}

func TestDeriveStatusPhase(t *testing.T) {
	for i, tt := range phaseCases {
		t.Run(tt.name, func(t *testing.T) {
			op := derived(t, i)
			st := op.Status
			if st.Phase != tt.phase || st.Reason != tt.reason || len(st.Message) < len(tt.prefix) || st.Message[:len(tt.prefix)] != tt.prefix {
				t.Errorf("got %s/%q %q, want %s/%q %q...", st.Phase, st.Reason, st.Message, tt.phase, tt.reason, tt.prefix)
			}
			if st.ObservedGeneration != op.Generation {
				t.Errorf("observedGeneration %d, want %d", st.ObservedGeneration, op.Generation)
			}
			terminal := tt.phase == ichorv1.PhaseSucceeded || tt.phase == ichorv1.PhaseRefused || tt.phase == ichorv1.PhaseCancelled
			if (st.CompletionTime != nil) != terminal {
				t.Errorf("completionTime %v on a %s operation", st.CompletionTime, st.Phase)
			}
			if st.Lock == ichorv1.LockWaiting && st.Reason != ichorv1.ReasonClusterLockHeld || st.LockHolder != "" && st.Lock != ichorv1.LockWaiting {
				t.Errorf("lock %q holder %q on a %s/%s operation", st.Lock, st.LockHolder, st.Phase, st.Reason)
			}
		})
	}
}

// conditionCase checks one condition against every state of phaseCases.
func conditionCase(t *testing.T, conditionType string, want map[string]metav1.ConditionStatus) {
	t.Helper()
	for i, tt := range phaseCases {
		t.Run(tt.name, func(t *testing.T) {
			op := derived(t, i)
			c := meta.FindStatusCondition(op.Status.Conditions, conditionType)
			if c == nil {
				t.Fatalf("no %s condition", conditionType)
			}
			w, ok := want[tt.name]
			if !ok {
				w = metav1.ConditionFalse
			}
			if c.Status != w || c.ObservedGeneration != op.Generation || c.Message != op.Status.Message || c.Reason == "" {
				t.Errorf("%s = %s/%s %q (generation %d), want %s with the message %q", conditionType, c.Status, c.Reason, c.Message, c.ObservedGeneration, w, op.Status.Message)
			}
		})
	}
}

func TestSetReadyCondition(t *testing.T) {
	conditionCase(t, ichorv1.ConditionReady, map[string]metav1.ConditionStatus{"succeeded": metav1.ConditionTrue})
}

func TestSetProgressingCondition(t *testing.T) {
	conditionCase(t, ichorv1.ConditionProgressing, map[string]metav1.ConditionStatus{
		"running": metav1.ConditionTrue, "running, held back by the budget": metav1.ConditionTrue, "running without a talosconfig": metav1.ConditionTrue,
	})
}

func TestSetStalledCondition(t *testing.T) {
	conditionCase(t, ichorv1.ConditionStalled, map[string]metav1.ConditionStatus{
		"failed": metav1.ConditionTrue, "failed twice": metav1.ConditionTrue, "failed and paused, retry waits": metav1.ConditionTrue,
		"refused": metav1.ConditionTrue, "refused, not overridable": metav1.ConditionTrue, "cancelled": metav1.ConditionTrue,
	})
}

func TestSetReconcilingCondition(t *testing.T) {
	want := map[string]metav1.ConditionStatus{}
	for _, tt := range phaseCases {
		want[tt.name] = metav1.ConditionTrue
	}
	for _, done := range []string{"succeeded", "failed", "failed twice", "failed and paused, retry waits", "refused", "refused, not overridable", "cancelled"} {
		want[done] = metav1.ConditionFalse
	}
	conditionCase(t, ichorv1.ConditionReconciling, want)
}

func TestSetPausedCondition(t *testing.T) {
	conditionCase(t, ichorv1.ConditionPaused, map[string]metav1.ConditionStatus{
		"waiting for the lock": metav1.ConditionTrue, "waiting for the lock, read again": metav1.ConditionTrue,
		"paused by an operator": metav1.ConditionTrue, "paused by an operator before the start": metav1.ConditionTrue,
		"failed": metav1.ConditionTrue, "failed twice": metav1.ConditionTrue, "failed and paused, retry waits": metav1.ConditionTrue,
		"failed, a reboot still settling": metav1.ConditionTrue,
	})
}

// gitOpsHealth is what kstatus (Flux, kpt) and Argo CD must say of each of
// phaseCases: still moving by itself is InProgress (Progressing), succeeded
// is Current (Healthy), refused, stopped on a failed step or cancelled (once
// its steps in flight have settled) is Failed (Degraded): it will not do
// what it was created for.
func gitOpsHealth(name string) (kstatus.Status, string) {
	switch name {
	case "succeeded":
		return kstatus.CurrentStatus, "Healthy"
	case "failed", "failed twice", "failed and paused, retry waits", "refused", "refused, not overridable", "cancelled":
		return kstatus.FailedStatus, "Degraded"
	}
	return kstatus.InProgressStatus, "Progressing"
}

// TestKstatus: kstatus, which Flux and kpt use to wait on objects, reads
// every state as the specification means it.
func TestKstatus(t *testing.T) {
	for i, tt := range phaseCases {
		t.Run(tt.name, func(t *testing.T) {
			w, _ := gitOpsHealth(tt.name)
			if got := kstatusOf(t, derived(t, i)); got.Status != w {
				t.Errorf("kstatus %s (%s), want %s", got.Status, got.Message, w)
			}
		})
	}
}

// TestArgoCDHealth: Argo CD, running manifests/argocd/health.lua, reads
// every state as kstatus does, with the operation's message.
func TestArgoCDHealth(t *testing.T) {
	for i, tt := range phaseCases {
		t.Run(tt.name, func(t *testing.T) {
			op := derived(t, i)
			_, w := gitOpsHealth(tt.name)
			got, err := argocd.Check(unstructuredOf(t, op))
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != w || got.Message != op.Status.Message {
				t.Errorf("Argo CD health %s %q, want %s %q", got.Status, got.Message, w, op.Status.Message)
			}
		})
	}
}

// unstructuredOf is the operation as the API server serves it.
func unstructuredOf(t *testing.T, op *ichorv1.TalosOperation) map[string]any {
	t.Helper()
	op = op.DeepCopy()
	op.APIVersion, op.Kind = ichorv1.GroupVersion.String(), "TalosOperation"
	content, err := runtime.DefaultUnstructuredConverter.ToUnstructured(op)
	if err != nil {
		t.Fatal(err)
	}
	return content
}

func kstatusOf(t *testing.T, op *ichorv1.TalosOperation) *kstatus.Result {
	t.Helper()
	res, err := kstatus.Compute(&unstructured.Unstructured{Object: unstructuredOf(t, op)})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// TestFailuresOf5000MachinesFit: 5,000 machines that all failed, each with
// a long message, still fit in one object under 1 MiB once status is
// derived; the first failure keeps its message, cut.
func TestFailuresOf5000MachinesFit(t *testing.T) {
	start := metav1.NewTime(time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC))
	op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos}}
	st := &op.Status
	st.StartTime, st.Target, st.FailureReason = &start, "talos v1.13.7", "InstallFailed"
	long := strings.Repeat("pull factory.talos.dev/metal-installer: rpc error: code = Unavailable desc = connection refused; ", 20)
	for i := range 5000 {
		st.Machines = append(st.Machines, ichorv1.MachineStatus{
			Name: fmt.Sprintf("worker-pool-a-%05d", i), Role: ichorv1.RoleWorker, Phase: ichorv1.MachineFailed,
			Step: "install", Attempts: 1, StartedAt: &start, FinishedAt: &start, From: "v1.12.4", To: "v1.13.7", Message: long,
		})
	}
	deriveStatus(op, start, "")
	b, err := json.Marshal(op)
	if err != nil {
		t.Fatal(err)
	}
	const budget = 1 << 20
	t.Logf("5,000 failed machines: %d bytes of JSON, %.2f of the 1 MiB budget", len(b), float64(len(b))/budget)
	if len(b) >= budget {
		t.Errorf("status of 5,000 failed machines is %d bytes, over the %d budget", len(b), budget)
	}
	if first := st.Machines[0].Message; first == "" || !strings.HasPrefix(long, strings.TrimSuffix(first, "…")) || len(first) > maxMessage {
		t.Errorf("the first failure's message is %q", first)
	}
}

// TestEndingMessageIsWhole: the message of the step that took the API
// away (a shutdown's, longer than any other) is the operation's, whole.
func TestEndingMessageIsWhole(t *testing.T) {
	start := metav1.NewTime(time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC))
	op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, Shutdown: &ichorv1.ClusterShutdown{}}}
	ends := executor.ShutdownEnds(op)
	st := &op.Status
	st.StartTime = &start
	st.Machines = []ichorv1.MachineStatus{
		{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, Step: executor.StepShutdownControlPlanes, Calls: 1,
			FinishedAt: &start, Message: ends},
		{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, FinishedAt: &start, Message: "in the call made from cp-1"},
	}
	if len(ends) <= maxMessage {
		t.Fatalf("the shutdown's message is %d bytes, no longer than other messages may be (%d): the test shows nothing", len(ends), maxMessage)
	}
	deriveStatus(op, start, "")
	if st.Message != ends || st.Machines[0].Message != ends {
		t.Errorf("the operation's message is %q, its ending machine's %q; want the shutdown's whole", st.Message, st.Machines[0].Message)
	}
}

// stagedOp is an operation over cp, w1 and w2 (phases in that order)
// in stage i of two: control planes one at a time, then every machine.
func stagedOp(i int, phases []ichorv1.MachinePhase, change ...func(*ichorv1.TalosOperation)) *ichorv1.TalosOperation {
	op := opIn(phases, append([]func(*ichorv1.TalosOperation){isStarted}, change...)...)
	op.Status.Target = "kubernetes v1.36.2"
	op.Status.Stages = []ichorv1.StageStatus{
		{Name: "control-plane", Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOneAtATime, StartedAt: started},
		{Name: "kubelet", Order: ichorv1.StageRolling},
	}
	for j := 1; j <= i; j++ {
		op.Status.Stages[j-1].FinishedAt, op.Status.Stages[j].StartedAt = started, started
	}
	op.Status.Stage = op.Status.Stages[i].Name
	return op
}

// TestDeriveStatusStages: a stage done everywhere is recorded finished and
// the operation runs on into the next; it succeeds only once its last
// stage is done; progress and the messages speak of the stage in progress.
func TestDeriveStatusStages(t *testing.T) {
	tests := []struct {
		name             string
		op               *ichorv1.TalosOperation
		phase            ichorv1.Phase
		progress, prefix string
		finished         []bool
	}{
		{"first stage running", stagedOp(0, []ichorv1.MachinePhase{inProgress, pending, pending}), ichorv1.PhaseRunning, "0/1", "running", []bool{false, false}},
		{"first stage done", stagedOp(0, []ichorv1.MachinePhase{succeeded, pending, pending}), ichorv1.PhaseRunning, "1/1", "running", []bool{true, false}},
		{"last stage running", stagedOp(1, []ichorv1.MachinePhase{succeeded, inProgress, pending}), ichorv1.PhaseRunning, "1/3", "running", []bool{true, false}},
		{"last stage done", stagedOp(1, []ichorv1.MachinePhase{succeeded, succeeded, skipped}), ichorv1.PhaseSucceeded, "2/3, 1 skipped", "kubernetes v1.36.2 done on 2/3 machine(s), 1 skipped: w2", []bool{true, true}},
		{"cancelled in a stage", stagedOp(1, []ichorv1.MachinePhase{succeeded, pending, pending}, cancelledBy("alice")), ichorv1.PhaseCancelled, "1/3", "cancelled by alice in stage kubelet; done there on 1/3 machine(s): cp", []bool{true, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			op := tt.op.DeepCopy()
			deriveStatus(op, t0, "")
			st := op.Status
			if st.Phase != tt.phase || st.Progress != tt.progress || !strings.HasPrefix(st.Message, tt.prefix) {
				t.Errorf("got %s %s %q, want %s %s %q...", st.Phase, st.Progress, st.Message, tt.phase, tt.progress, tt.prefix)
			}
			for i, s := range st.Stages {
				if (s.FinishedAt != nil) != tt.finished[i] {
					t.Errorf("stage %s finishedAt %v, want finished %v", s.Name, s.FinishedAt, tt.finished[i])
				}
			}
		})
	}
}
