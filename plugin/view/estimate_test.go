package view

import (
	"testing"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestTimeLeft(t *testing.T) {
	cp, w := ichorv1.RoleControlPlane, ichorv1.RoleWorker
	done := func(name string, role ichorv1.MachineRole, took time.Duration) ichorv1.MachineStatus {
		return machine(name, role, ichorv1.MachineSucceeded, "", time.Hour, time.Hour-took, "")
	}
	running := func(name string, role ichorv1.MachineRole, since time.Duration) ichorv1.MachineStatus {
		return machine(name, role, ichorv1.MachineInProgress, "install", since, 0, "")
	}
	pending := func(name string, role ichorv1.MachineRole) ichorv1.MachineStatus {
		return machine(name, role, ichorv1.MachinePending, "", 0, 0, "")
	}
	untouched := done("cp-0", cp, time.Second)
	untouched.From = untouched.To
	tests := []struct {
		name        string
		machines    []ichorv1.MachineStatus
		maxUnavail  int32
		phase       ichorv1.Phase
		failed      bool
		want        time.Duration
		wantUnknown bool
	}{
		{"nothing finished yet", []ichorv1.MachineStatus{running("cp-1", cp, time.Minute), pending("w-1", w)}, 1, ichorv1.PhaseRunning, false, 0, true},
		{"control planes one after another", []ichorv1.MachineStatus{done("cp-1", cp, 4*time.Minute), running("cp-2", cp, time.Minute), pending("cp-3", cp)}, 1, ichorv1.PhaseRunning, false, 7 * time.Minute, false},
		{"workers without a finished worker count the control planes' time", []ichorv1.MachineStatus{done("cp-1", cp, 4*time.Minute), pending("w-1", w), pending("w-2", w)}, 1, ichorv1.PhaseRunning, false, 8 * time.Minute, false},
		{"workers spread over maxUnavailable", []ichorv1.MachineStatus{done("cp-1", cp, 10*time.Minute), done("w-1", w, 2*time.Minute), running("w-2", w, time.Minute), pending("w-3", w), pending("w-4", w), pending("w-5", w)}, 2, ichorv1.PhaseRunning, false, (time.Minute + 6*time.Minute) / 2, false},
		{"a machine over its average counts nothing", []ichorv1.MachineStatus{done("cp-1", cp, 2*time.Minute), running("cp-2", cp, 5*time.Minute)}, 1, ichorv1.PhaseRunning, false, 0, false},
		{"machines already on the target do not count", []ichorv1.MachineStatus{untouched, running("cp-1", cp, time.Minute)}, 1, ichorv1.PhaseRunning, false, 0, true},
		{"skipped machines are no work", []ichorv1.MachineStatus{done("cp-1", cp, 3*time.Minute), machine("w-1", w, ichorv1.MachineSkipped, "", 0, 0, "held")}, 1, ichorv1.PhaseRunning, false, 0, false},
		{"a failed step stops the clock", []ichorv1.MachineStatus{done("cp-1", cp, 3*time.Minute), pending("cp-2", cp)}, 1, ichorv1.PhasePaused, true, 0, true},
		{"waiting for the lock", []ichorv1.MachineStatus{done("cp-1", cp, 3*time.Minute), pending("cp-2", cp)}, 1, ichorv1.PhasePaused, false, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			op := baseOp()
			op.Spec.MaxUnavailable = tt.maxUnavail
			op.Status.Phase, op.Status.Machines = tt.phase, tt.machines
			if tt.failed {
				op.Status.FailureReason = "InstallFailed"
			}
			got, ok := TimeLeft(op, now)
			if ok == tt.wantUnknown || got != tt.want {
				t.Errorf("TimeLeft = %s, %v; want %s, %v", got, ok, tt.want, !tt.wantUnknown)
			}
		})
	}
}

func TestShortenAndWrap(t *testing.T) {
	in := "pull factory.talos.dev/installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.13.7@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef: not found"
	want := "pull factory.talos.dev/installer/37656798…:v1.13.7@sha256:01234567…: not found"
	if got := Shorten(in); got != want {
		t.Errorf("Shorten =\n%s\nwant\n%s", got, want)
	}
	if got := Shorten("boot ID 7d3c-11ef, error code 0x1f"); got != "boot ID 7d3c-11ef, error code 0x1f" {
		t.Errorf("Shorten changed a message without long hex: %q", got)
	}
	tests := []struct {
		text  string
		width int
		want  []string
	}{
		{"short", 10, []string{"short"}},
		{"one two three four", 9, []string{"one two", "three", "four"}},
		{"averyveryverylongword x", 8, []string{"averyver", "yverylon", "gword x"}},
		{"no limit at all", 0, []string{"no limit at all"}},
	}
	for _, tt := range tests {
		got := wrap(tt.text, tt.width)
		if len(got) != len(tt.want) {
			t.Errorf("wrap(%q, %d) = %q, want %q", tt.text, tt.width, got, tt.want)
			continue
		}
		for i := range got {
			if got[i] != tt.want[i] {
				t.Errorf("wrap(%q, %d) = %q, want %q", tt.text, tt.width, got, tt.want)
				break
			}
		}
	}
}
