package main

import (
	"fmt"
	"io"
	"strings"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/sim"
)

// Names of the walk-through's operations, so that every hint can name them.
const (
	walkFirstUpgrade  = "upgrade-1"
	walkSecondUpgrade = "upgrade-2"
	walkReboot        = "reboot-1"
)

// walkTargets are the two Talos versions the walk-through upgrades to, from
// the compatibility table: the latest patch of each minor ahead of running,
// nearest first (the running minor's own, if it is newer). Fewer when the
// table has fewer.
func walkTargets(running string, t *compat.Table) []string {
	v, err := compat.ParseVersion(running)
	if err != nil {
		return nil
	}
	var out []string
	for m := v.Minor; m <= t.Newest().Minor.Minor && len(out) < 2; m++ {
		if latest, ok := t.Latest(compat.Minor{Major: v.Major, Minor: m}); ok && latest.Compare(v) > 0 {
			out = append(out, latest.String())
		}
	}
	return out
}

// printWalkThrough prints the commands to try, in an order that works when
// followed as printed: every operation has a name, and the fault is set
// before the upgrade it breaks. A line of two spaces and a command is one to
// run (TestWalkThrough runs them); "# exits 2" after it says it ends so.
func printWalkThrough(w io.Writer, sb *Sandbox) error {
	table, err := compat.Default()
	if err != nil {
		return err
	}
	targets := walkTargets(sb.cfg.Talos, table)
	if len(targets) == 0 {
		return fmt.Errorf("the compatibility table has no Talos newer than %s to upgrade to: start the sandbox with an older --talos", sb.cfg.Talos)
	}
	var workers []string
	for _, m := range sb.Fleet.Machines() {
		if m.Role() == sim.Worker {
			workers = append(workers, m.Name())
		}
	}
	machines := sb.Fleet.Machines()
	faulty := machines[len(machines)-1].Name()
	fault := sim.FaultAnnotation

	fmt.Fprintf(w, `
Walk through it in another terminal, in this order, from this directory (make build puts
kubectl-ichor in bin/):

  source %s            # sets KUBECONFIG, TALOSCONFIG and puts bin/ on PATH
  kubectl get nodes -o wide
  kubectl ichor compat                   # the versions this Ichor upgrades to
`, relative(sb.Path(fileEnv)))
	step := 0
	second := targets[len(targets)-1]
	if len(targets) > 1 {
		step++
		fmt.Fprintf(w, `
%d. Upgrade Talos to %s, one machine at a time, control planes first, and follow it
   (Ctrl-C stops following only; the upgrade goes on):

  kubectl ichor upgrade talos --to %s --name %s --watch
`, step, targets[0], targets[0], walkFirstUpgrade)
	}
	if len(workers) > 0 {
		step++
		fmt.Fprintf(w, `
%d. Reboot a worker (cordoned and drained first, within the PodDisruptionBudgets), then see
   the cluster lock and the operations:

  kubectl ichor node reboot %s --name %s --watch
  kubectl ichor lock
  kubectl ichor operation list
`, step, workers[0], walkReboot)
	}
	step++
	fmt.Fprintf(w, `
%d. Make the next upgrade fail on %s: set the fault first (the annotation %s on its
   Node; sim/README.md lists the faults), then upgrade to %s. The watch ends with exit
   code 2 when %s's upgrade fails, and the operation waits, paused:

  kubectl annotate node %s %s=error:Upgrade:Internal
  kubectl ichor upgrade talos --to %s --name %s --watch   # exits 2
  kubectl ichor operation describe %s
`, step, faulty, fault, second, faulty, faulty, fault, second, walkSecondUpgrade, walkSecondUpgrade)
	step++
	fmt.Fprintf(w, `
%d. Fix the cause and retry the failed step; the upgrade finishes:

  kubectl annotate node %s %s-
  kubectl ichor retry %s --watch
  kubectl get talosoperations
`, step, faulty, fault, walkSecondUpgrade)
	return nil
}

// walkCommands are the commands a printed walk-through says to run, in
// order, each with the exit code it says it ends with.
func walkCommands(printed string) []walkCommand {
	var out []walkCommand
	for _, line := range strings.Split(printed, "\n") {
		cmd, ok := strings.CutPrefix(line, "  ")
		if !ok || !(strings.HasPrefix(cmd, "kubectl ") || strings.HasPrefix(cmd, "source ")) {
			continue
		}
		c := walkCommand{Line: strings.TrimSpace(cmd)}
		if _, comment, ok := strings.Cut(cmd, "#"); ok && strings.Contains(comment, "exits 2") {
			c.Exit = 2
		}
		out = append(out, c)
	}
	return out
}

// walkCommand is one command of the walk-through.
type walkCommand struct {
	// Line is the line as printed, comment included: a shell runs it.
	Line string
	// Exit is the exit code the walk-through says it ends with.
	Exit int
}
