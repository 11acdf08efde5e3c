package plan

import (
	"slices"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Stage returns the stage in progress of an operation made of stages
// (status.stage; the first stage before the operation starts) and its
// index, or nil and -1 for an operation without stages.
func Stage(st *ichorv1.TalosOperationStatus) (*ichorv1.StageStatus, int) {
	for i := range st.Stages {
		if st.Stages[i].Name == st.Stage {
			return &st.Stages[i], i
		}
	}
	if len(st.Stages) > 0 && st.Stage == "" {
		return &st.Stages[0], 0
	}
	return nil, -1
}

// InStage returns the machines that take part in stage s, as copies, and
// their indices in ms: those of its roles, and of a Once stage only the
// first of them that is not skipped. Without a stage (s nil) it is every
// machine: ms itself, and nil indices (Index reads them).
func InStage(ms []ichorv1.MachineStatus, s *ichorv1.StageStatus) ([]ichorv1.MachineStatus, []int) {
	if s == nil {
		return ms, nil
	}
	var view []ichorv1.MachineStatus
	var idx []int
	for i, m := range ms {
		if len(s.Roles) > 0 && !slices.Contains(s.Roles, m.Role) {
			continue
		}
		if s.Order == ichorv1.StageOnce {
			if m.Phase == ichorv1.MachineSkipped {
				continue
			}
			return []ichorv1.MachineStatus{m}, []int{i}
		}
		view, idx = append(view, m), append(idx, i)
	}
	return view, idx
}

// Index maps the i-th machine of InStage's view to its index in the
// operation's machines.
func Index(idx []int, i int) int {
	if idx == nil {
		return i
	}
	return idx[i]
}

// AllDone reports whether every machine needs no more work.
func AllDone(ms []ichorv1.MachineStatus) bool {
	for _, m := range ms {
		if !Done(m.Phase) {
			return false
		}
	}
	return true
}

// Budget is the maxUnavailable that stage s allows: the operation's for a
// Rolling stage (or none), one for the others.
func Budget(s *ichorv1.StageStatus, maxUnavailable int) int {
	if s == nil || s.Order == ichorv1.StageRolling {
		return maxUnavailable
	}
	return 1
}

// Finished reports whether the operation has nothing left to do: every
// machine of its last stage (of every machine, without stages) is done.
// A stage begins only when the one before has finished, so the last
// stage's machines are done only once every stage is.
func Finished(st *ichorv1.TalosOperationStatus) bool {
	s, i := Stage(st)
	if s != nil && i != len(st.Stages)-1 {
		return false
	}
	view, _ := InStage(st.Machines, s)
	return AllDone(view)
}
