package plan

import (
	"reflect"
	"testing"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

const (
	cp = ichorv1.RoleControlPlane
	w  = ichorv1.RoleWorker
)

func names(ms []Machine) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

func labelled(name string, role ichorv1.MachineRole, order string) Machine {
	m := Machine{Name: name, Role: role}
	if order != "" {
		m.Labels = map[string]string{ichorv1.UpgradeOrderLabel: order}
	}
	return m
}

func TestOrder(t *testing.T) {
	tests := []struct {
		name string
		in   []Machine
		want []string
	}{
		{"control planes first", []Machine{{Name: "a", Role: w}, {Name: "z", Role: cp}, {Name: "b", Role: cp}}, []string{"b", "z", "a"}},
		{"by name within a tier", []Machine{{Name: "w3", Role: w}, {Name: "w1", Role: w}, {Name: "w2", Role: w}}, []string{"w1", "w2", "w3"}},
		{"order label ascending, unlabelled last", []Machine{labelled("w1", w, ""), labelled("w2", w, "10"), labelled("w3", w, "2"), labelled("w0", w, "")}, []string{"w3", "w2", "w0", "w1"}},
		{"numeric, not lexical", []Machine{labelled("a", w, "10"), labelled("b", w, "9")}, []string{"b", "a"}},
		{"negative orders first", []Machine{labelled("a", w, "1"), labelled("b", w, "-1")}, []string{"b", "a"}},
		{"a label that is not an integer counts as absent", []Machine{labelled("a", w, "first"), labelled("b", w, "3")}, []string{"b", "a"}},
		{"equal orders by name", []Machine{labelled("b", w, "1"), labelled("a", w, "1")}, []string{"a", "b"}},
		{"order label does not cross tiers", []Machine{labelled("w", w, "-5"), labelled("c", cp, "5")}, []string{"c", "w"}},
		{"last in its tier, whatever its label", []Machine{{Name: "w1", Role: w, Last: true, Labels: map[string]string{ichorv1.UpgradeOrderLabel: "-9"}}, labelled("w2", w, "3"), {Name: "w3", Role: w}, {Name: "c", Role: cp}},
			[]string{"c", "w2", "w3", "w1"}},
		{"last does not cross tiers", []Machine{{Name: "c", Role: cp, Last: true}, {Name: "b", Role: cp}, {Name: "a", Role: w}}, []string{"b", "c", "a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := names(Order(tt.in)); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Order = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestInitialSkipsHeldMachines(t *testing.T) {
	ms := []Machine{
		{Name: "w1", Role: w, Version: "v1.12.4"},
		{Name: "w2", Role: w, Annotations: map[string]string{ichorv1.UpgradeHoldAnnotation: "disk replacement"}},
		{Name: "w3", Role: w, Annotations: map[string]string{ichorv1.UpgradeHoldAnnotation: ""}},
		{Name: "c1", Role: cp},
	}
	got := Initial(ms, "v1.13.7", true)
	want := []ichorv1.MachineStatus{
		{Name: "c1", Role: cp, Phase: ichorv1.MachinePending, To: "v1.13.7"},
		{Name: "w1", Role: w, Phase: ichorv1.MachinePending, From: "v1.12.4", To: "v1.13.7"},
		{Name: "w2", Role: w, Phase: ichorv1.MachineSkipped, To: "v1.13.7", Message: "held by annotation ichor.maesh.dev/upgrade-hold: disk replacement"},
		{Name: "w3", Role: w, Phase: ichorv1.MachineSkipped, To: "v1.13.7", Message: "held by annotation ichor.maesh.dev/upgrade-hold"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Initial =\n%+v\nwant\n%+v", got, want)
	}
	for _, m := range Initial(ms, "", false) {
		if m.Phase != ichorv1.MachinePending {
			t.Errorf("with honourHold=false %s is %s", m.Name, m.Phase)
		}
	}
}

func st(name string, role ichorv1.MachineRole, phase ichorv1.MachinePhase) ichorv1.MachineStatus {
	return ichorv1.MachineStatus{Name: name, Role: role, Phase: phase}
}

func TestNext(t *testing.T) {
	const (
		P = ichorv1.MachinePending
		I = ichorv1.MachineInProgress
		S = ichorv1.MachineSucceeded
		K = ichorv1.MachineSkipped
		F = ichorv1.MachineFailed
	)
	down := Out{Why: "NotReady"}
	left := Out{Why: "cordoned by ichor-controller/op/ns/a, which has stopped", Stuck: true}
	tests := []struct {
		name      string
		machines  []ichorv1.MachineStatus
		out       map[string]Out
		max       int
		want      []int
		wantWhy   string
		wantStuck bool
	}{
		{"first control plane alone", []ichorv1.MachineStatus{st("c1", cp, P), st("c2", cp, P), st("w1", w, P)}, nil, 5, []int{0}, "", false},
		{"one control plane at a time", []ichorv1.MachineStatus{st("c1", cp, I), st("c2", cp, P), st("w1", w, P)}, nil, 5, nil, "", false},
		{"next control plane once the first is done", []ichorv1.MachineStatus{st("c1", cp, S), st("c2", cp, P), st("w1", w, P)}, nil, 5, []int{1}, "", false},
		{"a failed control plane holds everything", []ichorv1.MachineStatus{st("c1", cp, F), st("w1", w, P)}, nil, 5, nil, "", false},
		{"skipped control planes do not block", []ichorv1.MachineStatus{st("c1", cp, K), st("w1", w, P)}, nil, 1, []int{1}, "", false},
		{"workers in a batch of maxUnavailable", []ichorv1.MachineStatus{st("c1", cp, S), st("w1", w, P), st("w2", w, P), st("w3", w, P)}, nil, 2, []int{1, 2}, "", false},
		{"in-progress workers count", []ichorv1.MachineStatus{st("w1", w, I), st("w2", w, P), st("w3", w, P)}, nil, 2, []int{1}, "", false},
		{"budget full", []ichorv1.MachineStatus{st("w1", w, I), st("w2", w, I), st("w3", w, P)}, nil, 2, nil, "", false},
		{"a NotReady worker outside the operation counts", []ichorv1.MachineStatus{st("w1", w, P), st("w2", w, P)}, map[string]Out{"x9": down}, 2, []int{0}, "", false},
		{"budget used up by others: say why", []ichorv1.MachineStatus{st("w1", w, P)}, map[string]Out{"x9": down, "x8": down}, 2, nil,
			"waiting for workers to come back: 2 out of service (x8: NotReady; x9: NotReady) with maxUnavailable 2", false},
		{"budget used up by workers left cordoned: stuck", []ichorv1.MachineStatus{st("w1", w, P)}, map[string]Out{"x9": left}, 1, nil,
			"1 worker(s) out of service until someone acts (x9: cordoned by ichor-controller/op/ns/a, which has stopped) use up maxUnavailable 1: " +
				"retry or delete the operation that left them cordoned, or uncordon them, then retry this one", true},
		{"workers left cordoned and NotReady ones: may still come back", []ichorv1.MachineStatus{st("w1", w, P)}, map[string]Out{"x9": left, "x8": down}, 2, nil,
			"waiting for workers to come back: 2 out of service (x8: NotReady; x9: cordoned by ichor-controller/op/ns/a, which has stopped) with maxUnavailable 2", false},
		{"budget used up by the operation's own work: no wait to report", []ichorv1.MachineStatus{st("w1", w, I), st("w2", w, P)}, map[string]Out{"w1": down}, 1, nil, "", false},
		{"a worker that is already down may start", []ichorv1.MachineStatus{st("w1", w, P), st("w2", w, P)}, map[string]Out{"w2": down, "x9": down}, 2, []int{1}, "", false},
		{"a worker that went down beside one in flight waits", []ichorv1.MachineStatus{st("w1", w, I), st("w2", w, P)}, map[string]Out{"w2": down}, 1, nil,
			"waiting for workers to come back: 1 out of service (w2: NotReady) with maxUnavailable 1", false},
		{"a worker that is down may start alone", []ichorv1.MachineStatus{st("w1", w, S), st("w2", w, P), st("w3", w, P)}, map[string]Out{"w3": down}, 1, []int{2}, "", false},
		{"no start while others overrun the budget", []ichorv1.MachineStatus{st("w1", w, P)}, map[string]Out{"w1": down, "x9": down}, 1, nil,
			"waiting for workers to come back: 2 out of service (w1: NotReady; x9: NotReady) with maxUnavailable 1", false},
		{"done workers free their slot", []ichorv1.MachineStatus{st("w1", w, S), st("w2", w, K), st("w3", w, P)}, nil, 1, []int{2}, "", false},
		{"all done", []ichorv1.MachineStatus{st("c1", cp, S), st("w1", w, S)}, nil, 1, nil, "", false},
		{"zero budget is one", []ichorv1.MachineStatus{st("w1", w, P), st("w2", w, P)}, nil, 0, []int{0}, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, wait := Next(tt.machines, tt.out, tt.max)
			if !reflect.DeepEqual(got, tt.want) || wait.String() != tt.wantWhy || wait.Stuck() != tt.wantStuck {
				t.Errorf("Next = %v %q stuck %v, want %v %q stuck %v", got, wait, wait.Stuck(), tt.want, tt.wantWhy, tt.wantStuck)
			}
		})
	}
}

func TestSummaries(t *testing.T) {
	held := st("w1", w, ichorv1.MachineSkipped)
	held.Message = "held by annotation ichor.maesh.dev/upgrade-hold: a disk"
	ms := []ichorv1.MachineStatus{
		st("c1", cp, ichorv1.MachineSucceeded), held,
		st("w2", w, ichorv1.MachineInProgress), st("w3", w, ichorv1.MachineInProgress), st("w4", w, ichorv1.MachinePending),
	}
	if got := Progress(ms); got != "1/5, 1 held" {
		t.Errorf("Progress = %q", got)
	}
	skipped := st("w5", w, ichorv1.MachineSkipped)
	skipped.Message = "skipped by alice"
	for _, tt := range []struct {
		ms                []ichorv1.MachineStatus
		progress, leftOut string
	}{
		{[]ichorv1.MachineStatus{st("c1", cp, ichorv1.MachineSucceeded)}, "1/1", ""},
		{[]ichorv1.MachineStatus{st("c1", cp, ichorv1.MachineSucceeded), held, skipped}, "1/3, 1 held, 1 skipped",
			"w1 (held by annotation ichor.maesh.dev/upgrade-hold: a disk), w5 (skipped by alice)"},
		{[]ichorv1.MachineStatus{held, held, held, held, skipped}, "0/5, 4 held, 1 skipped",
			"w1 (held by annotation ichor.maesh.dev/upgrade-hold: a disk), w1 (held by annotation ichor.maesh.dev/upgrade-hold: a disk), w1 (held by annotation ichor.maesh.dev/upgrade-hold: a disk), and 2 more"},
	} {
		if got := Progress(tt.ms); got != tt.progress {
			t.Errorf("Progress = %q, want %q", got, tt.progress)
		}
		if got := LeftOut(tt.ms); got != tt.leftOut {
			t.Errorf("LeftOut = %q, want %q", got, tt.leftOut)
		}
	}
	if got := Current(ms); got != "w2,w3" {
		t.Errorf("Current = %q", got)
	}
	many := []ichorv1.MachineStatus{}
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		many = append(many, st(n, w, ichorv1.MachineInProgress))
	}
	if got := Current(many); got != "a,b,c +2" {
		t.Errorf("Current(many) = %q", got)
	}
}
