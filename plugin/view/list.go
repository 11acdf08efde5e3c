package view

import (
	"fmt"
	"unicode/utf8"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// RenderList draws the live view of every operation in a namespace, one row
// each, oldest first, clipped to the height.
func RenderList(namespace string, ops []ichorv1.TalosOperation, o Options) []string {
	var title line
	title.add(bold, fmt.Sprintf("TalosOperations in %s", Clean(namespace)))
	title.add(faint, fmt.Sprintf("  %d operations", len(ops)))
	lines := []line{title}
	if len(ops) == 0 {
		var l line
		l.add(faint, "No operations yet; waiting for one to be created")
		lines = append(lines, l)
	} else {
		nameW, targetW := len("NAME"), len("TARGET")
		for i := range ops {
			nameW = max(nameW, min(utf8.RuneCountInString(ops[i].Name), 40))
			targetW = max(targetW, min(utf8.RuneCountInString(Target(&ops[i])), 32))
		}
		var h line
		h.add(faint, "  "+pad("NAME", nameW)+"  "+pad("TARGET", targetW)+"  "+pad("PHASE", 9)+"  "+pad("PROGRESS", 8)+"  "+pad("TIME", 7)+"  MESSAGE")
		lines = append(lines, h)
		rows := ops
		hidden := 0
		if avail := o.Height - len(lines); o.Height > 0 && len(rows) > avail {
			// Newest operations matter most: the oldest give way.
			keep := max(avail-1, 0)
			hidden = len(rows) - keep
			rows = rows[hidden:]
		}
		if hidden > 0 {
			var l line
			l.add(faint, fmt.Sprintf("  … %d older operations", hidden))
			lines = append(lines, l)
		}
		for i := range rows {
			op := &rows[i]
			ic, st, phase := opState(op)
			var l line
			l.add(st, ic.String(o.ASCII)+" ")
			l.add(plain, pad(truncate(Clean(op.Name), nameW), nameW)+"  "+pad(truncate(Target(op), targetW), targetW)+"  ")
			l.add(st, pad(phase, 9))
			l.add(plain, "  "+pad(Clean(op.Status.Progress), 8)+"  "+pad(shortElapsed(op, o), 7)+"  ")
			msg := op.Status.Message
			if op.StepFailed() {
				msg = ichorv1.ReasonStepFailed + ": " + op.Status.FailureReason
			} else if op.WaitingForLock() && op.Status.LockHolder != "" {
				msg = "waiting for the cluster lock, held by " + op.Status.LockHolder
			}
			l.add(faint, Clean(msg))
			lines = append(lines, l)
		}
	}
	if o.Height > 0 && len(lines) > o.Height {
		lines = lines[:o.Height]
	}
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = l.render(o.Width, o.Color)
	}
	return out
}

func shortElapsed(op *ichorv1.TalosOperation, o Options) string {
	st := op.Status
	switch {
	case st.StartTime != nil && st.CompletionTime != nil:
		return human(st.CompletionTime.Sub(st.StartTime.Time))
	case st.StartTime != nil:
		return human(o.Now.Sub(st.StartTime.Time))
	}
	return ""
}
