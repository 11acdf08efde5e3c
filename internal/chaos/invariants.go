package chaos

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// Violation is a broken invariant.
type Violation struct {
	Invariant string
	// At is when it broke: the history up to there led to it.
	At   time.Time
	What string
	// Key tells the violation apart across checks of a growing history,
	// when What changes with it (an action still going ends); empty means
	// What does.
	Key string
}

// key is what tells v apart.
func (v Violation) key() string {
	if v.Key != "" {
		return v.Invariant + "\x00" + v.Key
	}
	return v.Invariant + "\x00" + v.What
}

// actKey names a disruption whatever becomes of it.
func actKey(acts ...sim.Action) string {
	var b strings.Builder
	for _, a := range acts {
		fmt.Fprintf(&b, "%s/%s/%d ", a.Machine, a.Kind, a.Start.UnixNano())
	}
	return b.String()
}

// Invariant is one promise the controller keeps under every interleaving,
// checked on a History.
type Invariant struct {
	Name string
	// Says is the promise, as the report prints it.
	Says  string
	Check func(h *History) []Violation
}

// Invariants are the promises a campaign checks, continuously while a run
// goes (those that need its end, at the end).
var Invariants = []Invariant{
	{"control-planes", "never two control planes disrupted at once (nor one while another's etcd member is unhealthy)", checkControlPlanes},
	{"worker-budget", "never more workers down than the lock holder's maxUnavailable", checkWorkerBudget},
	{"holders", "every disruption under the lock holder that works on the machine; never two holders' disruptions overlapping", checkHolders},
	{"at-most-once", "every irreversible call accepted at most once per step and attempt", checkAtMostOnce},
	{"evidence", "a node action done only once its call was accepted: reboot, shutdown, reset", checkEvidence},
	{"installed-once", "every machine of a succeeded upgrade installed once", checkInstalledOnce},
	{"stale-holder", "the lock never held by a settled or deleted operation, nor by a finished Job that a waiter queues behind, once the controller has seen it", checkStaleHolder},
	{"lost", "no operation lost, none left half-deleted, no Node left cordoned by an upgrade or reboot that is over", checkLost},
	{"succeeded", "after faults are cleared and failures retried, every operation ends Succeeded", checkSucceeded},
}

// Check runs every invariant on h and returns the violations in the order
// they happened, each once: when it first broke, as it stands last.
func Check(h *History) []Violation {
	var out []Violation
	seen := map[string]int{}
	for _, inv := range Invariants {
		for _, v := range inv.Check(h) {
			v.Invariant = inv.Name
			if i, ok := seen[v.key()]; ok {
				out[i].What = v.What
				continue
			}
			seen[v.key()] = len(out)
			out = append(out, v)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At.Before(out[j].At) })
	return out
}

// lingering is how long a settled or deleted operation may still name
// itself on the lock: a controller killed between its status write and
// its release needs a leader election and a reconcile to let go.
const lingering = 20 * time.Second

// disruptions are the actions that take a machine out of service (an
// install alone does not).
func disruptions(h *History, role sim.Role) []sim.Action {
	var out []sim.Action
	for _, a := range h.Actions {
		if a.Kind == sim.ActionInstall || (role != "" && h.Roles[a.Machine] != role) {
			continue
		}
		out = append(out, a)
	}
	return out
}

// worked is when a disruption's work ended: a reboot or upgrade when the
// machine runs again; a shutdown or reset when the machine went down
// (being off or coming back after that is its new state, not the action).
func (h *History) worked(a sim.Action) time.Time {
	if (a.Kind == sim.ActionShutdown || a.Kind == sim.ActionReset) && !a.Down.IsZero() {
		return a.Down
	}
	return h.end(a)
}

func (h *History) describe(a sim.Action) string {
	end := "still"
	if !a.End.IsZero() {
		end = h.rel(a.End)
	}
	return fmt.Sprintf("%s's %s (%s to %s)", a.Machine, a.Kind, h.rel(a.Start), end)
}

// etcdCheckMargin is how long before a control plane's disruptive call
// another member must have been unhealthy for the call to be a violation:
// an etcd health check right before the call sees it by then.
const etcdCheckMargin = time.Second

// checkControlPlanes: no two control planes out of service at once, and
// none disrupted while another's etcd member is unhealthy (etcd would be
// left with one healthy member of three).
func checkControlPlanes(h *History) []Violation {
	acts := disruptions(h, sim.ControlPlane)
	var out []Violation
	for i, a := range acts {
		for _, b := range acts[i+1:] {
			if a.Machine != b.Machine && a.Start.Before(h.end(b)) && b.Start.Before(h.end(a)) {
				out = append(out, Violation{At: later(a.Start, b.Start), Key: actKey(a, b),
					What: fmt.Sprintf("%s and %s: two control planes out of service at once", h.describe(a), h.describe(b))})
			}
		}
		for _, u := range h.Unhealthy {
			if u.Machine != a.Machine && !u.From.After(a.Start.Add(-etcdCheckMargin)) && (u.To.IsZero() || u.To.After(a.Start)) {
				out = append(out, Violation{At: a.Start, Key: actKey(a) + u.Machine,
					What: fmt.Sprintf("%s started while %s's etcd member was unhealthy (since %s)", h.describe(a), u.Machine, h.rel(u.From))})
			}
		}
	}
	return out
}

func checkWorkerBudget(h *History) []Violation {
	acts := disruptions(h, sim.Worker)
	var out []Violation
	for _, w := range acts {
		down := map[string]bool{}
		for _, a := range acts {
			if !a.Start.After(w.Start) && w.Start.Before(h.end(a)) {
				down[a.Machine] = true
			}
		}
		holder := h.holderAt(w.Start)
		budget := 0
		for _, op := range h.opsOf(holder) {
			if o, _ := h.last(op); max(o.MaxUnavailable, 1) > budget {
				budget = max(o.MaxUnavailable, 1)
			}
		}
		if budget > 0 && len(down) > budget {
			out = append(out, Violation{At: w.Start, Key: actKey(w), What: fmt.Sprintf("%s made %d workers out of service (%s) while %s, with maxUnavailable %d, held the lock",
				h.describe(w), len(down), strings.Join(sortedKeys(down), ", "), holder, budget)})
		}
	}
	return out
}

func checkHolders(h *History) []Violation {
	acts := disruptions(h, "")
	var out []Violation
	for _, a := range acts {
		switch holder := h.holderAt(a.Start); {
		case holder == "":
			out = append(out, Violation{At: a.Start, Key: actKey(a), What: h.describe(a) + " started while nobody held the cluster lock"})
		case !h.owns(holder, a.Machine):
			out = append(out, Violation{At: a.Start, Key: actKey(a), What: fmt.Sprintf("%s started while %s held the cluster lock, and it does not work on %s", h.describe(a), holder, a.Machine)})
		}
	}
	for i, a := range acts {
		for _, b := range acts[i+1:] {
			ha, hb := h.holderAt(a.Start), h.holderAt(b.Start)
			if a.Machine != b.Machine && ha != hb && a.Start.Before(h.worked(b)) && b.Start.Before(h.worked(a)) {
				out = append(out, Violation{At: later(a.Start, b.Start), Key: actKey(a, b),
					What: fmt.Sprintf("%s under %s and %s under %s overlap", h.describe(a), orNobody(ha), h.describe(b), orNobody(hb))})
			}
		}
	}
	return out
}

// irreversible are the calls a machine may accept at most once per step and
// attempt. One that did not take (refused, or its caller gone before the
// machine acted) may be sent again.
var irreversible = []string{"MachineService/Reboot", "MachineService/Upgrade", "MachineService/Reset", "MachineService/Shutdown"}

func checkAtMostOnce(h *History) []Violation {
	type key struct{ holder, machine, method string }
	count := map[key]int{}
	var out []Violation
	for _, c := range h.Calls {
		if !slices.Contains(irreversible, c.Method) || !c.Accepted() {
			continue
		}
		holder := h.holderAt(c.At)
		if !h.owns(holder, c.Machine) {
			continue // the holders invariant names a disruption without the lock
		}
		k := key{holder, c.Machine, c.Method}
		count[k]++
		var allowed int32
		for _, op := range h.opsOf(holder) {
			allowed += h.attempts(op, c.Machine)
		}
		if int32(count[k]) > allowed {
			out = append(out, Violation{At: c.At, Key: fmt.Sprint(k), What: fmt.Sprintf("%s accepted %s %d times under %s, which ran it in %d attempt(s)",
				c.Machine, c.Method, count[k], holder, allowed)})
		}
	}
	return out
}

// evidenceOf is the call a node action's step sends.
var evidenceOf = map[string]string{"reboot": "MachineService/Reboot", "shutdown": "MachineService/Shutdown", "reset": "MachineService/Reset"}

func checkEvidence(h *History) []Violation {
	var out []Violation
	for _, name := range sortedKeys(h.Ops) {
		o, _ := h.last(name)
		method, ok := evidenceOf[o.NodeAction]
		if o.Kind != string(ichorv1.KindNode) || !ok || o.Phase != string(ichorv1.PhaseSucceeded) {
			continue
		}
		sent := false
		for _, c := range h.Calls {
			if c.Machine == o.Machine && c.Method == method && c.Accepted() && slices.Contains(h.opsOf(h.holderAt(c.At)), name) {
				sent = true
			}
		}
		if !sent {
			out = append(out, Violation{At: firstSettled(h, name), What: fmt.Sprintf("%s succeeded, but %s accepted no %s while it held the lock", name, o.Machine, method)})
		}
	}
	return out
}

func checkInstalledOnce(h *History) []Violation {
	var out []Violation
	for _, name := range sortedKeys(h.Ops) {
		o, _ := h.last(name)
		if o.Kind != string(ichorv1.KindTalos) || o.Phase != string(ichorv1.PhaseSucceeded) {
			continue
		}
		for _, m := range o.Machines {
			if m.Phase != string(ichorv1.MachineSucceeded) || m.From == "" || m.From == o.Target {
				continue
			}
			n := 0
			for _, u := range h.Upgrades {
				if u.Machine == m.Name && u.Version == o.Target {
					n++
				}
			}
			if n != 1 {
				out = append(out, Violation{At: firstSettled(h, name), What: fmt.Sprintf("%s succeeded, and %s (from %s) booted %s %d times, not once", name, m.Name, m.From, o.Target, n)})
			}
		}
	}
	return out
}

func checkStaleHolder(h *History) []Violation {
	var out []Violation
	over := map[string]time.Time{} // operation -> when it was first seen settled or gone
	why := map[string]string{}
	for _, name := range sortedKeys(h.Ops) {
		for _, v := range h.Ops[name] {
			if v.Settled() || v.Gone {
				over[name], why[name] = v.Seen, "settled ("+v.Phase+")"
				if v.Gone {
					why[name] = "deleted"
				}
				break
			}
		}
	}
	isOp := func(holder string) (string, bool) {
		id, err := ichorv1.ParseLockHolder(holder)
		return id.Name, err == nil && id.Kind == ichorv1.HolderOperation
	}
	for _, c := range h.Lease {
		if op, ok := isOp(c.Holder); ok {
			if t, done := over[op]; done && c.At.After(t) {
				out = append(out, Violation{At: c.At, What: fmt.Sprintf("%s took the cluster lock at %s, though it was %s at %s", c.Holder, h.rel(c.At), why[op], h.rel(t))})
			}
		}
	}
	for _, op := range sortedKeys(over) {
		t := over[op].Add(lingering)
		if holder := h.holderAt(t); h.Now.After(t) {
			if name, ok := isOp(holder); ok && name == op {
				out = append(out, Violation{At: t, What: fmt.Sprintf("%s still held the cluster lock %s after it was %s", holder, lingering, why[op])})
			}
		}
	}
	out = append(out, checkStaleJobs(h)...)
	if h.End != nil {
		if op, ok := isOp(h.End.Holder); ok {
			if _, done := over[op]; done {
				out = append(out, Violation{At: h.Now, What: fmt.Sprintf("%s holds the cluster lock at the end, though it was %s", h.End.Holder, why[op])})
			}
		}
	}
	return out
}

// checkStaleJobs: a Job that completed or was deleted without releasing
// the lock never takes it again, and loses it to an operation that waits
// for it within lingering (a Job that nobody waits for may keep it: it is
// taken over, not released for it).
func checkStaleJobs(h *History) []Violation {
	var out []Violation
	job := func(holder string) (string, bool) {
		id, err := ichorv1.ParseLockHolder(holder)
		return id.Name, err == nil && id.Kind == ichorv1.HolderJob
	}
	for _, c := range h.Lease {
		if name, ok := job(c.Holder); ok {
			if t, over := h.JobsOver[name]; over && c.At.After(t) {
				out = append(out, Violation{At: c.At, What: fmt.Sprintf("%s took the cluster lock at %s, though the Job was over at %s", c.Holder, h.rel(c.At), h.rel(t))})
			}
		}
	}
	for _, name := range sortedKeys(h.JobsOver) {
		t := h.JobsOver[name].Add(lingering)
		holder := h.holderAt(t)
		if held, ok := job(holder); !ok || held != name || !h.Now.After(t) {
			continue
		}
		for _, op := range sortedKeys(h.Ops) {
			if o, seen := h.at(op, t); seen && !o.Gone && o.Reason == ichorv1.ReasonClusterLockHeld {
				out = append(out, Violation{At: t, What: fmt.Sprintf("%s still held the cluster lock %s after the Job was over, while %s waited for it", holder, lingering, op)})
				break
			}
		}
	}
	return out
}

func checkLost(h *History) []Violation {
	if h.End == nil {
		return nil
	}
	var out []Violation
	for _, name := range h.End.Created {
		o, seen := h.last(name)
		switch {
		case !seen:
			out = append(out, Violation{At: h.Now, What: name + " was created but never seen"})
		case h.End.Deleted[name] && !o.Gone:
			out = append(out, Violation{At: h.Now, What: fmt.Sprintf("%s was deleted but is still there (phase %s, %s)", name, o.Phase, o.Message)})
		case !h.End.Deleted[name] && o.Gone:
			out = append(out, Violation{At: o.Seen, What: name + " is gone, though nobody deleted it"})
		}
	}
	for _, node := range sortedKeys(h.End.CordonedBy) {
		holder := h.End.CordonedBy[node]
		id, err := ichorv1.ParseLockHolder(holder)
		if err != nil || id.Kind != ichorv1.HolderOperation {
			continue
		}
		o, seen := h.last(id.Name)
		if o.NodeAction == string(ichorv1.NodeShutdown) || o.NodeAction == string(ichorv1.NodeReset) {
			continue // a machine shut down or reset stays cordoned: it left the cluster
		}
		if !seen || o.Gone || o.Settled() {
			out = append(out, Violation{At: h.Now, What: fmt.Sprintf("Node %s is left cordoned by %s, which is %s", node, holder, map[bool]string{true: "gone", false: "settled"}[!seen || o.Gone])})
		}
	}
	return out
}

func checkSucceeded(h *History) []Violation {
	if h.End == nil {
		return nil
	}
	var out []Violation
	for _, name := range h.End.Created {
		o, seen := h.last(name)
		if !seen || h.End.Deleted[name] || o.Phase == string(ichorv1.PhaseSucceeded) {
			continue
		}
		what := fmt.Sprintf("%s ended %s", name, orDash(o.Phase))
		for _, s := range []string{o.Reason, o.FailureReason} {
			if s != "" {
				what += " " + s
			}
		}
		what += ": " + o.Message
		for _, m := range o.Machines {
			if m.Phase == string(ichorv1.MachineInProgress) || m.Phase == string(ichorv1.MachineFailed) {
				what += fmt.Sprintf("; %s %s at %s (attempt %d): %s", m.Name, m.Phase, m.Step, m.Attempts, m.Message)
			}
		}
		out = append(out, Violation{At: h.Now, What: what})
	}
	return out
}

func firstSettled(h *History, op string) time.Time {
	for _, v := range h.Ops[op] {
		if v.Settled() {
			return v.Seen
		}
	}
	return h.Now
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func orNobody(holder string) string {
	if holder == "" {
		return "nobody"
	}
	return holder
}
