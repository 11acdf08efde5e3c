package clitest

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// age is how describe prints how long ago something was, in its fields.
var age = regexp.MustCompile(`\(\d+[smhd][0-9smh]* ago\)`)

// TestDescribeFailedStep: describe of an operation paused on a failed step,
// in the state the sandbox's walk-through leaves upgrade-2 (the fault on
// sandbox-w-2), through the real kubectl; the README shows this golden file.
// The times are fixed tens of minutes ago (no seconds), so the columns do not move.
func TestDescribeFailedStep(t *testing.T) {
	ctx := context.Background()
	ns, ctrl := env.Namespace(t), env.Namespace(t)
	op := createOp(t, ns, "upgrade-2")
	at := func(d time.Duration) *metav1.Time {
		tm := metav1.NewTime(time.Now().Add(-d).Truncate(time.Second))
		return &tm
	}
	const cause = "install factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.13.7 (legacy MachineService.Upgrade): rpc error: code = Internal desc = simulated fault error:Upgrade:Internal on sandbox-w-2"
	msg := "InstallFailed on sandbox-w-2 (install): " + cause
	machine := func(name string, role ichorv1.MachineRole, phase ichorv1.MachinePhase, step string, start, took time.Duration, message string) ichorv1.MachineStatus {
		m := ichorv1.MachineStatus{Name: name, Role: role, Phase: phase, Step: step, Attempts: 1, From: "v1.12.7", To: "v1.13.7", Message: message,
			StartedAt: at(start)}
		m.FinishedAt = &metav1.Time{Time: m.StartedAt.Add(took)}
		return m
	}
	st := ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, FailureReason: "InstallFailed", Message: msg,
		Lock: ichorv1.LockHeld, Target: "talos v1.13.7", Progress: "2/3", Current: "sandbox-w-2", StartTime: at(30 * time.Minute),
		Machines: []ichorv1.MachineStatus{
			machine("sandbox-cp-1", ichorv1.RoleControlPlane, ichorv1.MachineSucceeded, "", 10*time.Minute, 40*time.Second, "running v1.13.7"),
			machine("sandbox-w-1", ichorv1.RoleWorker, ichorv1.MachineSucceeded, "", 9*time.Minute, 35*time.Second, "running v1.13.7"),
			machine("sandbox-w-2", ichorv1.RoleWorker, ichorv1.MachineFailed, "install", 8*time.Minute, 20*time.Second, cause),
		},
	}
	for _, c := range []struct {
		typ    string
		status metav1.ConditionStatus
		reason string
	}{
		{ichorv1.ConditionReady, metav1.ConditionFalse, "Paused"},
		{ichorv1.ConditionProgressing, metav1.ConditionFalse, "StepFailed"},
		{ichorv1.ConditionPaused, metav1.ConditionTrue, "StepFailed"},
		{ichorv1.ConditionStalled, metav1.ConditionTrue, "InstallFailed"},
		{ichorv1.ConditionReconciling, metav1.ConditionFalse, "StepFailed"},
	} {
		st.Conditions = append(st.Conditions, metav1.Condition{Type: c.typ, Status: c.status, Reason: c.reason, Message: msg,
			ObservedGeneration: op.Generation, LastTransitionTime: *at(20 * time.Minute)})
	}
	setStatus(t, op, st)
	for i, e := range []struct{ typ, reason, msg string }{
		{corev1.EventTypeNormal, "MachineSucceeded", "sandbox-w-1: done (v1.12.7 -> v1.13.7)"},
		{corev1.EventTypeNormal, "MachineStarted", "sandbox-w-2: inspect"},
		{corev1.EventTypeWarning, "StepFailed", "sandbox-w-2: install failed: " + cause},
		{corev1.EventTypeNormal, "Paused", "StepFailed: " + msg},
	} {
		when := metav1.NewTime(at(20 * time.Minute).Add(time.Duration(i) * time.Millisecond))
		ev := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "upgrade-2." + string(rune('a'+i))},
			InvolvedObject: corev1.ObjectReference{APIVersion: ichorv1.GroupVersion.String(), Kind: "TalosOperation", Namespace: ns, Name: op.Name, UID: op.UID},
			Type:           e.typ, Reason: e.reason, Message: e.msg, Source: corev1.EventSource{Component: "ichor-controller"},
			FirstTimestamp: when, LastTimestamp: when, Count: 1}
		if err := env.Client.Create(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	acquired := metav1.NewMicroTime(at(30 * time.Minute).Time)
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ctrl, Name: ichorv1.LockLeaseName},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(ichorv1.OperationIdentity(ns, op.Name)), AcquireTime: &acquired}}
	if err := env.Client.Create(ctx, lease); err != nil {
		t.Fatal(err)
	}
	r := kubectl(t, "", "ichor", "operation", "describe", "upgrade-2", "-n", ns, "--controller-namespace", ctrl)
	if r.code != 0 {
		t.Fatalf("describe: exit %d, stderr %s", r.code, r.err)
	}
	out := timestamp.ReplaceAllString(age.ReplaceAllString(strings.ReplaceAll(r.out, ns, "default"), "(AGE ago)"), "TIME")
	golden(t, "testdata/describe-failed.golden", out)
}

// captureBlock is a block of the README that shows a golden file: the
// marker names the file, the fenced block after it holds its text.
var captureBlock = regexp.MustCompile("(?s)<!-- capture: (\\S+) -->\n```text\n(.*?)```\n")

// TestReadmeCaptures: every capture in the README is the golden file it
// names, as the tests produce it now.
func TestReadmeCaptures(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := captureBlock.FindAllStringSubmatch(string(readme), -1)
	if len(blocks) < 3 {
		t.Fatalf("the README has %d captures, want the refusal, the watch view and describe", len(blocks))
	}
	for _, b := range blocks {
		want, err := os.ReadFile("../../" + b[1])
		if err != nil {
			t.Errorf("the README's capture of %s: %v", b[1], err)
			continue
		}
		if b[2] != string(want) {
			t.Errorf("the README's capture of %s differs from it; paste the file again between the marker's fences:\n--- README\n%s--- %s\n%s", b[1], b[2], b[1], want)
		}
	}
}
