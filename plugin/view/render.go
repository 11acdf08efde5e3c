package view

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/duration"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Options are everything a frame depends on besides the operation.
type Options struct {
	// Width and Height bound the frame in columns and rows; 0 means no limit.
	// Lines are cut to Width; machines are folded, then clipped, to Height.
	Width, Height int
	// Color adds ANSI colours.
	Color bool
	// ASCII replaces the icons with ASCII characters.
	ASCII bool
	// Grouping folds machines in the same phase into one row when they do not
	// fit the height.
	Grouping bool
	// Now is the clock the elapsed times are measured against.
	Now time.Time
	// Command is how the user runs the plugin ("kubectl ichor" or "ichor"),
	// for the hints a frame gives.
	Command string
}

// Render draws one frame of the live view of an operation: a header (phase,
// target, progress, elapsed time, lock, failure and what to do about it) and
// one row per machine with its step, elapsed time and message.
func Render(op *ichorv1.TalosOperation, o Options) []string {
	header := renderHeader(op, o)
	ms := op.Status.Machines
	var rows []line
	if len(ms) > 0 {
		avail := 0
		if o.Height > 0 {
			avail = max(o.Height-len(header)-1, 1)
		}
		cols := columnsFor(ms)
		rows = append(rows, cols.header())
		for _, r := range layout(ms, avail, o.Grouping) {
			rows = append(rows, cols.row(ms, r, o))
		}
	}
	all := append(header, rows...)
	if o.Height > 0 && len(all) > o.Height {
		all = all[:o.Height]
	}
	out := make([]string, len(all))
	for i, l := range all {
		out[i] = l.render(o.Width, o.Color)
	}
	return out
}

func renderHeader(op *ichorv1.TalosOperation, o Options) []line {
	ic, st, phase := opState(op)
	var title line
	title.add(bold, Clean(op.Namespace+"/"+op.Name)+"  ")
	title.add(st, ic.String(o.ASCII)+" "+phase)
	if op.Status.Reason != "" && phase == string(ichorv1.PhasePaused) {
		title.add(st, " ("+Clean(op.Status.Reason)+")")
	}
	title.add(plain, "  "+Target(op))
	if op.Status.Progress != "" {
		title.add(plain, "  "+Clean(op.Status.Progress))
	}
	if op.Status.Stage != "" {
		title.add(plain, "  stage "+Clean(op.Status.Stage))
	}
	title.add(faint, "  "+elapsed(op, o.Now))
	lines := []line{title}

	note := func(st style, label, text string) {
		var l line
		l.add(st, label)
		l.add(plain, text)
		lines = append(lines, l)
	}
	name := Clean(op.Name)
	switch {
	case op.Status.Phase == "":
		note(faint, "Waiting ", "for ichor-controller to pick the operation up")
	case !op.Observed():
		note(faint, "Waiting ", fmt.Sprintf("for ichor-controller to observe generation %d (it has seen %d)", op.Generation, op.Status.ObservedGeneration))
	}
	if op.Status.Lock == ichorv1.LockHeld {
		note(faint, "Lock:    ", "held by this operation")
	} else if op.WaitingForLock() || op.Status.Reason == ichorv1.ReasonClusterLockHeld {
		holder := Clean(op.Status.LockHolder)
		if holder == "" {
			holder = "another holder"
		}
		note(blue, "Lock:    ", "waiting for the cluster lock, held by "+holder)
	}
	if op.StepFailed() {
		note(red, "Failed:  ", Clean(op.Status.FailureReason))
	}
	if op.Status.Message != "" {
		note(faint, "Message: ", Clean(op.Status.Message))
	}
	if op.Refused() {
		for _, c := range op.Status.Conditions {
			if c.Status == metav1.ConditionFalse && !builtinCondition(c.Type) {
				note(red, "  "+iconBad.String(o.ASCII)+" ", Clean(c.Type+": "+c.Message))
			}
		}
	}
	switch {
	case op.StepFailed() && op.RetryPending() && op.PausedByOperator():
		note(yellow, "Next:    ", fmt.Sprintf("retry requested; it runs once resumed: %s operation resume %s", o.Command, name))
	case op.StepFailed() && op.RetryPending():
		note(yellow, "Next:    ", "retry requested; waiting for ichor-controller to run the step again")
	case op.StepFailed() && op.PausedByOperator():
		note(yellow, "Next:    ", fmt.Sprintf("fix the cause, then: %s operation resume %s (resumes and retries)", o.Command, name))
	case op.StepFailed():
		note(yellow, "Next:    ", fmt.Sprintf("fix the cause, then: %s retry %s", o.Command, name))
	case op.PausedByOperator() && !op.Succeeded() && !op.Refused():
		note(yellow, "Next:    ", fmt.Sprintf("paused by an operator; continue with: %s operation resume %s", o.Command, name))
	case op.Refused() && !op.Spec.Override:
		note(yellow, "Next:    ", "fix what preflight refused and create a new operation (an ichor-admin can set spec.override)")
	}
	return lines
}

func builtinCondition(t string) bool {
	return t == ichorv1.ConditionReady || t == ichorv1.ConditionProgressing || t == ichorv1.ConditionPaused
}

// elapsed is how long the operation has run (or ran), or its age before it
// started.
func elapsed(op *ichorv1.TalosOperation, now time.Time) string {
	st := op.Status
	switch {
	case st.StartTime != nil && st.CompletionTime != nil:
		return "took " + human(st.CompletionTime.Sub(st.StartTime.Time))
	case st.StartTime != nil:
		return "elapsed " + human(now.Sub(st.StartTime.Time))
	case !op.CreationTimestamp.IsZero():
		return "age " + human(now.Sub(op.CreationTimestamp.Time))
	}
	return ""
}

func human(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	return duration.HumanDuration(d)
}

// row is one machine, or a group of machines folded into one row.
type row struct {
	machine int   // index into the machines, when group is nil
	group   []int // the folded machines, all in one phase
	phase   ichorv1.MachinePhase
	more    bool // the "… N more" row; group holds the hidden machines
}

// quiet phases fold; InProgress and Failed machines always get a row.
func quiet(p ichorv1.MachinePhase) bool {
	return p == ichorv1.MachineSucceeded || p == ichorv1.MachineSkipped || p == ichorv1.MachinePending || p == ""
}

// layout decides the machine rows. Everything fits: one row per machine in
// execution order. Else runs of neighbours in the same quiet phase fold; if
// that is still too long, one row per quiet phase (done ones first, pending
// last) with the failed and active machines between them, clipped with a
// "… N more" row. Without grouping the list is clipped in execution order.
func layout(ms []ichorv1.MachineStatus, avail int, grouping bool) []row {
	rows := make([]row, 0, min(len(ms), max(avail, 16)))
	if avail == 0 || len(ms) <= avail {
		for i := range ms {
			rows = append(rows, row{machine: i, phase: ms[i].Phase})
		}
		return rows
	}
	if !grouping {
		for i := range ms[:avail-1] {
			rows = append(rows, row{machine: i, phase: ms[i].Phase})
		}
		return append(rows, row{more: true, group: seq(avail-1, len(ms))})
	}
	for i := 0; i < len(ms); {
		j := i + 1
		if quiet(ms[i].Phase) {
			for j < len(ms) && ms[j].Phase == ms[i].Phase {
				j++
			}
		}
		if j-i > 1 {
			rows = append(rows, row{group: seq(i, j), phase: ms[i].Phase})
		} else {
			rows = append(rows, row{machine: i, phase: ms[i].Phase})
		}
		i = j
		if len(rows) > avail {
			break
		}
	}
	if len(rows) <= avail {
		return rows
	}

	byPhase := map[ichorv1.MachinePhase][]int{}
	for i := range ms {
		byPhase[ms[i].Phase] = append(byPhase[ms[i].Phase], i)
	}
	var top, bottom []row
	for _, p := range []ichorv1.MachinePhase{ichorv1.MachineSucceeded, ichorv1.MachineSkipped} {
		if len(byPhase[p]) > 0 {
			top = append(top, row{group: byPhase[p], phase: p})
		}
	}
	for _, p := range []ichorv1.MachinePhase{ichorv1.MachinePending, ""} {
		if len(byPhase[p]) > 0 {
			bottom = append(bottom, row{group: byPhase[p], phase: p})
		}
	}
	active := append(append([]int{}, byPhase[ichorv1.MachineFailed]...), byPhase[ichorv1.MachineInProgress]...)
	if room := avail - len(top) - len(bottom); len(active) <= room {
		rows = append(rows[:0], top...)
		for _, i := range active {
			rows = append(rows, row{machine: i, phase: ms[i].Phase})
		}
		return append(rows, bottom...)
	}
	// Not even the failed and active machines fit: show as many as do and
	// count the rest in one row; with no room for the groups either, that row
	// counts every machine not shown, so none is hidden silently.
	room := avail - len(top) - len(bottom) - 1
	if room < 1 {
		top, bottom = nil, nil
		room = max(avail-1, 0)
	}
	shown := make([]bool, len(ms))
	rows = append(rows[:0], top...)
	for _, i := range active[:room] {
		rows = append(rows, row{machine: i, phase: ms[i].Phase})
		shown[i] = true
	}
	for _, g := range append(append([]row{}, top...), bottom...) {
		for _, i := range g.group {
			shown[i] = true
		}
	}
	var hidden []int
	for i := range ms {
		if !shown[i] {
			hidden = append(hidden, i)
		}
	}
	rows = append(rows, row{more: true, group: hidden})
	return append(rows, bottom...)
}

func seq(from, to int) []int {
	s := make([]int, 0, to-from)
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

// columns are the widths of the machine table, measured over all machines so
// they stay put from one frame to the next.
type columns struct{ name, role, phase, step, time int }

func columnsFor(ms []ichorv1.MachineStatus) columns {
	c := columns{name: len("NAME"), role: len("ROLE"), phase: len("InProgress"), step: len("STEP"), time: len("TIME")}
	c.name = max(c.name, len(fmt.Sprintf("%d machines", len(ms))))
	for i := range ms {
		m := &ms[i]
		c.name = max(c.name, min(utf8.RuneCountInString(m.Name), 32))
		c.step = max(c.step, min(utf8.RuneCountInString(m.Step), 24))
		c.role = max(c.role, len(roleText(m.Role)))
		if m.Attempts > 1 {
			c.phase = max(c.phase, len(phaseText(m)))
		}
	}
	c.time = max(c.time, 6)
	return c
}

func (c columns) header() line {
	var l line
	l.add(faint, "  "+pad("NAME", c.name)+"  "+pad("ROLE", c.role)+"  "+pad("PHASE", c.phase)+"  "+pad("STEP", c.step)+"  "+pad("TIME", c.time)+"  MESSAGE")
	return l
}

func phaseText(m *ichorv1.MachineStatus) string {
	p := string(m.Phase)
	if p == "" {
		p = string(ichorv1.MachinePending)
	}
	if m.Attempts > 1 {
		p += fmt.Sprintf(" #%d", m.Attempts)
	}
	return p
}

func roleText(r ichorv1.MachineRole) string {
	if r == ichorv1.RoleControlPlane {
		return "cp"
	}
	return string(r)
}

func (c columns) row(ms []ichorv1.MachineStatus, r row, o Options) line {
	var l line
	if r.more {
		l.add(faint, "  "+fmt.Sprintf("… %d more machines (%s); use a taller terminal or -o json", len(r.group), countPhases(ms, r.group)))
		return l
	}
	if r.group != nil {
		ic, st := machineState(r.phase)
		phase := string(r.phase)
		if phase == "" {
			phase = string(ichorv1.MachinePending)
		}
		l.add(st, ic.String(o.ASCII)+" ")
		l.add(plain, pad(fmt.Sprintf("%d machines", len(r.group)), c.name)+"  "+pad("", c.role)+"  ")
		l.add(st, pad(phase, c.phase))
		l.add(plain, "  "+pad("", c.step)+"  "+pad("", c.time)+"  ")
		l.add(faint, names(ms, r.group, o.Width))
		return l
	}
	m := &ms[r.machine]
	ic, st := machineState(m.Phase)
	l.add(st, ic.String(o.ASCII)+" ")
	l.add(plain, pad(truncate(Clean(m.Name), c.name), c.name)+"  "+pad(roleText(m.Role), c.role)+"  ")
	l.add(st, pad(phaseText(m), c.phase))
	l.add(plain, "  "+pad(truncate(Clean(m.Step), c.step), c.step)+"  "+pad(machineTime(m, o.Now), c.time)+"  ")
	msgStyle := plain
	if m.Phase == ichorv1.MachineFailed {
		msgStyle = red
	}
	l.add(msgStyle, Clean(m.Message))
	return l
}

// machineTime is how long the machine has been worked on, or took.
func machineTime(m *ichorv1.MachineStatus, now time.Time) string {
	switch {
	case m.StartedAt == nil:
		return ""
	case m.FinishedAt != nil:
		return human(m.FinishedAt.Sub(m.StartedAt.Time))
	}
	return human(now.Sub(m.StartedAt.Time))
}

// names lists a group's machines, as many as a line can hold.
func names(ms []ichorv1.MachineStatus, group []int, width int) string {
	limit := 12
	if width > 0 {
		limit = max(width/12, 2)
	}
	var parts []string
	for _, i := range group[:min(len(group), limit)] {
		parts = append(parts, Clean(ms[i].Name))
	}
	s := strings.Join(parts, ", ")
	if len(group) > limit {
		s += ", … " + Clean(ms[group[len(group)-1]].Name)
	}
	return s
}

// countPhases says how many of the machines are in each phase, like
// "12 Succeeded, 2 Pending".
func countPhases(ms []ichorv1.MachineStatus, idx []int) string {
	order := []ichorv1.MachinePhase{ichorv1.MachineFailed, ichorv1.MachineInProgress, ichorv1.MachinePending, ichorv1.MachineSkipped, ichorv1.MachineSucceeded}
	n := map[ichorv1.MachinePhase]int{}
	for _, i := range idx {
		p := ms[i].Phase
		if p == "" {
			p = ichorv1.MachinePending
		}
		n[p]++
	}
	var parts []string
	for _, p := range order {
		if n[p] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[p], p))
		}
	}
	return strings.Join(parts, ", ")
}
