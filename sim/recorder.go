package sim

import (
	"sort"
	"strings"
	"sync"
	"time"
)

// ActionKind names a disruptive action a machine performs.
type ActionKind string

// Disruptive actions the recorder keeps time ranges of.
const (
	// ActionReboot is a reboot: from the request to Running again. Reboots
	// that an ApplyConfiguration or a staged upgrade start count too.
	ActionReboot ActionKind = "reboot"
	// ActionUpgrade is a legacy MachineService.Upgrade sequence: drain,
	// install and reboot, up to Running again.
	ActionUpgrade ActionKind = "upgrade"
	// ActionInstall is a LifecycleService.Upgrade install (no reboot).
	ActionInstall ActionKind = "install"
	// ActionShutdown lasts from the request until the machine is powered on
	// and Running again (open while it is off).
	ActionShutdown ActionKind = "shutdown"
	// ActionReset lasts until the machine is Running again (open while off).
	ActionReset ActionKind = "reset"
)

// Action is one disruptive action's time range. End is zero while it lasts.
type Action struct {
	Machine string
	Kind    ActionKind
	Start   time.Time
	End     time.Time
	// Down is when the machine stopped answering during the action. A
	// shutdown's or a reset's work is done there: what follows (off, or
	// coming back) is the machine's new state, not the action in flight,
	// though it stays out of service until End.
	Down time.Time
}

func (a Action) end() time.Time {
	if a.End.IsZero() {
		return time.Now()
	}
	return a.End
}

// Overlap is a pair of actions on two machines whose time ranges intersect.
type Overlap struct{ A, B Action }

// Call is one call that reached a machine's handler: routed to a machine
// that was up, past the role check and the error and hang faults.
type Call struct {
	Machine string
	// Method is "Service/Method", e.g. "MachineService/Reboot".
	Method string
	// At is when it reached the handler.
	At time.Time
	// Err is what the handler answered: nil when the machine accepted the
	// call (a Reboot, Reset or Upgrade whose sequence started), else why
	// not, its caller gone before it was done among the reasons.
	Err error
}

// Accepted says the machine accepted the call.
func (c Call) Accepted() bool { return c.Err == nil }

// Upgrade is an install that took effect at a boot: the machine came up on
// Version.
type Upgrade struct {
	Machine string
	Version string
	At      time.Time
}

// Recorder keeps what happened in a fleet for tests to assert invariants
// on. It is safe for concurrent use.
type Recorder struct {
	mu      sync.Mutex
	calls   map[string]map[string]int // machine -> "Service/Method" -> n
	handled []Call
	actions []Action
	applied map[string]int
	boots   []Upgrade
	down    map[string]Role
	maxDown map[Role]int
}

func newRecorder() *Recorder {
	return &Recorder{
		calls:   map[string]map[string]int{},
		applied: map[string]int{},
		down:    map[string]Role{},
		maxDown: map[Role]int{},
	}
}

// call counts one RPC routed to a machine; fullMethod is "/pkg.Service/Method".
func (r *Recorder) call(machine, fullMethod string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.calls[machine]
	if m == nil {
		m = map[string]int{}
		r.calls[machine] = m
	}
	m[shortMethod(fullMethod)]++
}

// Calls is the number of calls of method routed to machine, whatever their
// outcome. method is matched as faults match it: "Reboot" (any service),
// "LifecycleService/Upgrade", or "*" for every method. An empty machine
// counts every machine.
func (r *Recorder) Calls(machine, method string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for name, byMethod := range r.calls {
		if machine != "" && name != machine {
			continue
		}
		for m, c := range byMethod {
			if methodMatches(method, "/"+m) {
				n += c
			}
		}
	}
	return n
}

// CallCounts returns a copy of every machine's per-method call counts, keyed
// by machine name and then "Service/Method" (e.g. "MachineService/Reboot").
func (r *Recorder) CallCounts() map[string]map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]map[string]int, len(r.calls))
	for name, byMethod := range r.calls {
		c := make(map[string]int, len(byMethod))
		for m, n := range byMethod {
			c[m] = n
		}
		out[name] = c
	}
	return out
}

// handle records a call that reached machine's handler at at, and its answer.
func (r *Recorder) handle(machine, fullMethod string, at time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.handled = append(r.handled, Call{Machine: machine, Method: shortMethod(fullMethod), At: at, Err: err})
}

// Handled returns the calls of method (matched as Calls matches it) that
// reached machine's handler (every machine's when machine is empty), in the
// order they were answered, with when they arrived and what they answered:
// what a test compares with the steps that should have sent them.
func (r *Recorder) Handled(machine, method string) []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Call
	for _, c := range r.handled {
		if (machine == "" || c.Machine == machine) && methodMatches(method, "/"+c.Method) {
			out = append(out, c)
		}
	}
	return out
}

func (r *Recorder) start(machine string, kind ActionKind) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.actions = append(r.actions, Action{Machine: machine, Kind: kind, Start: time.Now()})
	return len(r.actions) - 1
}

// wentDown marks the open actions of a machine that stopped answering.
func (r *Recorder) wentDown(open []int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	for _, i := range open {
		if i >= 0 && i < len(r.actions) && r.actions[i].Down.IsZero() {
			r.actions[i].Down = now
		}
	}
}

func (r *Recorder) finish(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i >= 0 && i < len(r.actions) && r.actions[i].End.IsZero() {
		r.actions[i].End = time.Now()
	}
}

// Actions returns machine's actions (every machine's when machine is
// empty), in the order they started.
func (r *Recorder) Actions(machine string) []Action {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Action
	for _, a := range r.actions {
		if machine == "" || a.Machine == machine {
			out = append(out, a)
		}
	}
	return out
}

// Overlaps returns every pair of actions of the given kinds (all kinds when
// none are given) on different machines whose time ranges intersect. A
// controller that never runs two disruptive actions at once leaves it empty.
func (r *Recorder) Overlaps(kinds ...ActionKind) []Overlap {
	want := func(k ActionKind) bool {
		if len(kinds) == 0 {
			return true
		}
		for _, w := range kinds {
			if w == k {
				return true
			}
		}
		return false
	}
	acts := r.Actions("")
	var sel []Action
	for _, a := range acts {
		if want(a.Kind) {
			sel = append(sel, a)
		}
	}
	sort.Slice(sel, func(i, j int) bool { return sel[i].Start.Before(sel[j].Start) })
	var out []Overlap
	for i := range sel {
		for j := i + 1; j < len(sel) && sel[j].Start.Before(sel[i].end()); j++ {
			if sel[i].Machine != sel[j].Machine {
				out = append(out, Overlap{A: sel[i], B: sel[j]})
			}
		}
	}
	return out
}

// upgradeApplied counts an install that took effect at a boot.
func (r *Recorder) upgradeApplied(machine, version string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applied[machine]++
	r.boots = append(r.boots, Upgrade{Machine: machine, Version: version, At: time.Now()})
}

// Upgrades returns the installs that took effect on machine (every
// machine's when empty), in order, with the version each booted.
func (r *Recorder) Upgrades(machine string) []Upgrade {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Upgrade
	for _, u := range r.boots {
		if machine == "" || u.Machine == machine {
			out = append(out, u)
		}
	}
	return out
}

// UpgradesApplied is how many installs took effect on machine (the boot
// after an install came up on the new version; rollbacks do not count).
func (r *Recorder) UpgradesApplied(machine string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.applied[machine]
}

// setDown marks a machine out of service (from the start of a disruptive
// sequence until it is Running again, or while it is off) or back.
func (r *Recorder) setDown(machine string, role Role, down bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if down {
		r.down[machine] = role
	} else {
		delete(r.down, machine)
	}
	n := 0
	for _, rl := range r.down {
		if rl == role {
			n++
		}
	}
	if n > r.maxDown[role] {
		r.maxDown[role] = n
	}
}

// MaxDown is the largest number of control planes, and of workers, that
// were out of service at once. A machine is out of service from the start
// of a disruptive sequence (reboot, legacy upgrade, shutdown, reset) until
// it is Running again.
func (r *Recorder) MaxDown() (controlPlanes, workers int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.maxDown[ControlPlane], r.maxDown[Worker]
}

// Reset forgets calls, actions, applied upgrades and maxima (machines that
// are down now stay counted as down).
func (r *Recorder) Reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = map[string]map[string]int{}
	r.handled = nil
	r.actions = nil
	r.applied = map[string]int{}
	r.boots = nil
	r.maxDown = map[Role]int{}
	for _, role := range r.down {
		r.maxDown[role]++
	}
}

// shortMethod turns "/machine.MachineService/Reboot" into "MachineService/Reboot".
func shortMethod(fullMethod string) string {
	s := strings.TrimPrefix(fullMethod, "/")
	svc, method, ok := strings.Cut(s, "/")
	if !ok {
		return s
	}
	if i := strings.LastIndexByte(svc, '.'); i >= 0 {
		svc = svc[i+1:]
	}
	return svc + "/" + method
}

// methodMatches reports whether pattern names fullMethod: "*", a bare method
// name ("Upgrade": any service), or "Service/Method".
func methodMatches(pattern, fullMethod string) bool {
	if pattern == "*" {
		return true
	}
	short := shortMethod(fullMethod)
	if strings.Contains(pattern, "/") {
		return strings.EqualFold(pattern, short)
	}
	_, method, _ := strings.Cut(short, "/")
	return strings.EqualFold(pattern, method)
}
