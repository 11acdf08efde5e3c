package clitest

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestStagesShown: an operation made of stages, paused on a failed step in
// its kube-scheduler stage, through the real kubectl: describe lists each
// stage with where it stands, its progress and times, and only the
// current stage's machines; the live view on a terminal shows the stages
// line, the failed one marked, and exits 2.
func TestStagesShown(t *testing.T) {
	ns := env.Namespace(t)
	op := &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "k8s"},
		Spec:       ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.36.2"}},
	}
	if err := env.Client.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	at := func(d time.Duration) *metav1.Time {
		t := metav1.NewTime(time.Now().Add(-d).Truncate(time.Second))
		return &t
	}
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	stage := func(name string, roles []ichorv1.MachineRole, order ichorv1.StageOrder, from, to time.Duration, progress string) ichorv1.StageStatus {
		s := ichorv1.StageStatus{Name: name, Roles: roles, Order: order, Progress: progress}
		if from > 0 {
			s.StartedAt = at(from)
		}
		if to > 0 {
			s.FinishedAt = at(to)
		}
		return s
	}
	setStatus(t, op, ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, Lock: ichorv1.LockHeld, FailureReason: "PodReadyFailed",
		Message: "paused: a step failed", Target: "kubernetes v1.36.2", Progress: "1/2", Stage: "kube-scheduler", StartTime: at(20 * time.Minute),
		Stages: []ichorv1.StageStatus{
			stage("pre-pull", nil, ichorv1.StageRolling, 20*time.Minute, 18*time.Minute, "3/3"),
			stage("kube-apiserver", cp, ichorv1.StageOneAtATime, 18*time.Minute, 15*time.Minute, "2/2"),
			stage("kube-scheduler", cp, ichorv1.StageOneAtATime, 15*time.Minute, 0, ""),
			stage("kubelet", nil, ichorv1.StageRolling, 0, 0, ""),
		},
		Machines: []ichorv1.MachineStatus{
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, Attempts: 1, Message: "cluster.scheduler.image registry.k8s.io/kube-scheduler:v1.36.2"},
			{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineFailed, Step: "pod-ready", Attempts: 1, Message: "timed out waiting for kube-scheduler-cp-2"},
			{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineSucceeded, Attempts: 1, Message: "pulled 1 image(s)"},
		},
	})

	out := ok(t, "ichor", "operation", "describe", "k8s", "-n", ns)
	for _, want := range []string{
		"Stage:       kube-scheduler",
		"Stages:\n  NAME            STATE      ORDER       ROLES         PROGRESS  STARTED",
		"  pre-pull        Succeeded  Rolling     all           3/3       " + op.Status.Stages[0].StartedAt.UTC().Format(time.RFC3339) + "  " + op.Status.Stages[0].FinishedAt.UTC().Format(time.RFC3339) + "  2m",
		"  kube-apiserver  Succeeded  OneAtATime  controlplane  2/2",
		"  kube-scheduler  Failed     OneAtATime  controlplane  1/2       " + op.Status.Stages[2].StartedAt.UTC().Format(time.RFC3339) + "  -",
		"  kubelet         Pending    Rolling     all           -         -",
		"Machines (stage kube-scheduler, 2 of 3):\n  NAME  ROLE",
		"cp-2  controlplane  Failed     pod-ready",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("describe lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "w-1") {
		t.Errorf("describe lists w-1, which takes no part in stage kube-scheduler:\n%s", out)
	}

	p := startTerminal(t, "ichor", "watch", "k8s", "-n", ns)
	if code := p.wait(t); code != 2 {
		t.Fatalf("watch of a failed operation on a terminal: exit %d, want 2:\n%s", code, p.stdout())
	}
	view := p.stdout()
	for _, want := range []string{"stage 3/4", "Stages:  ✔ pre-pull 3/3  ✔ kube-apiserver 2/2  ✖ kube-scheduler 1/2  ◷ kubelet", "PodReadyFailed: cp-2 at step pod-ready"} {
		if !strings.Contains(view, want) {
			t.Errorf("the live view lacks %q:\n%s", want, view)
		}
	}
	if strings.Contains(view, "w-1") {
		t.Errorf("the live view lists w-1, which takes no part in stage kube-scheduler:\n%s", view)
	}
}
