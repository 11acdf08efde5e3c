package chaos

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Kind names what a scheduled action does.
type Kind string

// The actions of a schedule.
const (
	// CreateUpgrade creates a Talos upgrade of the machines of Group.
	CreateUpgrade Kind = "create-upgrade"
	// CreateNodeOp creates a node operation (NodeAction on Machine).
	CreateNodeOp Kind = "create-node-op"
	// Kill kills the leading controller hard.
	Kill Kind = "kill"
	// Fault gives Machine the fault Fault (the sim's annotation syntax) for For.
	Fault Kind = "fault"
	// PowerOn presses the power button of Machine if it is off.
	PowerOn Kind = "power-on"
	// Join adds Machine, a control plane waiting to join, to the cluster.
	Join Kind = "join"
	// Job creates the Job Op that takes the cluster lock for For, then
	// ends as How says (release, complete, delete).
	Job Kind = "job"

	// Operator actions.
	Pause  Kind = "pause"
	Resume Kind = "resume"
	Retry  Kind = "retry"
	Delete Kind = "delete"
	// Hold puts the upgrade-hold annotation on Machine.
	Hold Kind = "hold"
	// Cordon cordons Machine as an operator does, for For.
	Cordon Kind = "cordon"
	// Rotate changes the talosconfig Secret as How says: relabel (a new
	// resourceVersion, the same data) or recertify (a new client certificate).
	Rotate Kind = "rotate"
)

// operator says whether k is an operator action (for the report).
func (k Kind) operator() bool {
	switch k {
	case Pause, Resume, Retry, Delete, Hold, Cordon, Rotate:
		return true
	}
	return false
}

// Action is one entry of a schedule: what to do, At this long after the
// run started. Fields beyond Kind are set only for the kinds that use them.
type Action struct {
	At   time.Duration
	Kind Kind
	// Op is the operation (or Job) created or acted on.
	Op      string
	Machine string
	// Group and MaxUnavailable, for CreateUpgrade.
	Group          string
	MaxUnavailable int
	// NodeAction (reboot, shutdown, reset), Graceful and Reboot (reset),
	// and NoDrain (spec.drain.disabled), for CreateNodeOp.
	NodeAction       string
	Graceful, Reboot bool
	NoDrain          bool
	Fault            string
	For              time.Duration
	How              string
}

// String is the action as the history prints it.
func (a Action) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s", a.Kind)
	field := func(k, v string) {
		if v != "" {
			fmt.Fprintf(&b, " %s=%s", k, v)
		}
	}
	field("op", a.Op)
	field("machine", a.Machine)
	field("group", a.Group)
	if a.MaxUnavailable > 0 {
		field("maxUnavailable", fmt.Sprint(a.MaxUnavailable))
	}
	field("action", a.NodeAction)
	if a.NodeAction == "reset" {
		field("graceful", fmt.Sprint(a.Graceful))
		field("reboot", fmt.Sprint(a.Reboot))
	}
	if a.NoDrain {
		field("drain", "disabled")
	}
	field("fault", a.Fault)
	if a.For > 0 {
		field("for", a.For.String())
	}
	field("how", a.How)
	return b.String()
}

// Fleet names the machines a schedule works on.
type Fleet struct {
	ControlPlanes, Workers []string
	// Joiner is a control plane that joins during the run ("" for none).
	Joiner string
	// Groups maps each group label value to its machines (for upgrades).
	Groups map[string][]string
}

// Params say how much a schedule does.
type Params struct {
	// Span is the time over which actions are spread.
	Span time.Duration
	// Kills at random moments (the gaps after irreversible calls come on top).
	Kills int
	// Faults injected.
	Faults int
	// OperatorActions at random (a pause comes with its resume).
	OperatorActions int
}

// faultsFor are the faults a machine can be given: what Talos does wrong
// in production (a call failing, a call hanging, a rollback, a machine not
// coming back, an unhealthy etcd member, a machine that does not answer).
func faultsFor(controlPlane bool) []string {
	fs := []string{
		"error:Reboot:once", "error:Upgrade:once", "error:Reset:once", "error:Shutdown:once",
		"hang:Reboot", "hang:Upgrade", "hang:Reset",
		"rollback:once", "no-return", "error:*:Unavailable",
	}
	if controlPlane {
		fs = append(fs, "etcd-unhealthy")
	}
	return fs
}

// Plan draws a schedule from seed: operations of both kinds created early
// (one or two upgrades of disjoint groups, one to three node actions, a
// control-plane reset among them now and then), then kills, faults, operator
// actions, a Job taking the lock and a control-plane join spread over the
// span. The same seed and inputs give the same schedule.
func Plan(seed int64, fleet Fleet, p Params) []Action {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x1c40_c4a0))
	at := func(from, to float64) time.Duration {
		return time.Duration((from + rng.Float64()*(to-from)) * float64(p.Span)).Round(time.Millisecond)
	}
	pick := func(xs []string) string { return xs[rng.IntN(len(xs))] }
	between := func(lo, hi time.Duration) time.Duration {
		return (lo + time.Duration(rng.Int64N(int64(hi-lo)))).Round(time.Millisecond)
	}
	var out []Action
	var ops []Action // creations, to act on

	groups := slices.Sorted(maps.Keys(fleet.Groups))
	n := 1 + rng.IntN(len(groups))
	for _, g := range groups[:n] {
		out = append(out, Action{At: at(0, 0.2), Kind: CreateUpgrade, Op: "upgrade-" + g, Group: g, MaxUnavailable: 1 + rng.IntN(3)})
	}
	all := append(append([]string(nil), fleet.ControlPlanes...), fleet.Workers...)
	for i := range 1 + rng.IntN(3) {
		a := Action{At: at(0, 0.5), Kind: CreateNodeOp}
		switch r := rng.IntN(10); {
		case r < 4:
			a.NodeAction, a.Machine = "reboot", pick(all)
		case r < 6:
			a.NodeAction, a.Machine, a.NoDrain = "shutdown", pick(fleet.Workers), rng.IntN(2) == 0
		default:
			a.NodeAction, a.Machine, a.Graceful, a.Reboot = "reset", pick(all), rng.IntN(3) > 0, rng.IntN(2) == 0
			if slices.Contains(fleet.ControlPlanes, a.Machine) {
				// A control plane comes back from its reset (it rejoins
				// etcd); one left off would leave etcd at two members.
				a.Graceful, a.Reboot = true, true
			}
			a.NoDrain = a.Graceful && rng.IntN(3) == 0
		}
		a.Op = fmt.Sprintf("%s-%d", a.NodeAction, i+1)
		out = append(out, a)
		if a.NodeAction == "shutdown" || (a.NodeAction == "reset" && !a.Reboot) {
			out = append(out, Action{At: a.At + between(2*time.Second, p.Span/2+2*time.Second), Kind: PowerOn, Machine: a.Machine})
		}
	}
	for _, a := range out {
		if a.Op != "" {
			ops = append(ops, a)
		}
	}
	opBefore := func(t time.Duration) string {
		var names []string
		for _, o := range ops {
			if o.At <= t {
				names = append(names, o.Op)
			}
		}
		if len(names) == 0 {
			return ops[0].Op // not created yet: the API says so, as it would to an operator
		}
		return pick(names)
	}

	for range p.Kills {
		out = append(out, Action{At: at(0.05, 1), Kind: Kill})
	}
	for range p.Faults {
		m := pick(all)
		out = append(out, Action{At: at(0, 1), Kind: Fault, Machine: m,
			Fault: pick(faultsFor(slices.Contains(fleet.ControlPlanes, m))), For: between(300*time.Millisecond, 4*time.Second)})
	}
	jobs := 0
	for range p.OperatorActions {
		t := at(0.05, 1)
		switch r := rng.IntN(20); {
		case r < 5:
			op := opBefore(t)
			out = append(out, Action{At: t, Kind: Pause, Op: op}, Action{At: t + between(300*time.Millisecond, 3*time.Second), Kind: Resume, Op: op})
		case r < 9:
			out = append(out, Action{At: t, Kind: Retry, Op: opBefore(t)})
		case r < 10:
			out = append(out, Action{At: t, Kind: Delete, Op: opBefore(t)})
		case r < 12:
			out = append(out, Action{At: t, Kind: Hold, Machine: pick(all)})
		case r < 15:
			out = append(out, Action{At: t, Kind: Cordon, Machine: pick(fleet.Workers), For: between(time.Second, 6*time.Second)})
		case r < 18:
			out = append(out, Action{At: t, Kind: Rotate, How: pick([]string{"relabel", "recertify"})})
		default:
			jobs++
			out = append(out, Action{At: t, Kind: Job, Op: fmt.Sprintf("job-%d", jobs), For: between(200*time.Millisecond, 2*time.Second),
				How: pick([]string{"release", "complete", "delete"})})
		}
	}
	if fleet.Joiner != "" && rng.IntN(4) > 0 {
		out = append(out, Action{At: at(0.1, 0.8), Kind: Join, Machine: fleet.Joiner})
	}
	slices.SortStableFunc(out, func(a, b Action) int { return cmp.Compare(a.At, b.At) })
	return out
}
