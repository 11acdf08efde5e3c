package v1alpha1_test

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestPlanFingerprint(t *testing.T) {
	base := func() *ichorv1.TalosOperation {
		return &ichorv1.TalosOperation{
			Spec: ichorv1.TalosOperationSpec{MaxUnavailable: 2},
			Status: ichorv1.TalosOperationStatus{Target: "talos v1.13.7", Machines: []ichorv1.MachineStatus{
				{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachinePending, From: "v1.13.6", To: "v1.13.7"},
				{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending, From: "v1.13.6", To: "v1.13.7"},
			}},
		}
	}
	same := base().PlanFingerprint()
	for _, tc := range []struct {
		name    string
		change  func(*ichorv1.TalosOperation)
		changes bool
	}{
		{"nothing", func(*ichorv1.TalosOperation) {}, false},
		{"a condition and the progress", func(o *ichorv1.TalosOperation) {
			o.Status.Progress, o.Status.Message = "0/2", "waiting for the cluster lock"
		}, false},
		{"a machine joined", func(o *ichorv1.TalosOperation) {
			o.Status.Machines = append(o.Status.Machines, ichorv1.MachineStatus{Name: "w-2", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending})
		}, true},
		{"a machine held", func(o *ichorv1.TalosOperation) {
			o.Status.Machines[1].Phase, o.Status.Machines[1].Message = ichorv1.MachineSkipped, "held: disk"
		}, true},
		{"another order", func(o *ichorv1.TalosOperation) {
			o.Status.Machines[0], o.Status.Machines[1] = o.Status.Machines[1], o.Status.Machines[0]
		}, true},
		{"a machine's from", func(o *ichorv1.TalosOperation) { o.Status.Machines[1].From = "v1.13.5" }, true},
		{"the plan's word on a machine", func(o *ichorv1.TalosOperation) { o.Status.Machines[1].Message = "already on v1.13.7" }, true},
		{"the batch size", func(o *ichorv1.TalosOperation) { o.Spec.MaxUnavailable = 3 }, true},
		{"the target", func(o *ichorv1.TalosOperation) { o.Status.Target = "talos v1.13.8" }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := base()
			tc.change(o)
			if got := o.PlanFingerprint() != same; got != tc.changes {
				t.Errorf("fingerprint changed: %v, want %v", got, tc.changes)
			}
		})
	}
}

func TestPlanChanged(t *testing.T) {
	o := &ichorv1.TalosOperation{Status: ichorv1.TalosOperationStatus{Target: "t", Machines: []ichorv1.MachineStatus{{Name: "a"}}}}
	if o.PlanChanged() {
		t.Error("no plan approved: not changed")
	}
	o.Annotations = map[string]string{ichorv1.PlanApprovedAnnotation: o.PlanFingerprint()}
	if o.PlanChanged() {
		t.Error("the approved plan: not changed")
	}
	o.Status.Machines = append(o.Status.Machines, ichorv1.MachineStatus{Name: "b"})
	if !o.PlanChanged() {
		t.Error("a machine more than approved: changed")
	}
	started := metav1.Now()
	o.Status.StartTime = &started
	if o.PlanChanged() {
		t.Error("started: its machines are fixed, nothing is planned again")
	}
}
