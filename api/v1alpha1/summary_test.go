package v1alpha1_test

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestOperationSummary(t *testing.T) {
	type want struct{ succeeded, stepFailed, operator, retry, failed, finished, failedAndSettled bool }
	retry := map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}
	tests := []struct {
		name string
		op   ichorv1.TalosOperation
		want want
	}{
		{"new", op(nil, ichorv1.TalosOperationSpec{}, ichorv1.TalosOperationStatus{}), want{}},
		{"running", op(nil, ichorv1.TalosOperationSpec{}, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning}), want{}},
		{"succeeded", op(nil, ichorv1.TalosOperationSpec{}, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded}), want{succeeded: true, finished: true}},
		{"step failed", op(nil, ichorv1.TalosOperationSpec{}, failedStatus()), want{stepFailed: true, failed: true, finished: true, failedAndSettled: true}},
		{"step failed, another machine mid-step", op(nil, ichorv1.TalosOperationSpec{}, failedStatus(ichorv1.MachineStatus{Name: "w-1", Phase: ichorv1.MachineInProgress, Step: "wait-rebooted"})),
			want{stepFailed: true, failed: true, finished: true}},
		{"step failed, another machine stopped between steps", op(nil, ichorv1.TalosOperationSpec{}, failedStatus(ichorv1.MachineStatus{Name: "w-1", Phase: ichorv1.MachineInProgress, Step: "uncordon", Stopped: true})),
			want{stepFailed: true, failed: true, finished: true, failedAndSettled: true}},
		{"step failed, retry pending", op(retry, ichorv1.TalosOperationSpec{}, failedStatus()), want{stepFailed: true, retry: true, failedAndSettled: true}},
		{"retry annotation other value", op(map[string]string{ichorv1.RetryAnnotation: "yes"}, ichorv1.TalosOperationSpec{}, failedStatus()), want{stepFailed: true, failed: true, finished: true, failedAndSettled: true}},
		{"operator paused", op(nil, ichorv1.TalosOperationSpec{Paused: true}, ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonPausedByOperator}), want{operator: true}},
		{"operator paused and failed", op(nil, ichorv1.TalosOperationSpec{Paused: true}, failedStatus()), want{stepFailed: true, operator: true, failed: true, finished: true, failedAndSettled: true}},
		{"refused", op(nil, ichorv1.TalosOperationSpec{}, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRefused, ObservedGeneration: 1}), want{failed: true, finished: true}},
		{"refused, override not yet observed", func() ichorv1.TalosOperation {
			o := op(nil, ichorv1.TalosOperationSpec{Override: true}, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRefused, ObservedGeneration: 1})
			o.Generation = 2
			return o
		}(), want{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := &tt.op
			got := want{o.Succeeded(), o.StepFailed(), o.PausedByOperator(), o.RetryPending(), o.Failed(), o.Finished(), o.FailedAndSettled()}
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func op(annotations map[string]string, spec ichorv1.TalosOperationSpec, status ichorv1.TalosOperationStatus) ichorv1.TalosOperation {
	return ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Name: "op", Generation: 1, Annotations: annotations},
		Spec:       spec,
		Status:     status,
	}
}

func failedStatus(others ...ichorv1.MachineStatus) ichorv1.TalosOperationStatus {
	return ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, FailureReason: "upgrade cp-2: timeout",
		Machines: append([]ichorv1.MachineStatus{{Name: "cp-1", Phase: ichorv1.MachineSucceeded}, {Name: "cp-2", Phase: ichorv1.MachineFailed}}, others...),
	}
}

func TestFailedMachine(t *testing.T) {
	s := failedStatus()
	if m := s.FailedMachine(); m == nil || m.Name != "cp-2" {
		t.Fatalf("FailedMachine = %+v, want cp-2", m)
	}
	if m := (&ichorv1.TalosOperationStatus{}).FailedMachine(); m != nil {
		t.Fatalf("FailedMachine of no machines = %+v, want nil", m)
	}
}

func TestParseLockHolder(t *testing.T) {
	tests := []struct {
		id   string
		want ichorv1.LockHolder
		ok   bool
	}{
		{ichorv1.OperationIdentity("prod", "upgrade-1"), ichorv1.LockHolder{Kind: ichorv1.HolderOperation, Namespace: "prod", Name: "upgrade-1"}, true},
		{ichorv1.MachineIdentity("cp-4"), ichorv1.LockHolder{Kind: ichorv1.HolderMachine, Name: "cp-4"}, true},
		{ichorv1.JobIdentity("kube-system", "cilium-upgrade"), ichorv1.LockHolder{Kind: ichorv1.HolderJob, Namespace: "kube-system", Name: "cilium-upgrade"}, true},
		{"ichor-controller/op/prod", ichorv1.LockHolder{}, false},
		{"ichor-controller/op/prod/a/b", ichorv1.LockHolder{}, false},
		{"ichor-controller/machine/", ichorv1.LockHolder{}, false},
		{"someone-else", ichorv1.LockHolder{}, false},
		{"", ichorv1.LockHolder{}, false},
	}
	for _, tt := range tests {
		got, err := ichorv1.ParseLockHolder(tt.id)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseLockHolder(%q) = %+v, %v; want %+v, ok=%v", tt.id, got, err, tt.want, tt.ok)
		}
		if tt.ok && got.String() != tt.id {
			t.Errorf("ParseLockHolder(%q).String() = %q", tt.id, got.String())
		}
	}
}

func TestCannotSkip(t *testing.T) {
	status := failedStatus(
		ichorv1.MachineStatus{Name: "w-1", Phase: ichorv1.MachineInProgress, Step: "install"},
		ichorv1.MachineStatus{Name: "w-2", Phase: ichorv1.MachineInProgress, Step: "uncordon", Stopped: true},
		ichorv1.MachineStatus{Name: "w-3", Phase: ichorv1.MachinePending},
		ichorv1.MachineStatus{Name: "w-4", Phase: ichorv1.MachineSkipped, Message: "held by annotation ichor.maesh.dev/upgrade-hold"},
	)
	succeeded := status
	succeeded.Phase = ichorv1.PhaseSucceeded
	tests := []struct {
		name, machine string
		status        ichorv1.TalosOperationStatus
		want          string
	}{
		{"failed", "cp-2", status, ""},
		{"step in flight", "w-1", status, "w-1 has a step in flight (install), and an irreversible call may be under way on it: wait until the step has ended, then skip it if it failed"},
		{"between steps", "w-2", status, "w-2 has not failed: it stopped between two steps (next: uncordon); only a machine whose step failed can be skipped"},
		{"not started", "w-3", status, "w-3 has not started: to leave it out, put its Node on hold (kubectl annotate node w-3 ichor.maesh.dev/upgrade-hold=REASON)"},
		{"skipped", "w-4", status, "w-4 is skipped already (held by annotation ichor.maesh.dev/upgrade-hold)"},
		{"done", "cp-1", status, "cp-1 is done already (Succeeded)"},
		{"unknown", "w-9", status, `it has no machine "w-9"; its machines: cp-1, cp-2, w-1, w-2, w-3, w-4`},
		{"not planned", "w-9", ichorv1.TalosOperationStatus{}, `it has no machine "w-9" (none are planned yet)`},
		{"operation succeeded", "cp-2", succeeded, "the operation has succeeded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := op(nil, ichorv1.TalosOperationSpec{}, tt.status)
			if got := o.CannotSkip(tt.machine); got != tt.want {
				t.Errorf("CannotSkip(%s) = %q, want %q", tt.machine, got, tt.want)
			}
		})
	}
}

func TestSkipRequested(t *testing.T) {
	tests := []struct {
		name        string
		annotations map[string]string
		want        ichorv1.SkipRequest
		ok          bool
	}{
		{"none", nil, ichorv1.SkipRequest{}, false},
		{"kubectl annotate", map[string]string{ichorv1.SkipAnnotation: " w-2 "}, ichorv1.SkipRequest{Machine: "w-2", By: "an operator"}, true},
		{"the plugin's", map[string]string{ichorv1.SkipAnnotation: "w-2", ichorv1.SkipByAnnotation: "alice", ichorv1.SkipUncordonAnnotation: "true"},
			ichorv1.SkipRequest{Machine: "w-2", By: "alice", Uncordon: true}, true},
		{"uncordon other value", map[string]string{ichorv1.SkipAnnotation: "w-2", ichorv1.SkipUncordonAnnotation: "yes"}, ichorv1.SkipRequest{Machine: "w-2", By: "an operator"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := op(tt.annotations, ichorv1.TalosOperationSpec{}, ichorv1.TalosOperationStatus{})
			got, ok := o.SkipRequested()
			if got != tt.want || ok != tt.ok {
				t.Errorf("SkipRequested() = %+v, %v; want %+v, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}
