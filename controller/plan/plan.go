// Package plan decides the order in which an operation works on its
// machines and which of them may start now. It is pure: the operation
// reconciler feeds it the machines and their state and writes its answers to
// status.
//
// The rules: control planes first, strictly one at a time; workers after,
// up to maxUnavailable at once, counting workers that are down (NotReady) or
// being disrupted (cordoned by another Ichor holder) against that budget: a
// Ready worker that an operator cordoned is in service. A machine carrying the upgrade-hold
// annotation is skipped; the upgrade-order label sorts machines within their
// tier (ascending, labelled before unlabelled, then by name).
package plan

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Machine is what the plan needs to know of one machine.
type Machine struct {
	Name string
	Role ichorv1.MachineRole
	// Labels and Annotations are the Node's (for the order label and hold annotation).
	Labels      map[string]string
	Annotations map[string]string
	// Version is what the machine runs now (recorded as `from`).
	Version string
	// Last sorts the machine after the others of its tier, whatever its
	// order label: the machine the controller runs on, for a kind that
	// stops it (the others must be done before the step that stops this
	// process).
	Last bool
}

// Order sorts machines into execution order: control planes, then workers;
// within a tier by the upgrade-order label ascending (a label that is not an
// integer counts as absent), unlabelled after labelled, then by name.
func Order(ms []Machine) []Machine {
	out := append([]Machine(nil), ms...)
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if ta, tb := tier(a.Role), tier(b.Role); ta != tb {
			return ta < tb
		}
		if a.Last != b.Last {
			return b.Last
		}
		oa, okA := order(a)
		ob, okB := order(b)
		switch {
		case okA && okB && oa != ob:
			return oa < ob
		case okA != okB:
			return okA
		}
		return a.Name < b.Name
	})
	return out
}

func tier(r ichorv1.MachineRole) int {
	if r == ichorv1.RoleControlPlane {
		return 0
	}
	return 1
}

func order(m Machine) (int, bool) {
	v, ok := m.Labels[ichorv1.UpgradeOrderLabel]
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	return n, err == nil
}

// heldMessage starts the message of a machine skipped for its hold.
const heldMessage = "held by annotation "

// Held says whether the machine carries the hold annotation, and why.
func Held(m Machine) (bool, string) {
	v, ok := m.Annotations[ichorv1.UpgradeHoldAnnotation]
	if !ok {
		return false, ""
	}
	msg := heldMessage + ichorv1.UpgradeHoldAnnotation
	if v = strings.TrimSpace(v); v != "" && v != "true" {
		msg += ": " + v
	}
	return true, msg
}

// Initial builds the status entries of an operation that has not started:
// one per machine, in execution order, held machines Skipped with the reason.
// honourHold is false for kinds that name their machine explicitly.
func Initial(ms []Machine, to string, honourHold bool) []ichorv1.MachineStatus {
	ordered := Order(ms)
	out := make([]ichorv1.MachineStatus, 0, len(ordered))
	for _, m := range ordered {
		st := ichorv1.MachineStatus{Name: m.Name, Role: m.Role, Phase: ichorv1.MachinePending, From: m.Version, To: to}
		if held, why := Held(m); held && honourHold {
			st.Phase, st.Message = ichorv1.MachineSkipped, why
		}
		out = append(out, st)
	}
	return out
}

// Done reports whether a machine needs no more work.
func Done(p ichorv1.MachinePhase) bool {
	return p == ichorv1.MachineSucceeded || p == ichorv1.MachineSkipped
}

// Out is a worker of the cluster that counts against maxUnavailable while
// the operation is not working on it: it is down, or being disrupted.
type Out struct {
	// Why says what takes it out of service: "NotReady", or whose cordon it keeps.
	Why string
	// Stuck: nothing brings it back while the operation runs (a cordon that
	// another Ichor holder left when its step failed is lifted only by a
	// retry or deletion of that holder, which waits for the cluster lock).
	Stuck bool
}

// Wait says why no pending worker may start: the workers outside the
// operation's work that use up the budget. Its zero value means nothing
// waits for the budget.
type Wait struct {
	// Out are those workers, by name.
	Out map[string]Out
	Max int
}

// Stuck reports whether the stuck workers use up the budget on their own:
// waiting cannot end it.
func (w Wait) Stuck() bool {
	n := 0
	for _, o := range w.Out {
		if o.Stuck {
			n++
		}
	}
	return len(w.Out) > 0 && n >= w.Max
}

func (w Wait) String() string {
	if len(w.Out) == 0 {
		return ""
	}
	names := make([]string, 0, len(w.Out))
	for name := range w.Out {
		names = append(names, name)
	}
	sort.Strings(names)
	var parts []string
	for _, name := range names {
		if len(parts) == 3 {
			parts = append(parts, fmt.Sprintf("%d more", len(names)-3))
			break
		}
		parts = append(parts, name+": "+w.Out[name].Why)
	}
	if w.Stuck() {
		return fmt.Sprintf("%d worker(s) out of service until someone acts (%s) use up maxUnavailable %d: "+
			"retry or delete the operation that left them cordoned, or uncordon them, then retry this one",
			len(names), strings.Join(parts, "; "), w.Max)
	}
	return fmt.Sprintf("waiting for workers to come back: %d out of service (%s) with maxUnavailable %d",
		len(names), strings.Join(parts, "; "), w.Max)
}

// Next picks the machines that may start now (by index into machines), or
// says why none can. out holds the workers of the cluster (in scope or
// not) that are out of service right now; a worker the operation works on
// counts as well, and no start may take their number over maxUnavailable.
// A Ready worker that an operator cordoned is in service.
func Next(machines []ichorv1.MachineStatus, out map[string]Out, maxUnavailable int) ([]int, Wait) {
	if maxUnavailable < 1 {
		maxUnavailable = 1
	}
	for i, m := range machines {
		if m.Role != ichorv1.RoleControlPlane || Done(m.Phase) {
			continue
		}
		if m.Phase == ichorv1.MachinePending {
			return []int{i}, Wait{}
		}
		// A control plane in progress (or failed) holds back everything else.
		return nil, Wait{}
	}
	disrupted := map[string]bool{}
	for name := range out {
		disrupted[name] = true
	}
	inOp := map[string]bool{}
	for _, m := range machines {
		if m.Role == ichorv1.RoleWorker && (m.Phase == ichorv1.MachineInProgress || m.Phase == ichorv1.MachineFailed) {
			disrupted[m.Name], inOp[m.Name] = true, true
		}
	}
	var start []int
	blocked := false
	for i, m := range machines {
		if m.Role != ichorv1.RoleWorker || m.Phase != ichorv1.MachinePending {
			continue
		}
		// Working on a worker that is already down adds no disruption, but
		// it may start only while the budget holds: a worker that went down
		// beside one in flight may come back by itself, and cordoning it
		// then would take away the room the drain in flight needs for the
		// pods it evicts.
		after := len(disrupted)
		if !disrupted[m.Name] {
			after++
		}
		if after > maxUnavailable {
			blocked = true
			continue
		}
		disrupted[m.Name] = true
		start = append(start, i)
	}
	if len(start) > 0 || !blocked {
		return start, Wait{}
	}
	w := Wait{Out: map[string]Out{}, Max: maxUnavailable}
	for name, o := range out {
		if !inOp[name] {
			w.Out[name] = o
		}
	}
	if len(w.Out) == 0 {
		return nil, Wait{}
	}
	return nil, w
}

// Progress summarises the machines done over the machines in scope, like
// 3/7, and how many were left out rather than done: "5/6, 1 held" (a hold
// annotation), "4/6, 1 held, 1 skipped" (skipped by an operator).
func Progress(machines []ichorv1.MachineStatus) string {
	done, held, skipped := 0, 0, 0
	for _, m := range machines {
		switch {
		case m.Phase == ichorv1.MachineSucceeded:
			done++
		case IsHeld(m):
			held++
		case m.Phase == ichorv1.MachineSkipped:
			skipped++
		}
	}
	s := fmt.Sprintf("%d/%d", done, len(machines))
	if held > 0 {
		s += fmt.Sprintf(", %d held", held)
	}
	if skipped > 0 {
		s += fmt.Sprintf(", %d skipped", skipped)
	}
	return s
}

// IsHeld reports whether the machine was skipped for its hold annotation.
func IsHeld(m ichorv1.MachineStatus) bool {
	return m.Phase == ichorv1.MachineSkipped && strings.HasPrefix(m.Message, heldMessage)
}

// LeftOut names the skipped machines and why, for the operation's message:
// "w-3 (held by annotation ichor.maesh.dev/upgrade-hold: a disk)"; past
// three, how many more.
func LeftOut(machines []ichorv1.MachineStatus) string {
	var named []string
	n := 0
	for _, m := range machines {
		if m.Phase != ichorv1.MachineSkipped {
			continue
		}
		if n++; n > 3 {
			continue
		}
		if m.Message == "" {
			named = append(named, m.Name)
		} else {
			named = append(named, fmt.Sprintf("%s (%s)", m.Name, m.Message))
		}
	}
	if n > 3 {
		named = append(named, fmt.Sprintf("and %d more", n-3))
	}
	return strings.Join(named, ", ")
}

// Current names the machines being worked on, for the printer column.
func Current(machines []ichorv1.MachineStatus) string {
	var names []string
	for _, m := range machines {
		if m.Phase == ichorv1.MachineInProgress || m.Phase == ichorv1.MachineFailed {
			names = append(names, m.Name)
		}
	}
	switch {
	case len(names) > 3:
		return fmt.Sprintf("%s +%d", strings.Join(names[:3], ","), len(names)-3)
	default:
		return strings.Join(names, ",")
	}
}
