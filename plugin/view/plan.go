package view

import (
	"fmt"
	"io"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/cli-runtime/pkg/printers"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Plan writes what an operation created paused would do once resumed, as
// ichor-controller planned it: the checks and their results, then the
// machines in the order they go, each with its batch (control planes one at
// a time, workers maxUnavailable at once), its from -> to, whether it
// reboots, and what the plan says of it.
func Plan(w io.Writer, op *ichorv1.TalosOperation) error {
	fmt.Fprintf(w, "Plan of %s/%s: %s, %d machine(s)\n", Clean(op.Namespace), Clean(op.Name), Target(op), len(op.Status.Machines))
	failed := false
	for _, c := range op.Status.Conditions {
		if c.Status == metav1.ConditionFalse && !StandardCondition(c.Type) {
			fmt.Fprintf(w, "  %s %s: %s (%s)\n", iconBad.ascii, Clean(c.Type), Clean(c.Message), Clean(c.Reason))
			failed = true
		}
	}
	if !failed {
		fmt.Fprintln(w, "Checks: preflight passed (versions, skew, compatibility and the kind's own checks)")
	}
	tw := printers.GetNewTabWriter(w)
	fmt.Fprintln(tw, "  BATCH\tMACHINE\tROLE\tFROM -> TO\tREBOOT\tPLAN")
	for i, b := range Batches(op) {
		m := &op.Status.Machines[i]
		batch := "-"
		if b > 0 {
			batch = fmt.Sprint(b)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\n", batch, Clean(m.Name), roleText(m.Role), orDash(versionText(m, true)), rebootText(op, m), orDash(Shorten(Clean(m.Message))))
	}
	return tw.Flush()
}

// Batches numbers each machine's batch in the plan, from 1, and 0 for a
// machine that is skipped: each control plane is a batch of its own, then
// the workers go maxUnavailable at a time. Workers already down or cordoned
// count against maxUnavailable when the operation runs, so a batch may go
// in more than one step; never more at once.
func Batches(op *ichorv1.TalosOperation) []int {
	per := max(int(op.Spec.MaxUnavailable), 1)
	out := make([]int, len(op.Status.Machines))
	batch, workers := 0, 0
	for i, m := range op.Status.Machines {
		switch {
		case m.Phase == ichorv1.MachineSkipped:
			continue
		case m.Role == ichorv1.RoleControlPlane:
			batch++
		default:
			if workers%per == 0 {
				batch++
			}
			workers++
		}
		out[i] = batch
	}
	return out
}

// rebootText says whether the operation reboots the machine: every Talos
// upgrade does, a configuration change as its plan says, a node action by
// its action.
func rebootText(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) string {
	if m.Phase == ichorv1.MachineSkipped {
		return "-"
	}
	switch op.Spec.Kind {
	case ichorv1.KindTalos:
		return "yes"
	case ichorv1.KindConfig:
		if strings.Contains(m.Message, "reboot") {
			return "yes"
		}
		return "no"
	case ichorv1.KindNode:
		if op.Spec.Node == nil {
			return "-"
		}
		switch op.Spec.Node.Action {
		case ichorv1.NodeReboot:
			return "yes"
		case ichorv1.NodeShutdown:
			return "shuts down"
		case ichorv1.NodeReset:
			if op.Spec.Node.Reset != nil && op.Spec.Node.Reset.Reboot {
				return "yes (reset)"
			}
			return "no (reset, stays down)"
		}
		return "no"
	case ichorv1.KindKubernetes, ichorv1.KindCNI, ichorv1.KindIchor:
		return "no"
	}
	return "-"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
