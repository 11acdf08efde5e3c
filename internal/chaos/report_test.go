package chaos

import (
	"testing"
	"time"
)

// TestReport: the figures of a campaign, then each violation with its
// run's seed, the command that reruns it and the history that led to it.
func TestReport(t *testing.T) {
	start := t0
	clean := Result{Seed: 41, Kills: 9, GapKills: 7, LeaderChanges: 9, Faults: 6, OperatorActions: 6, Jobs: 1, Joins: 1,
		Operations: 4, Succeeded: 3, Deleted: 1, Start: start, Took: 31 * time.Second}
	broken := Result{Seed: 42, Kills: 12, GapKills: 8, Lost: 1, LeaderChanges: 13, Faults: 5, OperatorActions: 7, Jobs: 2,
		Operations: 3, Succeeded: 3, Start: start, Took: 40 * time.Second,
		Violations: []Violation{{Invariant: "at-most-once", At: start.Add(27479 * time.Millisecond),
			What: "chaos-cp-1 accepted MachineService/Reset 2 times under ichor-controller/machine/chaos-cp-1, which ran it in 1 attempt(s)"}},
		Histories: []string{"  t+23.638s   sim: chaos-cp-1 accepts MachineService/Reset\n" +
			"  t+23.644s   KILL replica 10 after reset-2's reset on chaos-cp-1 (attempt 1) returned ok, before status records it\n" +
			"  t+27.479s   sim: chaos-cp-1 accepts MachineService/Reset"},
	}
	broken.Rerun = &Result{Seed: 42, Start: start, Violations: []Violation{{Invariant: "at-most-once", At: start.Add(26100 * time.Millisecond),
		What: "chaos-cp-1 accepted MachineService/Reset 2 times under ichor-controller/machine/chaos-cp-1, which ran it in 1 attempt(s)"}}}
	r := Report{Seed: 41, Params: Params{Span: 12 * time.Second, Kills: 3, Faults: 6, OperatorActions: 6}, Runs: []Result{clean}}
	golden(t, "report-clean.golden", r.String())
	r.Runs = append(r.Runs, broken)
	if r.Kills() != 21 || r.Violations() != 1 {
		t.Errorf("kills %d, violations %d; want 21, 1", r.Kills(), r.Violations())
	}
	golden(t, "report-violation.golden", r.String())
}
