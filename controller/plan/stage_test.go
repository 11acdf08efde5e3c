package plan

import (
	"slices"
	"testing"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// staged is an operation's status over cp-1, cp-2, w-1 and w-2 (their
// phases, in that order) in stage i of control-planes (OneAtATime),
// cluster (Once) and everyone (Rolling).
func staged(i int, phases ...ichorv1.MachinePhase) *ichorv1.TalosOperationStatus {
	st := &ichorv1.TalosOperationStatus{Stages: []ichorv1.StageStatus{
		{Name: "control-planes", Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOneAtATime},
		{Name: "cluster", Order: ichorv1.StageOnce},
		{Name: "everyone", Order: ichorv1.StageRolling},
	}}
	st.Stage = st.Stages[i].Name
	for j, name := range []string{"cp-1", "cp-2", "w-1", "w-2"} {
		role := ichorv1.RoleWorker
		if j < 2 {
			role = ichorv1.RoleControlPlane
		}
		st.Machines = append(st.Machines, ichorv1.MachineStatus{Name: name, Role: role, Phase: phases[j]})
	}
	return st
}

const (
	pending = ichorv1.MachinePending
	running = ichorv1.MachineInProgress
	done    = ichorv1.MachineSucceeded
	skipped = ichorv1.MachineSkipped
	failed  = ichorv1.MachineFailed
)

func TestInStage(t *testing.T) {
	tests := []struct {
		name     string
		st       *ichorv1.TalosOperationStatus
		members  []int
		finished bool
		budget   int
	}{
		{"no stages: every machine", &ichorv1.TalosOperationStatus{Machines: staged(0, done, done, done, pending).Machines}, []int{0, 1, 2, 3}, false, 3},
		{"no stages, all done", &ichorv1.TalosOperationStatus{Machines: staged(0, done, done, done, skipped).Machines}, []int{0, 1, 2, 3}, true, 3},
		{"the control planes' stage, not started", func() *ichorv1.TalosOperationStatus {
			st := staged(0, pending, pending, pending, pending)
			st.Stage = ""
			return st
		}(), []int{0, 1}, false, 1},
		{"the control planes' stage, done: not the last", staged(0, done, done, pending, pending), []int{0, 1}, false, 1},
		{"cluster-wide: the first machine", staged(1, running, pending, pending, pending), []int{0}, false, 1},
		{"cluster-wide: the first not skipped", staged(1, skipped, pending, pending, pending), []int{1}, false, 1},
		{"the last stage, one failed", staged(2, done, done, done, failed), []int{0, 1, 2, 3}, false, 3},
		{"the last stage, done", staged(2, done, done, skipped, done), []int{0, 1, 2, 3}, true, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := Stage(tt.st)
			view, idx := InStage(tt.st.Machines, s)
			var got []int
			for i := range view {
				got = append(got, Index(idx, i))
				if view[i].Name != tt.st.Machines[Index(idx, i)].Name {
					t.Errorf("view %d is %s, its index %d", i, view[i].Name, Index(idx, i))
				}
			}
			if !slices.Equal(got, tt.members) {
				t.Errorf("members %v, want %v", got, tt.members)
			}
			if f := Finished(tt.st); f != tt.finished {
				t.Errorf("finished %v, want %v", f, tt.finished)
			}
			if b := Budget(s, 3); b != tt.budget {
				t.Errorf("budget %d, want %d", b, tt.budget)
			}
		})
	}
}

// TestNextInStage: the plan starts only the stage's machines (not the
// workers while the control planes' stage runs), and in a OneAtATime stage
// one worker at a time whatever maxUnavailable says.
func TestNextInStage(t *testing.T) {
	tests := []struct {
		name  string
		st    *ichorv1.TalosOperationStatus
		start []int
	}{
		{"the control planes' stage", staged(0, done, pending, pending, pending), []int{1}},
		{"the control planes' stage, its last in progress", staged(0, done, running, pending, pending), nil},
		{"every machine one at a time", func() *ichorv1.TalosOperationStatus {
			st := staged(0, done, done, pending, pending)
			st.Stages[0].Roles = nil
			return st
		}(), []int{2}},
		{"rolling", staged(2, done, done, pending, pending), []int{2, 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := Stage(tt.st)
			view, idx := InStage(tt.st.Machines, s)
			start, _ := Next(view, nil, Budget(s, 3))
			var got []int
			for _, i := range start {
				got = append(got, Index(idx, i))
			}
			if !slices.Equal(got, tt.start) {
				t.Errorf("started %v, want %v", got, tt.start)
			}
		})
	}
}
