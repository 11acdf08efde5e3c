package view

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/duration"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/plan"
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

	// What the caller read besides the operation, when it could.

	// Cordoned holds the machines whose Node is cordoned (the caller reads
	// the Nodes of failed machines), so a frame can say that a failed
	// machine was left out of service.
	Cordoned map[string]bool
	// Queue are the operations waiting for the cluster lock, in the order
	// they get it, as namespace/name.
	Queue []QueuedOperation
	// Jobs are the Jobs the operation started (kinds cni and ichor), as
	// their newest pods show them.
	Jobs []JobRun
}

// JobRun is a Job an operation started, as its newest pod shows it.
type JobRun struct {
	Namespace, Name string
	// Phase says where the pod stands: Pending, waiting for the cluster
	// lock (its lock init container runs), Running, Succeeded, Failed.
	Phase string
	// LastLine is the last line its container logged (or, once it ended,
	// its termination message's last line); empty when unknown.
	LastLine string
}

// QueuedOperation is an operation waiting for the cluster lock.
type QueuedOperation struct {
	Namespace, Name string
	Kind            ichorv1.OperationKind
}

// Render draws one frame of the live view of an operation: a header (phase,
// target, progress, elapsed time, the stages of a kind made of stages,
// lock, failure and what to do about it) and one row per machine (of the
// stage in progress) with its step, elapsed time and message.
func Render(op *ichorv1.TalosOperation, o Options) []string {
	header := renderHeader(op, o)
	ms := StageMachines(op)
	var rows []line
	if len(ms) > 0 {
		avail := 0
		if o.Height > 0 {
			avail = max(o.Height-len(header)-1, 1)
		}
		cols := columnsFor(ms, o.ASCII)
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
	// An operation made of stages says which stage it is in; the Stages
	// line names each and its progress.
	if _, i := plan.Stage(&op.Status); op.Status.Stage != "" && i >= 0 {
		title.add(plain, fmt.Sprintf("  stage %d/%d", i+1, len(op.Status.Stages)))
	} else if op.Status.Progress != "" {
		title.add(plain, "  "+Clean(op.Status.Progress))
	}
	title.add(faint, "  "+elapsed(op, o.Now))
	if left, ok := TimeLeft(op, o.Now); ok {
		title.add(faint, ", ~"+human(left)+" left")
	}
	lines := append([]line{title}, stagesHeader(op, o)...)

	note := func(st style, label, text string) {
		var l line
		l.add(st, label)
		l.add(plain, text)
		lines = append(lines, l)
	}
	// long notes wrap instead of being cut: what failed, and why, is read in full.
	long := func(st style, label, text string) {
		for i, part := range wrap(text, o.Width-len(label)) {
			if i > 0 {
				label = strings.Repeat(" ", len(label))
			}
			note(st, label, part)
		}
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
	if q := queueText(op, o.Queue); q != "" {
		long(faint, "Queue:   ", q)
	}
	for _, j := range o.Jobs {
		text := Clean(j.Namespace+"/"+j.Name) + ": " + Clean(j.Phase)
		if j.LastLine != "" {
			text += ": " + Shorten(Clean(j.LastLine))
		}
		long(faint, "Job:     ", text)
	}
	failed := failedMachines(op)
	if op.StepFailed() {
		reason := Clean(op.Status.FailureReason)
		if len(failed) == 0 {
			note(red, "Failure: ", reason)
		}
		for n, i := range failed {
			if n == maxCauses {
				note(red, "         ", fmt.Sprintf("… and %d more failed machines (see: %s operation describe %s)", len(failed)-n, o.Command, name))
				break
			}
			m := &op.Status.Machines[i]
			what := Clean(m.Name) + " at step " + Clean(m.Step)
			if m.Attempts > 1 {
				what += fmt.Sprintf(" (attempt %d)", m.Attempts)
			}
			if n == 0 {
				what = reason + ": " + what
			}
			if o.Cordoned[m.Name] {
				what += "; " + Clean(m.Name) + " was left cordoned"
			}
			long(red, "Failure: ", what)
			if m.Message != "" {
				long(plain, "Cause:   ", Shorten(Clean(m.Message)))
			}
		}
	}
	switch {
	case op.Cancelled():
		// who cancelled it and which machines were done are read in full.
		long(faint, "Message: ", Clean(op.Status.Message))
	case op.Refused() && len(RefusedChecks(op)) > 0:
		// The checks say it, each once, below.
	case op.Status.Message != "" && (!op.StepFailed() || len(failed) == 0):
		note(faint, "Message: ", Clean(op.Status.Message))
	}
	for _, c := range RefusedChecks(op) {
		long(red, "  "+iconBad.String(o.ASCII)+" ", c)
	}
	switch {
	case op.Cancelled() && op.Settled():
		note(faint, "Next:    ", "the record stays; to start again, create a new operation")
	case op.Cancelled():
		// The message says what it waits for.
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
	case op.Refused():
		long(yellow, "Next:    ", RefusedNext(op))
	}
	if m := op.Status.FailedMachine(); m != nil && op.StepFailed() && !op.RetryPending() {
		if req, ok := op.SkipRequested(); ok {
			long(yellow, "         ", fmt.Sprintf("skip of %s requested; waiting for ichor-controller", Clean(req.Machine)))
		} else {
			long(yellow, "         ", fmt.Sprintf("or give up on %[1]s and go on without it: %[2]s operation skip %[3]s %[1]s", Clean(m.Name), o.Command, name))
		}
	}
	return lines
}

// maxCauses bounds the failed machines whose cause the header spells out.
const maxCauses = 3

// failedMachines are the indices of the failed machines, in execution order.
func failedMachines(op *ichorv1.TalosOperation) []int {
	var out []int
	for i := range op.Status.Machines {
		if op.Status.Machines[i].Phase == ichorv1.MachineFailed {
			out = append(out, i)
		}
	}
	return out
}

// queueText says which operations wait for the cluster lock besides this
// one, and where this one stands among them when it waits too.
func queueText(op *ichorv1.TalosOperation, q []QueuedOperation) string {
	var others []string
	pos := 0
	for _, w := range q {
		if w.Namespace == op.Namespace && w.Name == op.Name {
			pos = len(others) + 1
			continue
		}
		others = append(others, fmt.Sprintf("%s/%s (%s)", Clean(w.Namespace), Clean(w.Name), Clean(string(w.Kind))))
	}
	if len(others) == 0 {
		return ""
	}
	list := strings.Join(others[:min(len(others), 5)], ", ")
	if len(others) > 5 {
		list += fmt.Sprintf(" and %d more", len(others)-5)
	}
	if pos > 0 {
		return fmt.Sprintf("this operation is %s of %d waiting for the cluster lock, with %s", ordinal(pos), len(others)+1, list)
	}
	return fmt.Sprintf("%d waiting for the cluster lock: %s", len(others), list)
}

func ordinal(n int) string {
	suffix := "th"
	switch {
	case n%100 >= 11 && n%100 <= 13:
	case n%10 == 1:
		suffix = "st"
	case n%10 == 2:
		suffix = "nd"
	case n%10 == 3:
		suffix = "rd"
	}
	return fmt.Sprintf("%d%s", n, suffix)
}

// RefusedChecks are a refused operation's failed checks, one line each,
// "TalosMinorSkip: what would pass", as the controller wrote them: the only
// place the controller keeps each check's full text.
func RefusedChecks(op *ichorv1.TalosOperation) []string {
	if !op.Refused() {
		return nil
	}
	var out []string
	for _, c := range op.Status.Conditions {
		if c.Status == metav1.ConditionFalse && !StandardCondition(c.Type) {
			out = append(out, Clean(c.Type+": "+c.Message))
		}
	}
	return out
}

// RefusedNext says what to do about a refused operation: fix what the
// checks say and create a new one; last, and only where spec.override can
// run it and is not set yet, the override.
func RefusedNext(op *ichorv1.TalosOperation) string {
	var checks []string
	for _, c := range op.Status.Conditions {
		if c.Status == metav1.ConditionFalse && !StandardCondition(c.Type) {
			checks = append(checks, c.Type)
		}
	}
	next := "fix what the failed checks say, then create a new operation"
	if !op.Spec.Override && ichorv1.OverrideHelps(checks) {
		next += "; " + ichorv1.OverrideHint
	}
	return next
}

// StandardCondition reports whether a condition type is one of the
// operation's own (Ready, Progressing, Paused, Stalled, Reconciling), which
// repeat its message, rather than a check's.
func StandardCondition(t string) bool {
	switch t {
	case ichorv1.ConditionReady, ichorv1.ConditionProgressing, ichorv1.ConditionPaused, ichorv1.ConditionStalled, ichorv1.ConditionReconciling:
		return true
	}
	return false
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
// The version column is left out (0) when no machine has versions.
type columns struct {
	name, role, version, phase, step, time int
	ascii                                  bool
}

func columnsFor(ms []ichorv1.MachineStatus, ascii bool) columns {
	c := columns{name: len("NAME"), role: len("ROLE"), phase: len("InProgress"), step: len("STEP"), time: len("TIME"), ascii: ascii}
	c.name = max(c.name, len(fmt.Sprintf("%d machines", len(ms))))
	for i := range ms {
		m := &ms[i]
		c.name = max(c.name, min(utf8.RuneCountInString(m.Name), 32))
		c.step = max(c.step, min(utf8.RuneCountInString(m.Step), 24))
		c.role = max(c.role, len(roleText(m.Role)))
		if m.From != "" || m.To != "" {
			c.version = max(c.version, len("VERSION"), min(utf8.RuneCountInString(versionText(m, ascii)), 40))
		}
		if m.Attempts > 1 {
			c.phase = max(c.phase, len(phaseText(m)))
		}
	}
	c.time = max(c.time, 6)
	return c
}

func (c columns) header() line {
	var l line
	l.add(faint, "  "+pad("NAME", c.name)+"  "+pad("ROLE", c.role)+"  "+c.versionCell("VERSION")+pad("PHASE", c.phase)+"  "+pad("STEP", c.step)+"  "+pad("TIME", c.time)+"  MESSAGE")
	return l
}

// versionCell is one cell of the version column with its gap, or nothing
// when the column is left out.
func (c columns) versionCell(s string) string {
	if c.version == 0 {
		return ""
	}
	return pad(truncate(s, c.version), c.version) + "  "
}

// versionText is a machine's from -> to, or its version when it stays.
func versionText(m *ichorv1.MachineStatus, ascii bool) string {
	from, to := Clean(m.From), Clean(m.To)
	arrow := " → "
	if ascii {
		arrow = " -> "
	}
	switch {
	case from == to || to == "" || m.Phase == ichorv1.MachineSkipped:
		return from // it stays where it is
	case from == "":
		return strings.TrimPrefix(arrow, " ") + to
	}
	return from + arrow + to
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
		l.add(plain, pad(fmt.Sprintf("%d machines", len(r.group)), c.name)+"  "+pad("", c.role)+"  "+c.versionCell(groupVersion(ms, r.group, c.ascii)))
		l.add(st, pad(phase, c.phase))
		l.add(plain, "  "+pad("", c.step)+"  "+pad("", c.time)+"  ")
		l.add(faint, names(ms, r.group, o.Width))
		return l
	}
	m := &ms[r.machine]
	ic, st := machineState(m.Phase)
	l.add(st, ic.String(o.ASCII)+" ")
	l.add(plain, pad(truncate(Clean(m.Name), c.name), c.name)+"  "+pad(roleText(m.Role), c.role)+"  "+c.versionCell(versionText(m, c.ascii)))
	l.add(st, pad(phaseText(m), c.phase))
	l.add(plain, "  "+pad(truncate(Clean(m.Step), c.step), c.step)+"  "+pad(machineTime(m, o.Now), c.time)+"  ")
	msgStyle := plain
	if m.Phase == ichorv1.MachineFailed {
		msgStyle = red
	}
	l.add(msgStyle, Shorten(Clean(m.Message)))
	return l
}

// groupVersion is the version text the machines of a folded row share, or
// nothing when they differ.
func groupVersion(ms []ichorv1.MachineStatus, group []int, ascii bool) string {
	first := &ms[group[0]]
	for _, i := range group[1:] {
		if ms[i].From != first.From || ms[i].To != first.To {
			return ""
		}
	}
	return versionText(first, ascii)
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
