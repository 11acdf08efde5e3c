package view

import (
	"strings"
	"testing"
	"text/tabwriter"
)

// TestStageTableGolden prints describe's Stages table of a Kubernetes
// upgrade with its first stage under way, a middle one, one failed, and
// all done: the stages finished say Succeeded with their progress and
// times, the one in progress the operation's state there, the rest Pending.
func TestStageTableGolden(t *testing.T) {
	for _, at := range []string{"first", "middle", "failed", "done"} {
		t.Run(at, func(t *testing.T) {
			var b strings.Builder
			w := tabwriter.NewWriter(&b, 0, 8, 2, ' ', 0)
			for _, r := range StageTable(kubernetesUpgrade(at), now) {
				if _, err := w.Write([]byte("  " + r + "\n")); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.Flush(); err != nil {
				t.Fatal(err)
			}
			golden(t, "describe/stages-"+at, b.String())
		})
	}
}

// TestStagesWithout: a kind without stages has none, and its machine table
// shows every machine.
func TestStagesWithout(t *testing.T) {
	op := scenarios()["running"]
	if s := Stages(op); len(s) != 0 {
		t.Errorf("stages of a kind without stages: %+v", s)
	}
	if ms := StageMachines(op); len(ms) != len(op.Status.Machines) {
		t.Errorf("%d machines shown of %d", len(ms), len(op.Status.Machines))
	}
}

// TestStageMachines: the table shows the machines of the stage in
// progress, those of its roles.
func TestStageMachines(t *testing.T) {
	for at, want := range map[string][]string{
		"first":  {"cp-1", "cp-2", "cp-3", "worker-1", "worker-2"},
		"middle": {"cp-1", "cp-2", "cp-3"},
		"done":   {"cp-1", "cp-2", "cp-3", "worker-1", "worker-2"},
	} {
		var got []string
		for _, m := range StageMachines(kubernetesUpgrade(at)) {
			got = append(got, m.Name)
		}
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("%s: machines %v, want %v", at, got, want)
		}
	}
}
