package view

import (
	"strings"
	"time"
	"unicode/utf8"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/plan"
)

// StageView is where one stage of an operation made of stages stands, as
// the watch and describe show it.
type StageView struct {
	*ichorv1.StageStatus
	// State is Succeeded for a stage that has finished, Pending for one that
	// has not begun, and for the stage in progress the operation's state
	// there: Running, Failed (a step failed), Paused, Cancelled.
	State string
	// Progress is machines done over the stage's machines: the stage's own
	// once it has finished, status.progress while it runs, empty before.
	Progress string
	// Current marks the stage in progress (status.stage).
	Current bool

	icon  icon
	style style
}

// Stages are the operation's stages in order, each with where it stands;
// none for a kind without stages. A stage finished stays Succeeded
// whatever the operation does later (a retry runs the failed step of the
// stage in progress again).
func Stages(op *ichorv1.TalosOperation) []StageView {
	st := &op.Status
	_, cur := plan.Stage(st)
	started := st.StartTime != nil && st.Stage != ""
	ic, sty, phase := opState(op)
	if op.StepFailed() && !op.RetryPending() {
		phase = "Failed"
	}
	out := make([]StageView, len(st.Stages))
	for i := range st.Stages {
		s := &st.Stages[i]
		v := StageView{StageStatus: s, State: string(ichorv1.MachinePending), icon: iconWaiting, style: faint, Current: i == cur && started}
		switch {
		case s.FinishedAt != nil:
			v.State, v.Progress, v.icon, v.style = string(ichorv1.MachineSucceeded), s.Progress, iconOK, green
		case v.Current:
			v.State, v.Progress, v.icon, v.style = phase, st.Progress, ic, sty
		}
		out[i] = v
	}
	return out
}

// StageMachines are the machines of the stage in progress, which the
// machine table shows (every machine for a kind without stages): the
// others' phases and steps are those of an earlier stage.
func StageMachines(op *ichorv1.TalosOperation) []ichorv1.MachineStatus {
	s, _ := plan.Stage(&op.Status)
	ms, _ := plan.InStage(op.Status.Machines, s)
	return ms
}

// stagesHeader is the header's Stages line: each stage's icon, name and
// machines done, the one in progress in bold, wrapped to the width.
func stagesHeader(op *ichorv1.TalosOperation, o Options) []line {
	const label = "Stages:  "
	var lines []line
	var l line
	used := 0
	for i, v := range Stages(op) {
		text := Clean(v.Name)
		if v.Progress != "" {
			text += " " + Clean(v.Progress)
		}
		n := utf8.RuneCountInString(text) + 2 // the icon and its space
		if i > 0 && o.Width > 0 && used+2+n > o.Width {
			lines, l, used = append(lines, l), nil, 0
		}
		switch {
		case len(l) == 0 && len(lines) == 0:
			l.add(faint, label)
			used = len(label)
		case len(l) == 0:
			l.add(plain, strings.Repeat(" ", len(label)))
			used = len(label)
		default:
			l.add(plain, "  ")
			used += 2
		}
		l.add(v.style, v.icon.String(o.ASCII)+" ")
		name := plain
		if v.Current {
			name = bold
		}
		l.add(name, text)
		used += n
	}
	if len(l) > 0 {
		lines = append(lines, l)
	}
	return lines
}

// StageTable is the Stages table of describe, one tab-separated row per
// stage under a header: its name, where it stands, its order and roles, its
// machines done, when it started and finished (RFC 3339, UTC) and how long
// it took (or has run, for the stage in progress).
func StageTable(op *ichorv1.TalosOperation, now time.Time) []string {
	rows := []string{"NAME\tSTATE\tORDER\tROLES\tPROGRESS\tSTARTED\tFINISHED\tTOOK"}
	stamp := func(t *metav1.Time) string {
		if t == nil {
			return ""
		}
		return t.UTC().Format(time.RFC3339)
	}
	for _, v := range Stages(op) {
		roles := "all"
		if len(v.Roles) > 0 {
			parts := make([]string, len(v.Roles))
			for i, r := range v.Roles {
				parts[i] = Clean(string(r))
			}
			roles = strings.Join(parts, ",")
		}
		took := ""
		switch {
		case v.StartedAt != nil && v.FinishedAt != nil:
			took = human(v.FinishedAt.Sub(v.StartedAt.Time))
		case v.StartedAt != nil && v.Current:
			took = human(now.Sub(v.StartedAt.Time))
		}
		cells := []string{Clean(v.Name), v.State, Clean(string(v.Order)), roles, Clean(v.Progress), stamp(v.StartedAt), stamp(v.FinishedAt), took}
		for i, c := range cells {
			if c == "" {
				cells[i] = "-" // not yet: no column ends in blanks
			}
		}
		rows = append(rows, strings.Join(cells, "\t"))
	}
	return rows
}
