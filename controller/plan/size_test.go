package plan

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestStatusOf5000Machines: an operation over 5,000 machines, every one of
// them at its widest (done, timed, versioned, with the message its kind
// leaves), stays far below etcd's 1.5 MiB object limit: under the 1 MiB
// budget. A kind made of three stages keeps one entry per machine (its
// place in the stage in progress) and three short stage records.
func TestStatusOf5000Machines(t *testing.T) {
	tests := []struct {
		name, target, from, to, message string
		stages                          []string
	}{
		{"talos", "talos v1.13.7", "v1.12.4", "v1.13.7", "", nil},
		// A config rollout records only the fingerprint of the patched configuration.
		{"config", "config (3 patches, auto)", "", "7c1d0e2f", "applied, rebooted", nil},
		// A kind made of stages leaves no message on a machine done: from and to say it.
		{"three stages", "kubernetes v1.36.2", "v1.35.4", "v1.36.2", "", []string{"control-plane", "kube-proxy", "kubelet"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ms []Machine
			for i := range 5000 {
				role := ichorv1.RoleWorker
				if i < 5 {
					role = ichorv1.RoleControlPlane
				}
				ms = append(ms, Machine{Name: fmt.Sprintf("worker-pool-a-%05d", i), Role: role, Version: tt.from})
			}
			st := ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded, Target: tt.target, Machines: Initial(ms, tt.to, true)}
			start, end := metav1.NewTime(time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)), metav1.NewTime(time.Date(2026, 11, 30, 4, 5, 6, 0, time.UTC))
			for i := range st.Machines {
				m := &st.Machines[i]
				m.Phase, m.Attempts, m.StartedAt, m.FinishedAt = ichorv1.MachineSucceeded, 1, &start, &end
				m.From, m.To, m.Message = tt.from, tt.to, tt.message
			}
			for i, name := range tt.stages {
				roles := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
				if i == len(tt.stages)-1 {
					roles = []ichorv1.MachineRole{ichorv1.RoleControlPlane, ichorv1.RoleWorker}
				}
				st.Stages = append(st.Stages, ichorv1.StageStatus{Name: name, Roles: roles, Order: ichorv1.StageOneAtATime,
					StartedAt: &start, FinishedAt: &end, Progress: "5000/5000"})
				st.Stage = name
			}
			st.Progress, st.Current = Progress(st.Machines), Current(st.Machines)
			b, err := json.Marshal(ichorv1.TalosOperation{Status: st})
			if err != nil {
				t.Fatal(err)
			}
			const budget = 1 << 20
			t.Logf("5,000 machines: %d bytes of JSON, %.0f per machine, %.2f of the 1 MiB budget", len(b), float64(len(b))/5000, float64(len(b))/budget)
			if len(b) >= budget {
				t.Errorf("status of 5,000 machines is %d bytes, over the %d budget", len(b), budget)
			}
		})
	}
}
