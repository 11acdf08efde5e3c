package view

import (
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TimeLeft estimates how long a running operation still takes, from the
// machines it has finished so far: the control planes still to do one after
// another, and the workers' remaining work spread over maxUnavailable at
// once. Each machine counts for the average time of the finished machines
// of its role (of all finished machines, when none of its role has
// finished); a machine in progress counts for what is left of it. It knows
// nothing before the first machine has finished, or while the operation is
// not running.
func TimeLeft(op *ichorv1.TalosOperation, now time.Time) (time.Duration, bool) {
	st := &op.Status
	if st.Phase != ichorv1.PhaseRunning || op.StepFailed() {
		return 0, false
	}
	var sum [2]time.Duration
	var n [2]int
	for i := range st.Machines {
		m := &st.Machines[i]
		if d, ok := worked(m); ok {
			r := roleIndex(m.Role)
			sum[r] += d
			n[r]++
		}
	}
	if n[0]+n[1] == 0 {
		return 0, false
	}
	avg := func(r int) time.Duration {
		if n[r] > 0 {
			return sum[r] / time.Duration(n[r])
		}
		return (sum[0] + sum[1]) / time.Duration(n[0]+n[1])
	}
	var cps, workers time.Duration
	for i := range st.Machines {
		m := &st.Machines[i]
		var left time.Duration
		switch m.Phase {
		case ichorv1.MachinePending, "":
			left = avg(roleIndex(m.Role))
		case ichorv1.MachineInProgress:
			left = avg(roleIndex(m.Role))
			if m.StartedAt != nil {
				left = max(left-now.Sub(m.StartedAt.Time), 0)
			}
		default:
			continue
		}
		if m.Role == ichorv1.RoleControlPlane {
			cps += left
		} else {
			workers += left
		}
	}
	parallel := time.Duration(max(op.Spec.MaxUnavailable, 1))
	return cps + workers/parallel, true
}

// worked is how long the operation worked on a machine it finished; machines
// it found done already (on the target before it started) do not count.
func worked(m *ichorv1.MachineStatus) (time.Duration, bool) {
	if m.Phase != ichorv1.MachineSucceeded || m.StartedAt == nil || m.FinishedAt == nil {
		return 0, false
	}
	if m.From != "" && m.From == m.To {
		return 0, false
	}
	return m.FinishedAt.Sub(m.StartedAt.Time), true
}

func roleIndex(r ichorv1.MachineRole) int {
	if r == ichorv1.RoleControlPlane {
		return 0
	}
	return 1
}
