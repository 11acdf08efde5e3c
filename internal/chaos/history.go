package chaos

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// History is what a run saw, the invariants' only input: the simulator's
// record (disruptive actions, the irreversible calls that reached a
// machine, the upgrades that took effect), every holder of the cluster
// lock, every version of every operation, and, once the run is over, how
// it ended.
type History struct {
	// Start is when the run began; times print relative to it.
	Start time.Time
	// Now is when the history was taken: actions still open end there.
	Now      time.Time
	Roles    map[string]sim.Role
	Actions  []sim.Action
	Calls    []sim.Call
	Upgrades []sim.Upgrade
	Lease    []LeaseChange
	// Unhealthy are the times control planes' etcd members were made
	// unhealthy (an etcd-unhealthy fault).
	Unhealthy []Interval
	// Ops holds each operation's versions in the order they were seen.
	Ops map[string][]OpState
	// JobsOver maps each Job that took the lock, once it completed or was
	// deleted (without releasing the lock, or after), to when it did.
	JobsOver map[string]time.Time
	// End is set once faults are cleared and failures retried.
	End *End
}

// Interval is a time a machine was in some state; To is zero while it lasts.
type Interval struct {
	Machine  string
	From, To time.Time
}

// LeaseChange is a change of the cluster lock's holder.
type LeaseChange struct {
	// At is when the holder changed: the acquire (or release) time its
	// writer recorded on the Lease when it is earlier than Seen, else Seen.
	// Whoever acts under the new holder acts after its write, so after At.
	At     time.Time
	Seen   time.Time
	Holder string
}

// OpState is one version of an operation, as the campaign saw it.
type OpState struct {
	Seen time.Time
	Name string
	// Kind is talos or node; NodeAction and Machine are the node action's,
	// Target the upgrade's version.
	Kind, NodeAction, Machine, Target string
	MaxUnavailable                    int
	Phase, Reason, FailureReason      string
	Message                           string
	Paused, Deleting, Gone            bool
	Machines                          []MachineState
}

// MachineState is one machine of an operation's status.
type MachineState struct {
	Name, Phase, Step, From, To, Message string
	Attempts                             int32
}

// Settled says the operation is over: it succeeded or was refused.
func (o OpState) Settled() bool {
	return o.Phase == string(ichorv1.PhaseSucceeded) || o.Phase == string(ichorv1.PhaseRefused)
}

// End is how a run ended.
type End struct {
	// Created are the operations the campaign created; Deleted those it deleted.
	Created []string
	Deleted map[string]bool
	// CordonedBy maps each Node that carries Ichor's cordon mark to the
	// identity in it.
	CordonedBy map[string]string
	// Holder holds the cluster lock at the end.
	Holder string
}

// holderAt is who held the cluster lock at t ("" for nobody).
func (h *History) holderAt(t time.Time) string {
	holder := ""
	for _, c := range h.Lease {
		if c.At.After(t) {
			break
		}
		holder = c.Holder
	}
	return holder
}

// at is an operation's version as last seen at or before t, and whether
// one was.
func (h *History) at(op string, t time.Time) (OpState, bool) {
	var st OpState
	seen := false
	for _, v := range h.Ops[op] {
		if v.Seen.After(t) {
			break
		}
		st, seen = v, true
	}
	return st, seen
}

// last is an operation's latest version, and whether it was seen at all.
func (h *History) last(op string) (OpState, bool) {
	vs := h.Ops[op]
	if len(vs) == 0 {
		return OpState{}, false
	}
	return vs[len(vs)-1], true
}

// opsOf are the operations a lock holder stands for: the operation it
// names, or, for a machine's identity, the resets of that machine.
func (h *History) opsOf(holder string) []string {
	id, err := ichorv1.ParseLockHolder(holder)
	if err != nil {
		return nil
	}
	switch id.Kind {
	case ichorv1.HolderOperation:
		if _, ok := h.Ops[id.Name]; ok {
			return []string{id.Name}
		}
	case ichorv1.HolderMachine:
		var out []string
		for _, name := range sortedKeys(h.Ops) {
			if o, _ := h.last(name); o.NodeAction == string(ichorv1.NodeReset) && o.Machine == id.Name {
				out = append(out, name)
			}
		}
		return out
	}
	return nil
}

// owns says whether holder works on machine: one of its operations has the
// machine in its status.
func (h *History) owns(holder, machine string) bool {
	for _, op := range h.opsOf(holder) {
		for _, v := range h.Ops[op] {
			for _, m := range v.Machines {
				if m.Name == machine {
					return true
				}
			}
		}
	}
	return false
}

// attempts is the highest attempt of machine in op's status.
func (h *History) attempts(op, machine string) int32 {
	var n int32
	for _, v := range h.Ops[op] {
		for _, m := range v.Machines {
			if m.Name == machine && m.Attempts > n {
				n = m.Attempts
			}
		}
	}
	return n
}

// rel prints t relative to the start of the run.
func (h *History) rel(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return fmt.Sprintf("t+%.3fs", t.Sub(h.Start).Seconds())
}

func (h *History) end(a sim.Action) time.Time {
	if a.End.IsZero() {
		return h.Now
	}
	return a.End
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// timeline is the run's event history: what the campaign did, and what it
// saw happen, in order. A violation prints it up to the violation.
type timeline struct {
	mu     sync.Mutex
	events []event
}

type event struct {
	At   time.Time
	What string
}

func (tl *timeline) add(at time.Time, format string, args ...any) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	what := strings.ReplaceAll(strings.TrimSpace(fmt.Sprintf(format, args...)), "\n", "; ")
	tl.events = append(tl.events, event{At: at, What: what})
}

// upTo prints the events up to t, with the simulator's actions merged in,
// at most max lines (the last ones).
func (tl *timeline) upTo(h *History, t time.Time, max int) string {
	tl.mu.Lock()
	evs := append([]event(nil), tl.events...)
	tl.mu.Unlock()
	for _, a := range h.Actions {
		evs = append(evs, event{At: a.Start, What: fmt.Sprintf("sim: %s %s starts", a.Machine, a.Kind)})
		if !a.Down.IsZero() {
			evs = append(evs, event{At: a.Down, What: fmt.Sprintf("sim: %s down (%s)", a.Machine, a.Kind)})
		}
		if !a.End.IsZero() {
			evs = append(evs, event{At: a.End, What: fmt.Sprintf("sim: %s %s ends, running again", a.Machine, a.Kind)})
		}
	}
	for _, c := range h.Calls {
		what := fmt.Sprintf("sim: %s accepts %s", c.Machine, c.Method)
		if !c.Accepted() {
			what = fmt.Sprintf("sim: %s answers %s with %v", c.Machine, c.Method, c.Err)
		}
		evs = append(evs, event{At: c.At, What: what})
	}
	for _, u := range h.Upgrades {
		evs = append(evs, event{At: u.At, What: fmt.Sprintf("sim: %s boots %s", u.Machine, u.Version)})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].At.Before(evs[j].At) })
	var lines []string
	for _, e := range evs {
		if e.At.After(t) {
			break
		}
		lines = append(lines, fmt.Sprintf("  %-11s %s", h.rel(e.At), e.What))
	}
	if len(lines) > max {
		lines = append([]string{fmt.Sprintf("  ... %d earlier events", len(lines)-max)}, lines[len(lines)-max:]...)
	}
	return strings.Join(lines, "\n")
}
