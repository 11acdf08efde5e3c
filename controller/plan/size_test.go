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
// budget.
func TestStatusOf5000Machines(t *testing.T) {
	tests := []struct {
		name, target, from, to, message string
	}{
		{"talos", "talos v1.13.7", "v1.12.4", "v1.13.7", ""},
		// A config rollout records only the fingerprint of the patched configuration.
		{"config", "config (3 patches, auto)", "", "7c1d0e2f", "applied, rebooted"},
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
