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
