package clitest

import (
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	linuxproc "maesh.dev/ichor/internal/proc"
)

const (
	// watchMachines and watchChanges: the operation the watch view follows
	// and how many status writes it follows (each a machine done).
	watchMachines, watchChanges = 5000, 20
)

// BenchmarkWatch5000 runs `kubectl ichor watch` on a terminal, following
// an operation over 5,000 machines through watchChanges status writes, as
// the controller makes them (a machine done each), and reports the
// plugin's peak RSS (no budget: reported) and the time from each write to
// the frame that shows it. plugin/view's BenchmarkRender5000 measures one
// frame's rendering against its 50 ms budget.
func BenchmarkWatch5000(b *testing.B) {
	for i := 0; i < b.N; i++ {
		ns := env.Namespace(b)
		op := createOp(b, ns, "fleet")
		st := fleetStatus(watchMachines)
		setStatus(b, op, st)
		p := startTerminal(b, "ichor", "watch", "fleet", "-n", ns)
		p.waitOutput(b, progress(0))
		var slowest, total time.Duration
		for k := range watchChanges {
			m := &st.Machines[k]
			m.Phase, m.Step, m.FinishedAt = ichorv1.MachineSucceeded, "", &metav1.Time{Time: time.Now()}
			st.Progress = fmt.Sprintf("%d/%d", k+1, watchMachines)
			t0 := time.Now()
			setStatus(b, op, st)
			p.waitOutput(b, progress(k+1))
			d := time.Since(t0)
			total, slowest = total+d, max(slowest, d)
		}
		// kubectl execs the plugin: its process is the plugin's.
		mem, err := linuxproc.ReadMemory(p.cmd.Process.Pid)
		if err != nil {
			b.Fatal(err)
		}
		p.typeKeys(b, "\x03") // Ctrl-C
		if code := p.wait(b); code != 130 {
			b.Fatalf("Ctrl-C: exit %d", code)
		}
		b.ReportMetric(float64(mem.Peak)/(1<<20), "plugin-peak-rss-MiB")
		b.Logf("kubectl ichor watch over %d machines, %d status writes followed: plugin peak RSS %d MiB (reported, no budget; "+
			"at the end %d MiB anonymous, %d MiB the binary's and other files' pages); a write to its frame %s on average, %s at the slowest",
			watchMachines, watchChanges, mem.Peak>>20, mem.Anon>>20, mem.File>>20,
			(total / watchChanges).Round(time.Millisecond), slowest.Round(time.Millisecond))
	}
}

// progress is the watch view's title's progress text at done machines.
func progress(done int) string { return fmt.Sprintf("  %d/%d", done, watchMachines) }

// fleetStatus is a running Talos upgrade over n machines (3 control
// planes), none done yet, each entry as the controller writes it.
func fleetStatus(n int) ichorv1.TalosOperationStatus {
	start := metav1.Time{Time: time.Now().Add(-time.Hour)}
	st := ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Target: "talos v1.13.7",
		StartTime: &start, Progress: fmt.Sprintf("0/%d", n)}
	for i := range n {
		m := ichorv1.MachineStatus{Name: fmt.Sprintf("worker-%04d", i), Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending, From: "v1.13.2"}
		if i < 3 {
			m.Name, m.Role = fmt.Sprintf("cp-%d", i+1), ichorv1.RoleControlPlane
		}
		if i < watchChanges {
			m.Phase, m.Step, m.Attempts, m.StartedAt, m.To = ichorv1.MachineInProgress, "upgrade", 1, &start, "v1.13.7"
		}
		st.Machines = append(st.Machines, m)
	}
	return st
}
