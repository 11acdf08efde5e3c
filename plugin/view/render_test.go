package view

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/ from the current output")

// now is the fixed clock of every test; fixtures are relative to it.
var now = time.Date(2026, 8, 22, 10, 30, 0, 0, time.UTC)

func ago(d time.Duration) *metav1.Time { t := metav1.NewTime(now.Add(-d)); return &t }

func machine(name string, role ichorv1.MachineRole, phase ichorv1.MachinePhase, step string, started, finished time.Duration, msg string) ichorv1.MachineStatus {
	m := ichorv1.MachineStatus{Name: name, Role: role, Phase: phase, Step: step, Message: msg, From: "v1.12.7", To: "v1.13.7"}
	if started > 0 {
		m.StartedAt = ago(started)
		m.Attempts = 1
	}
	if finished > 0 {
		m.FinishedAt = ago(finished)
	}
	return m
}

func baseOp() *ichorv1.TalosOperation {
	return &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Name: "upgrade-talos-7fk2q", Namespace: "prod", Generation: 1, CreationTimestamp: *ago(13 * time.Minute)},
		Spec:       ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7"}, MaxUnavailable: 1},
	}
}

// scenarios are the states the renderer is golden-tested in.
func scenarios() map[string]*ichorv1.TalosOperation {
	s := map[string]*ichorv1.TalosOperation{}

	s["new"] = baseOp()

	running := baseOp()
	running.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Target: "talos v1.13.7", Progress: "1/7", Current: "cp-2",
		StartTime: ago(12 * time.Minute), ObservedGeneration: 1, Message: "upgrading cp-2",
		Machines: []ichorv1.MachineStatus{
			machine("cp-1", ichorv1.RoleControlPlane, ichorv1.MachineSucceeded, "", 12*time.Minute, 8*time.Minute, "running v1.13.7"),
			machine("cp-2", ichorv1.RoleControlPlane, ichorv1.MachineInProgress, "reboot", 45*time.Second, 0, "waiting for boot ID change"),
			machine("cp-3", ichorv1.RoleControlPlane, ichorv1.MachinePending, "", 0, 0, ""),
			machine("worker-1", ichorv1.RoleWorker, ichorv1.MachinePending, "", 0, 0, ""),
			machine("worker-2", ichorv1.RoleWorker, ichorv1.MachinePending, "", 0, 0, ""),
			machine("worker-3", ichorv1.RoleWorker, ichorv1.MachineSkipped, "", 0, 0, "held by ichor.maesh.dev/upgrade-hold"),
			machine("worker-4", ichorv1.RoleWorker, ichorv1.MachinePending, "", 0, 0, ""),
		},
	}
	s["running"] = running

	failed := running.DeepCopy()
	failed.Status.Phase, failed.Status.Reason = ichorv1.PhasePaused, ichorv1.ReasonStepFailed
	failed.Status.FailureReason = "InstallFailed"
	failed.Status.Machines[1].Step = "install"
	failed.Status.Message = "paused: a step failed\nsee the machine's message"
	failed.Status.RetryCount = 1
	failed.Status.Machines[1].Phase = ichorv1.MachineFailed
	failed.Status.Machines[1].Attempts = 2
	failed.Status.Machines[1].FinishedAt = ago(30 * time.Second)
	// A multi-line message with a terminal escape in it: it must stay on one
	// line and must not reach the terminal as an escape.
	// The image reference is shortened; the error is shown in full.
	failed.Status.Machines[1].Message = "pull factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.13.7: " +
		"rpc error: code = Unknown desc = failed to pull image: failed to resolve reference: unexpected status from HEAD request:\n\x1b[31mi/o timeout\x1b[0m"
	s["failed"] = failed

	both := failed.DeepCopy()
	both.Spec.Paused = true
	both.Annotations = map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}
	s["paused-failed-retry-pending"] = both

	lock := baseOp()
	lock.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonClusterLockHeld, Lock: ichorv1.LockWaiting,
		LockHolder: ichorv1.OperationIdentity("prod", "rotate-ca-x9"), ObservedGeneration: 1,
	}
	s["lock-wait"] = lock

	// As the controller writes a refusal: the phase message and the
	// standard conditions name the checks; each check's condition says
	// what would pass.
	refused := baseOp()
	refused.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRefused, Reason: "PreflightFailed", ObservedGeneration: 1,
		Message:   ichorv1.RefusedSummary([]string{"TalosMinorSkip", "CompatibilityTable"}),
		StartTime: ago(time.Minute), CompletionTime: ago(50 * time.Second),
		Conditions: []metav1.Condition{
			{Type: ichorv1.ConditionReady, Status: metav1.ConditionFalse, Reason: "Refused", Message: ichorv1.RefusedSummary([]string{"TalosMinorSkip", "CompatibilityTable"})},
			{Type: "TalosMinorSkip", Status: metav1.ConditionFalse, Reason: "PreflightFailed", Message: "Talos v1.13.7 is 2 minors ahead of v1.11.6, the lowest version running (on all 7 machines), and Talos is upgraded one minor at a time; go through the latest patch of each minor: v1.12.7, then v1.13.7"},
			{Type: "CompatibilityTable", Status: metav1.ConditionFalse, Reason: "PreflightFailed", Message: "Kubernetes v1.33.4 with Talos v1.13.7 is not in Ichor's compatibility table, which lists Kubernetes 1.31 - 1.36 with Talos 1.13 (see kubectl ichor compat)"},
		},
	}
	s["refused"] = refused
	// A kind this controller does not carry out: override cannot help.
	kind := baseOp()
	kind.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRefused, Reason: "PreflightFailed", ObservedGeneration: 1,
		Message:   ichorv1.RefusedSummary([]string{ichorv1.CheckKindSupported}),
		StartTime: ago(time.Minute), CompletionTime: ago(50 * time.Second),
		Conditions: []metav1.Condition{
			{Type: ichorv1.CheckKindSupported, Status: metav1.ConditionFalse, Reason: "PreflightFailed", Message: ichorv1.KindNotCarriedOut(ichorv1.KindKeyRotation, []ichorv1.OperationKind{ichorv1.KindTalos, ichorv1.KindNode})},
		},
	}
	s["refused-kind"] = kind

	done := running.DeepCopy()
	done.Status.Phase = ichorv1.PhaseSucceeded
	// As the controller says it: a held machine is not done.
	done.Status.Lock, done.Status.Current, done.Status.Progress = "", "", "6/7, 1 held"
	done.Status.Message = "talos v1.13.7 done on 6/7 machine(s), 1 held: worker-3 (held by ichor.maesh.dev/upgrade-hold)"
	done.Status.CompletionTime = ago(time.Minute)
	for i := range done.Status.Machines {
		m := &done.Status.Machines[i]
		if m.Phase != ichorv1.MachineSkipped {
			m.Phase, m.Step, m.Message = ichorv1.MachineSucceeded, "", "running v1.13.7"
			m.StartedAt, m.FinishedAt = ago(time.Duration(12-i)*time.Minute), ago(time.Duration(11-i)*time.Minute)
		}
	}
	s["succeeded"] = done

	// Cancelled by alice with cp-2's reboot in flight, then once it settled:
	// cp-1 done, the rest never touched.
	settling := running.DeepCopy()
	settling.Annotations = map[string]string{ichorv1.CancelAnnotation: "alice"}
	settling.Status.Phase, settling.Status.Reason = ichorv1.PhaseCancelled, "Cancelled"
	settling.Status.CompletionTime = ago(10 * time.Second)
	settling.Status.Message = "cancelled by alice; done on 1/7 machine(s): cp-1; the steps in flight settle before the cordons are lifted and the cluster lock is let go: cp-2: reboot"
	s["cancelled-settling"] = settling
	cancelled := settling.DeepCopy()
	cancelled.Status.Lock, cancelled.Status.Current, cancelled.Status.Progress = "", "", "2/7, 1 held"
	cancelled.Status.Machines[1] = machine("cp-2", ichorv1.RoleControlPlane, ichorv1.MachineSucceeded, "", 45*time.Second, 5*time.Second, "running v1.13.7")
	cancelled.Status.Message = "cancelled by alice; done on 2/7 machine(s): cp-1, cp-2"
	s["cancelled"] = cancelled

	cni := baseOp()
	cni.Name, cni.Spec.Kind, cni.Spec.Talos = "upgrade-cni-x8v2d", ichorv1.KindCNI, nil
	cni.Spec.CNI = &ichorv1.CNIChange{}
	cni.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Target: "cilium 1.19.6", Progress: "0/3", Current: "cp-1",
		StartTime: ago(2 * time.Minute), ObservedGeneration: 1, Message: "running",
		Machines: []ichorv1.MachineStatus{
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: "wait-cilium", StartedAt: ago(100 * time.Second), Attempts: 1,
				Message: "Job kube-system/ichor-cni-5c1e0a9d3f-1 is running"},
			{Name: "worker-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending},
			{Name: "worker-2", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending},
		},
	}
	s["cni-job"] = cni

	s["many"] = fleet(60, 3, 1)
	s["config-plan"], s["config-running"] = configRollout()
	for _, at := range []string{"first", "middle", "failed", "done"} {
		s["stages-"+at] = kubernetesUpgrade(at)
	}
	return s
}

// kubernetesUpgrade is a Kubernetes upgrade, an operation made of stages,
// as the controller writes it at a point of its run: the pre-pull (the
// first stage) under way; kube-controller-manager (a middle stage, of the
// control planes only) under way, the stages before it done; the step of
// kube-scheduler failed on cp-2; every stage done.
func kubernetesUpgrade(at string) *ichorv1.TalosOperation {
	op := baseOp()
	op.Name, op.Spec.Kind, op.Spec.Talos = "upgrade-k8s-4h2lw", ichorv1.KindKubernetes, nil
	op.Spec.Kubernetes = &ichorv1.KubernetesUpgrade{Version: "v1.36.2"}
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	st := &op.Status
	*st = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Target: "kubernetes v1.36.2", StartTime: ago(20 * time.Minute), ObservedGeneration: 1,
		Message: "running",
		Stages: []ichorv1.StageStatus{
			{Name: "pre-pull", Order: ichorv1.StageRolling},
			{Name: "kube-apiserver", Roles: cp, Order: ichorv1.StageOneAtATime},
			{Name: "kube-controller-manager", Roles: cp, Order: ichorv1.StageOneAtATime},
			{Name: "kube-scheduler", Roles: cp, Order: ichorv1.StageOneAtATime},
			{Name: "kubelet", Order: ichorv1.StageRolling},
		},
	}
	k8s := func(name string, role ichorv1.MachineRole, phase ichorv1.MachinePhase, step string, started, finished time.Duration, msg string) ichorv1.MachineStatus {
		m := machine(name, role, phase, step, started, finished, msg)
		m.From, m.To = "v1.35.4", "v1.36.2"
		return m
	}
	pulled := func(name string, role ichorv1.MachineRole, n int) ichorv1.MachineStatus {
		return k8s(name, role, ichorv1.MachineSucceeded, "", 20*time.Minute, 19*time.Minute, fmt.Sprintf("pulled %d image(s)", n))
	}
	done := func(i int, progress string) {
		st.Stages[i].StartedAt, st.Stages[i].FinishedAt, st.Stages[i].Progress = ago(time.Duration(20-3*i)*time.Minute), ago(time.Duration(18-3*i)*time.Minute), progress
	}
	switch at {
	case "first":
		st.Stage, st.Progress, st.Current = "pre-pull", "1/5", "cp-2"
		st.StartTime, st.Stages[0].StartedAt = ago(time.Minute), ago(time.Minute)
		st.Machines = []ichorv1.MachineStatus{
			k8s("cp-1", ichorv1.RoleControlPlane, ichorv1.MachineSucceeded, "", time.Minute, 40*time.Second, "pulled 4 image(s)"),
			k8s("cp-2", ichorv1.RoleControlPlane, ichorv1.MachineInProgress, "pull-images", 40*time.Second, 0, "pulling registry.k8s.io/kube-scheduler:v1.36.2"),
			k8s("cp-3", ichorv1.RoleControlPlane, ichorv1.MachinePending, "", 0, 0, ""),
			k8s("worker-1", ichorv1.RoleWorker, ichorv1.MachinePending, "", 0, 0, ""),
			k8s("worker-2", ichorv1.RoleWorker, ichorv1.MachinePending, "", 0, 0, ""),
		}
	case "middle", "failed":
		st.Stage, st.Progress, st.Current = "kube-controller-manager", "1/3", "cp-2"
		done(0, "5/5")
		done(1, "3/3")
		st.Stages[2].StartedAt = ago(12 * time.Minute)
		st.Machines = []ichorv1.MachineStatus{
			k8s("cp-1", ichorv1.RoleControlPlane, ichorv1.MachineSucceeded, "", 12*time.Minute, 11*time.Minute, "cluster.controllerManager.image registry.k8s.io/kube-controller-manager:v1.36.2"),
			k8s("cp-2", ichorv1.RoleControlPlane, ichorv1.MachineInProgress, "pod-ready", 50*time.Second, 0, "waiting for kube-controller-manager-cp-2 to be Ready"),
			k8s("cp-3", ichorv1.RoleControlPlane, ichorv1.MachinePending, "", 0, 0, ""),
			pulled("worker-1", ichorv1.RoleWorker, 1),
			pulled("worker-2", ichorv1.RoleWorker, 1),
		}
		if at == "failed" {
			st.Stage = "kube-scheduler"
			done(2, "3/3")
			st.Stages[3].StartedAt = ago(8 * time.Minute)
			st.Phase, st.Reason, st.FailureReason = ichorv1.PhasePaused, ichorv1.ReasonStepFailed, "PodReadyFailed"
			st.Message = "paused: a step failed"
			m := &st.Machines[1]
			m.Phase, m.FinishedAt = ichorv1.MachineFailed, ago(10*time.Second)
			m.Message = "timed out after 5m0s: waiting for the mirror pod of kube-scheduler at configuration version 3"
		}
	case "done":
		st.Phase, st.Lock, st.Stage, st.Progress, st.Message = ichorv1.PhaseSucceeded, "", "kubelet", "5/5", "kubernetes v1.36.2 done on 5/5 machine(s)"
		st.CompletionTime = ago(time.Minute)
		for i, p := range []string{"5/5", "3/3", "3/3", "3/3", "5/5"} {
			done(i, p)
		}
		for i, name := range []string{"cp-1", "cp-2", "cp-3", "worker-1", "worker-2"} {
			role := ichorv1.RoleWorker
			if i < 3 {
				role = ichorv1.RoleControlPlane
			}
			st.Machines = append(st.Machines, k8s(name, role, ichorv1.MachineSucceeded, "", time.Duration(7-i)*time.Minute, time.Duration(6-i)*time.Minute, "machine.kubelet.image ghcr.io/siderolabs/kubelet:v1.36.2"))
		}
	}
	return op
}

// configRollout is a config rollout in mode auto: created paused, each
// machine showing what the patches would do to it; then running, the
// machines saying whether they were applied live or rebooted.
func configRollout() (planned, running *ichorv1.TalosOperation) {
	planned = baseOp()
	planned.Name = "config-apply-k2x9p"
	planned.Spec.Kind, planned.Spec.Talos, planned.Spec.Paused = ichorv1.KindConfig, nil, true
	planned.Spec.Config = &ichorv1.ConfigRollout{Patches: []string{"machine: {nodeLabels: {zone: a}}", "machine: {env: {A: b}}"}, Mode: ichorv1.ConfigModeAuto}
	planned.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonPausedByOperator, Target: planned.Spec.Config.Summary(), ObservedGeneration: 1,
		Message: "paused by an operator (spec.paused)", Progress: "0/4",
		Machines: []ichorv1.MachineStatus{
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachinePending, Message: "plan: changes, applies live"},
			{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachinePending, Message: "plan: no change"},
			{Name: "worker-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending, Message: "plan: changes, needs a reboot"},
			{Name: "worker-2", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending, Message: "plan: changes, applies live"},
		},
	}
	running = planned.DeepCopy()
	running.Spec.Paused = false
	st := &running.Status
	st.Phase, st.Reason, st.Lock, st.Message, st.Progress, st.Current = ichorv1.PhaseRunning, "", ichorv1.LockHeld, "running", "2/4", "worker-1"
	st.StartTime = ago(3 * time.Minute)
	ms := st.Machines
	ms[0] = ichorv1.MachineStatus{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, To: "7c1d0e2f",
		StartedAt: ago(3 * time.Minute), FinishedAt: ago(170 * time.Second), Attempts: 1, Message: "applied live"}
	ms[1] = ichorv1.MachineStatus{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, To: "7c1d0e2f",
		StartedAt: ago(170 * time.Second), FinishedAt: ago(169 * time.Second), Attempts: 1, Message: "already applied"}
	ms[2] = ichorv1.MachineStatus{Name: "worker-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "wait-rebooted", To: "e91f3c70",
		StartedAt: ago(150 * time.Second), Attempts: 1, Message: "waiting for the machine to come back"}
	ms[3].Message = "plan: changes, applies live"
	return planned, running
}

// facts are what the watch reads besides the operation, per scenario: the
// failed machine's Node cordoned, operations queued for the lock.
func facts(scenario string, o Options) Options {
	switch scenario {
	case "failed", "paused-failed-retry-pending":
		o.Cordoned = map[string]bool{"cp-2": true}
	case "running":
		o.Queue = []QueuedOperation{{"prod", "node-reboot-w3", ichorv1.KindNode}, {"staging", "upgrade-kubernetes-9z", ichorv1.KindKubernetes}}
	case "lock-wait":
		o.Queue = []QueuedOperation{{"prod", "upgrade-k8s-a1", ichorv1.KindKubernetes}, {"prod", "upgrade-talos-7fk2q", ichorv1.KindTalos}, {"prod", "node-reboot-w3", ichorv1.KindNode}}
	case "cni-job":
		o.Jobs = []JobRun{{Namespace: "kube-system", Name: "ichor-cni-5c1e0a9d3f-1", Phase: "Running",
			LastLine: `level=INFO msg="waiting for resources" release=cilium kinds="DaemonSet/cilium, Deployment/cilium-operator"`}}
	}
	return o
}

// fleet is an operation over n machines: a third done, active machines
// under way, failed ones, the rest pending.
func fleet(n, active, failed int) *ichorv1.TalosOperation {
	op := baseOp()
	op.Name = "upgrade-talos-fleet"
	op.Spec.MaxUnavailable = int32(active)
	op.Status = ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Target: "talos v1.13.7", StartTime: ago(2 * time.Hour), ObservedGeneration: 1,
	}
	done := n / 3
	for i := range n {
		role, name := ichorv1.RoleWorker, fmt.Sprintf("worker-%04d", i)
		if i < 3 {
			role, name = ichorv1.RoleControlPlane, fmt.Sprintf("cp-%d", i+1)
		}
		var m ichorv1.MachineStatus
		switch {
		case i < done:
			m = machine(name, role, ichorv1.MachineSucceeded, "", time.Duration(n-i)*time.Minute, time.Duration(n-i-1)*time.Minute, "running v1.13.7")
		case i < done+failed:
			m = machine(name, role, ichorv1.MachineFailed, "drain", 5*time.Minute, time.Minute, "drain timed out: PodDisruptionBudget web/db allows no disruption")
		case i < done+failed+active:
			m = machine(name, role, ichorv1.MachineInProgress, "upgrade", time.Duration(i-done)*time.Minute+30*time.Second, 0, "installing v1.13.7")
		default:
			m = machine(name, role, ichorv1.MachinePending, "", 0, 0, "")
		}
		op.Status.Machines = append(op.Status.Machines, m)
	}
	op.Status.Progress = fmt.Sprintf("%d/%d", done, n)
	return op
}

// stagedFleet is a Kubernetes upgrade over n machines in its last stage
// (the kubelets, every machine), the stages before it done.
func stagedFleet(n int) *ichorv1.TalosOperation {
	op := fleet(n, 40, 2)
	done := kubernetesUpgrade("done")
	op.Name, op.Spec = done.Name, done.Spec
	op.Status.Target, op.Status.Stage, op.Status.Stages = done.Status.Target, "kubelet", done.Status.Stages
	last := &op.Status.Stages[len(op.Status.Stages)-1]
	last.FinishedAt, last.Progress = nil, ""
	return op
}

func golden(t *testing.T, name string, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./plugin/view -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file (rerun with -update after checking the change):\n--- got\n%s\n--- want\n%s", path, got, want)
	}
}

func TestRenderGolden(t *testing.T) {
	for name, op := range scenarios() {
		for _, width := range []int{80, 120} {
			for _, color := range []bool{false, true} {
				file := fmt.Sprintf("render/%s-w%d", name, width)
				if color {
					file += "-color"
				}
				t.Run(file, func(t *testing.T) {
					frame := Render(op, facts(name, Options{Width: width, Color: color, Grouping: true, Now: now, Command: "kubectl ichor"}))
					for i, l := range frame {
						if !color && strings.Contains(l, "\x1b") {
							t.Errorf("line %d holds an escape character without colour: %q", i, l)
						}
						if n := len([]rune(ansi.ReplaceAllString(l, ""))); n > width {
							t.Errorf("line %d is %d columns wide, more than %d: %q", i, n, width, l)
						}
					}
					golden(t, file, strings.Join(frame, "\n")+"\n")
				})
			}
		}
	}
}

// TestRenderFolds renders operations that do not fit the terminal: rows of
// machines in the same phase fold, failed and active machines keep theirs,
// and the frame never exceeds the height.
func TestRenderFolds(t *testing.T) {
	tests := []struct {
		name     string
		op       *ichorv1.TalosOperation
		height   int
		grouping bool
		ascii    bool
	}{
		{"many-h40", fleet(60, 3, 1), 40, true, false},
		{"many-h15", fleet(60, 3, 1), 15, true, false},
		{"many-h15-ascii", fleet(60, 3, 1), 15, true, true},
		{"many-h15-nogrouping", fleet(60, 3, 1), 15, false, false},
		{"wide-batch-h12", fleet(300, 40, 2), 12, true, false},
		{"tiny-h5", fleet(60, 3, 1), 5, true, false},
		{"running-h6", scenarios()["running"], 6, true, false},
		{"stages-5000-h16", stagedFleet(5000), 16, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			frame := Render(tt.op, Options{Width: 120, Height: tt.height, Grouping: tt.grouping, ASCII: tt.ascii, Now: now, Command: "kubectl ichor"})
			if len(frame) > tt.height {
				t.Errorf("frame has %d lines, more than the height %d", len(frame), tt.height)
			}
			golden(t, "render/fold-"+tt.name, strings.Join(frame, "\n")+"\n")
		})
	}
}

// TestLayoutAccountsForEveryMachine checks that, however the rows fold and
// clip, every machine is counted exactly once.
func TestLayoutAccountsForEveryMachine(t *testing.T) {
	for _, n := range []int{1, 7, 60, 301, 5000} {
		for _, avail := range []int{1, 2, 3, 5, 10, 40, 0} {
			for _, grouping := range []bool{true, false} {
				op := fleet(n, min(40, n/3), min(2, n/10))
				ms := op.Status.Machines
				rows := layout(ms, avail, grouping)
				if avail > 0 && len(rows) > avail {
					t.Errorf("n=%d avail=%d grouping=%v: %d rows", n, avail, grouping, len(rows))
				}
				seen := make([]int, len(ms))
				for _, r := range rows {
					if r.group == nil && !r.more {
						seen[r.machine]++
					}
					for _, i := range r.group {
						seen[i]++
					}
				}
				for i, c := range seen {
					if c != 1 {
						t.Fatalf("n=%d avail=%d grouping=%v: machine %d counted %d times", n, avail, grouping, i, c)
					}
				}
			}
		}
	}
}

func TestRenderListGolden(t *testing.T) {
	s := scenarios()
	ops := []ichorv1.TalosOperation{*s["succeeded"], *s["failed"], *s["lock-wait"], *s["new"]}
	for i := range ops {
		ops[i].Name = fmt.Sprintf("%s-%d", ops[i].Name, i)
	}
	for _, width := range []int{80, 120} {
		for _, color := range []bool{false, true} {
			file := fmt.Sprintf("list/ops-w%d", width)
			if color {
				file += "-color"
			}
			frame := RenderList("prod", ops, Options{Width: width, Color: color, Now: now})
			golden(t, file, strings.Join(frame, "\n")+"\n")
		}
	}
	clipped := RenderList("prod", ops, Options{Width: 120, Height: 4, Now: now})
	golden(t, "list/ops-h4", strings.Join(clipped, "\n")+"\n")
}

// TestChangesGolden feeds the plain log a sequence of observations of one
// operation, a second apart, as `watch` prints them when not on a terminal.
func TestChangesGolden(t *testing.T) {
	s := scenarios()
	seq := []*ichorv1.TalosOperation{s["new"], s["running"], s["running"], s["failed"], s["paused-failed-retry-pending"], s["succeeded"]}
	var b strings.Builder
	var prev *ichorv1.TalosOperation
	for i, op := range seq {
		for _, l := range Changes(prev, op, now.Add(time.Duration(i)*time.Second)) {
			if strings.ContainsRune(l, '\x1b') || strings.ContainsRune(l, '\n') {
				t.Errorf("log line carries a control character: %q", l)
			}
			b.WriteString(l + "\n")
		}
		prev = op
	}
	golden(t, "plain/upgrade.log", b.String())
}

func TestScreenRedrawsInPlace(t *testing.T) {
	var out bytes.Buffer
	s := NewScreen(&out)
	if err := s.Draw([]string{"first", strings.Repeat("x", 25)}, 10); err != nil {
		t.Fatal(err)
	}
	if err := s.Draw([]string{"second"}, 10); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// Hide the cursor; draw; go up the 4 physical lines of the first frame
	// (the 25-column line wraps into 3 at width 10); overwrite; clear below;
	// show the cursor. Never a full-screen clear.
	want := "\x1b[?25lfirst\x1b[K\n" + strings.Repeat("x", 25) + "\x1b[K\n\x1b[J" +
		"\r\x1b[4Asecond\x1b[K\n\x1b[J" +
		"\x1b[?25h"
	if got := out.String(); got != want {
		t.Errorf("screen wrote\n%q\nwant\n%q", got, want)
	}
	if strings.Contains(out.String(), "\x1b[2J") {
		t.Error("screen cleared the whole screen")
	}
}

func TestClean(t *testing.T) {
	tests := map[string]string{
		"plain":                    "plain",
		"two\nlines\ttab":          "two lines tab",
		"\x1b[31mred\x1b[0m":       "^[[31mred^[[0m",
		"bell\a and \u009b csi":    "bell? and ? csi",
		"carriage\rreturn":         `carriage\rreturn`,
		"ünïcödé ✔ stays as it is": "ünïcödé ✔ stays as it is",
	}
	for in, want := range tests {
		if got := Clean(in); got != want {
			t.Errorf("Clean(%q) = %q, want %q", in, got, want)
		}
	}
}

// BenchmarkRender5000 renders one frame of an operation over 5,000 machines
// on a 120x50 terminal. Budget: 50 ms a frame; frame/budget below 1 is
// within it.
func BenchmarkRender5000(b *testing.B) {
	op := fleet(5000, 50, 3)
	o := Options{Width: 120, Height: 49, Color: true, Grouping: true, Now: now, Command: "kubectl ichor"}
	b.ResetTimer()
	for b.Loop() {
		Render(op, o)
	}
	perFrame := b.Elapsed() / time.Duration(b.N)
	b.ReportMetric(float64(perFrame)/float64(50*time.Millisecond), "frame/budget")
}

// TestPlanGolden prints the plans of operations created paused: a Talos
// upgrade over three control planes and four workers, two at a time, one
// held; a configuration rollout whose machines reboot or not.
func TestPlanGolden(t *testing.T) {
	talos := scenarios()["running"]
	talos.Spec.Paused, talos.Spec.MaxUnavailable = true, 2
	talos.Status.Phase, talos.Status.Reason, talos.Status.StartTime = ichorv1.PhasePaused, ichorv1.ReasonPausedByOperator, nil
	for i := range talos.Status.Machines {
		if m := &talos.Status.Machines[i]; m.Phase != ichorv1.MachineSkipped {
			m.Phase, m.Step, m.Message, m.StartedAt, m.FinishedAt = ichorv1.MachinePending, "", "", nil, nil
		}
	}
	planned, _ := configRollout()
	for name, op := range map[string]*ichorv1.TalosOperation{"talos": talos, "config": planned} {
		t.Run(name, func(t *testing.T) {
			var b bytes.Buffer
			if err := Plan(&b, op); err != nil {
				t.Fatal(err)
			}
			golden(t, "plan/"+name, b.String())
		})
	}
}
