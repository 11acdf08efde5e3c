package chaos

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// world builds histories for the invariant tests: three control planes,
// three workers, and times in milliseconds after the start.
type world struct{ h *History }

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func ms(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }

func newWorld() *world {
	return &world{h: &History{Start: t0, Now: ms(100_000), Ops: map[string][]OpState{}, Roles: map[string]sim.Role{
		"cp-1": sim.ControlPlane, "cp-2": sim.ControlPlane, "cp-3": sim.ControlPlane,
		"w-1": sim.Worker, "w-2": sim.Worker, "w-3": sim.Worker,
	}}}
}

func opID(name string) string { return ichorv1.OperationIdentity("ops", name) }

// upgrade adds an upgrade of machines, seen at 0 (running) and, when end
// is not zero, at end (Succeeded, each machine from v1.12.4).
func (w *world) upgrade(name string, maxUnavailable int, end int, machines ...string) *world {
	var mss []MachineState
	for _, m := range machines {
		mss = append(mss, MachineState{Name: m, Phase: "InProgress", Attempts: 1, From: "v1.12.4", To: "v1.13.7"})
	}
	w.h.Ops[name] = append(w.h.Ops[name], OpState{Seen: ms(0), Name: name, Kind: "talos", Target: "v1.13.7", MaxUnavailable: maxUnavailable, Phase: "Running", Machines: mss})
	if end > 0 {
		done := slices.Clone(mss)
		for i := range done {
			done[i].Phase = "Succeeded"
		}
		w.h.Ops[name] = append(w.h.Ops[name], OpState{Seen: ms(end), Name: name, Kind: "talos", Target: "v1.13.7", MaxUnavailable: maxUnavailable, Phase: "Succeeded", Machines: done})
	}
	return w
}

// node adds a node action, Succeeded at end (Running if end is zero).
func (w *world) node(name, action, machine string, end int) *world {
	st := OpState{Seen: ms(0), Name: name, Kind: "node", NodeAction: action, Machine: machine, MaxUnavailable: 1, Phase: "Running",
		Machines: []MachineState{{Name: machine, Phase: "InProgress", Attempts: 1}}}
	w.h.Ops[name] = append(w.h.Ops[name], st)
	if end > 0 {
		st.Seen, st.Phase = ms(end), "Succeeded"
		st.Machines = []MachineState{{Name: machine, Phase: "Succeeded", Attempts: 1}}
		w.h.Ops[name] = append(w.h.Ops[name], st)
	}
	return w
}

func (w *world) lock(at int, holder string) *world {
	w.h.Lease = append(w.h.Lease, LeaseChange{At: ms(at), Seen: ms(at), Holder: holder})
	return w
}

// act adds a disruptive action from..to (to 0: still going); down is when
// the machine went down (0: never, or at to for a reset or shutdown).
func (w *world) act(machine string, kind sim.ActionKind, from, to int) *world {
	a := sim.Action{Machine: machine, Kind: kind, Start: ms(from)}
	if to > 0 {
		a.End = ms(to)
	}
	w.h.Actions = append(w.h.Actions, a)
	return w
}

func (w *world) downAt(n int) *world {
	w.h.Actions[len(w.h.Actions)-1].Down = ms(n)
	return w
}

func (w *world) call(machine, method string, at int) *world {
	w.h.Calls = append(w.h.Calls, sim.Call{Machine: machine, Method: method, At: ms(at)})
	return w
}

func (w *world) booted(machine, version string, at int) *world {
	w.h.Upgrades = append(w.h.Upgrades, sim.Upgrade{Machine: machine, Version: version, At: ms(at)})
	return w
}

func (w *world) ended(holder string, deleted ...string) *world {
	w.h.End = &End{Created: sortedKeys(w.h.Ops), Deleted: map[string]bool{}, CordonedBy: map[string]string{}, Holder: holder}
	for _, d := range deleted {
		w.h.End.Deleted[d] = true
	}
	return w
}

func (w *world) gone(name string, at int) *world {
	last := w.h.Ops[name][len(w.h.Ops[name])-1]
	last.Seen, last.Gone = ms(at), true
	w.h.Ops[name] = append(w.h.Ops[name], last)
	return w
}

// clean is a history in which everything went right: an upgrade of two
// workers one at a time, then a reboot of cp-1 waiting for the lock.
func clean() *world {
	w := newWorld().
		upgrade("up", 1, 3000, "w-1", "w-2").
		node("reboot", "reboot", "cp-1", 5000).
		lock(10, opID("up")).
		call("w-1", "MachineService/Reboot", 500).act("w-1", sim.ActionReboot, 500, 1000).booted("w-1", "v1.13.7", 1000).
		call("w-2", "MachineService/Reboot", 1500).act("w-2", sim.ActionReboot, 1500, 2000).booted("w-2", "v1.13.7", 2000).
		lock(3001, "").
		lock(3002, opID("reboot")).
		call("cp-1", "MachineService/Reboot", 3500).act("cp-1", sim.ActionReboot, 3500, 4000).
		lock(5001, "")
	return w.ended("")
}

// TestInvariants: each invariant catches the history that breaks it, and
// a history in which everything went right breaks none.
func TestInvariants(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    *History
		want []string // invariants broken
		says string   // part of the first violation's text
	}{
		{"everything right", clean().h, nil, ""},
		{
			// The item 2: the holder failed, the lock went on while
			// its other worker was still rebooting.
			"two holders' disruptions overlap",
			newWorld().upgrade("a", 2, 0, "w-1", "w-2").upgrade("b", 2, 0, "w-3").
				lock(0, opID("a")).act("w-1", sim.ActionReboot, 100, 900).
				lock(200, opID("b")).act("w-3", sim.ActionReboot, 300, 800).h,
			[]string{"holders"}, "under " + opID("a") + " and w-3's reboot",
		},
		{
			"two control planes at once",
			newWorld().upgrade("a", 1, 0, "cp-1", "cp-2").lock(0, opID("a")).
				act("cp-1", sim.ActionReboot, 100, 500).act("cp-2", sim.ActionUpgrade, 400, 0).h,
			[]string{"control-planes"}, "two control planes",
		},
		{
			// Item 9: etcd health checked before a drain, not right before the reboot.
			"a control plane disrupted while another's etcd member is unhealthy",
			func() *History {
				w := newWorld().upgrade("a", 1, 0, "cp-1").lock(0, opID("a")).act("cp-1", sim.ActionReboot, 3000, 3500)
				w.h.Unhealthy = []Interval{{Machine: "cp-2", From: ms(1000), To: ms(5000)}, {Machine: "cp-3", From: ms(2900)}}
				return w.h
			}(),
			[]string{"control-planes"}, "cp-2's etcd member was unhealthy (since t+1.000s)",
		},
		{
			// Item 7: an operator's cordon counted as "already down" lets a
			// second worker go down under maxUnavailable 1.
			"more workers down than maxUnavailable",
			newWorld().upgrade("a", 1, 0, "w-1", "w-2").lock(0, opID("a")).
				act("w-1", sim.ActionReboot, 100, 500).act("w-2", sim.ActionReboot, 200, 600).h,
			[]string{"worker-budget"}, "2 workers out of service (w-1, w-2)",
		},
		{
			"a disruption without the lock",
			newWorld().upgrade("a", 1, 0, "w-1").act("w-1", sim.ActionReboot, 100, 500).h,
			[]string{"holders"}, "nobody held",
		},
		{
			// Item 1: the membership identity freed in mid-reset; a Job, say,
			// holds the lock while a machine goes down.
			"a disruption under a holder that does not work on the machine",
			newWorld().upgrade("a", 1, 0, "w-1").lock(0, ichorv1.JobIdentity("ops", "cilium")).act("w-1", sim.ActionReboot, 100, 500).h,
			[]string{"holders"}, "does not work on w-1",
		},
		{
			// Item 10: killed between the Reset and its status write, the
			// next leaders sent it again: one violation, with the count.
			"a reset sent twice in one attempt",
			newWorld().node("reset", "reset", "w-1", 3000).lock(0, opID("reset")).
				call("w-1", "MachineService/Reset", 100).act("w-1", sim.ActionReset, 100, 2000).downAt(150).
				call("w-1", "MachineService/Reset", 2500).call("w-1", "MachineService/Reset", 2700).lock(3001, "").h,
			[]string{"at-most-once"}, "w-1 accepted MachineService/Reset 3 times under " + opID("reset") + ", which ran it in 1 attempt(s)",
		},
		{
			// A call cut off before the machine acted (the controller was
			// killed mid-call) may be sent again: only accepted ones count.
			"a legacy upgrade sent again after the first did not take",
			func() *History {
				w := newWorld().upgrade("a", 1, 3000, "w-1").lock(0, opID("a")).
					call("w-1", "MachineService/Upgrade", 100).call("w-1", "MachineService/Upgrade", 200).
					act("w-1", sim.ActionUpgrade, 200, 500).booted("w-1", "v1.13.7", 500).lock(3001, "")
				w.h.Calls[0].Err = errors.New("rpc error: code = Canceled desc = context canceled")
				return w.h
			}(),
			nil, "",
		},
		{
			// Item 11: an unreachable machine's reset "succeeded".
			"a reset done without a Reset",
			newWorld().node("reset", "reset", "w-1", 3000).lock(0, opID("reset")).lock(3001, "").ended("").h,
			[]string{"evidence"}, "w-1 accepted no MachineService/Reset",
		},
		{
			"an upgrade installed twice",
			newWorld().upgrade("a", 1, 3000, "w-1").lock(0, opID("a")).
				act("w-1", sim.ActionReboot, 100, 500).booted("w-1", "v1.13.7", 500).
				act("w-1", sim.ActionReboot, 600, 900).booted("w-1", "v1.13.7", 900).lock(3001, "").h,
			[]string{"installed-once"}, "booted v1.13.7 2 times",
		},
		{
			"an upgrade that succeeded without installing",
			newWorld().upgrade("a", 1, 3000, "w-1").lock(0, opID("a")).lock(3001, "").h,
			[]string{"installed-once"}, "0 times",
		},
		{
			// Item 4: a stale cache takes the lock for an operation that has finished.
			"the lock taken by a settled operation",
			newWorld().node("r", "reboot", "w-1", 1000).lock(0, opID("r")).call("w-1", "MachineService/Reboot", 100).
				act("w-1", sim.ActionReboot, 100, 500).lock(1001, "").lock(1500, opID("r")).h,
			[]string{"stale-holder", "stale-holder"}, "though it was settled",
		},
		{
			// Item 13: deleted mid-reboot, the operation's lock outlives it.
			"the lock held by a deleted operation",
			newWorld().node("r", "reboot", "w-1", 0).lock(0, opID("r")).call("w-1", "MachineService/Reboot", 100).
				act("w-1", sim.ActionReboot, 100, 500).gone("r", 300).ended(opID("r"), "r").h,
			[]string{"stale-holder", "stale-holder"}, "still held the cluster lock",
		},
		{
			// Item 6 and the lock's takeover: a Job deleted without
			// releasing the lock keeps it while an operation waits.
			"the lock held by a finished Job while an operation waits",
			func() *History {
				w := newWorld().node("r", "reboot", "w-1", 0).lock(0, ichorv1.JobIdentity("ops", "cilium"))
				w.h.Ops["r"][0].Phase, w.h.Ops["r"][0].Reason = "Paused", ichorv1.ReasonClusterLockHeld
				w.h.JobsOver = map[string]time.Time{"cilium": ms(1000)}
				return w.h
			}(),
			[]string{"stale-holder"}, "after the Job was over, while r waited",
		},
		{
			"the lock kept by a finished Job that nobody waits for",
			func() *History {
				w := newWorld().lock(0, ichorv1.JobIdentity("ops", "cilium"))
				w.h.JobsOver = map[string]time.Time{"cilium": ms(1000)}
				return w.h
			}(),
			nil, "",
		},
		{
			"the lock taken by a finished Job",
			func() *History {
				w := newWorld().lock(0, ichorv1.JobIdentity("ops", "cilium")).lock(500, "").lock(2000, ichorv1.JobIdentity("ops", "cilium"))
				w.h.JobsOver = map[string]time.Time{"cilium": ms(1000)}
				return w.h
			}(),
			[]string{"stale-holder"}, "though the Job was over at t+1.000s",
		},
		{
			"an operation left unfinished",
			newWorld().upgrade("a", 1, 0, "w-1").lock(0, opID("a")).ended(opID("a")).h,
			[]string{"succeeded"}, "a ended Running",
		},
		{
			"an operation deleted but still there",
			newWorld().node("r", "reboot", "w-1", 0).ended("", "r").h,
			[]string{"lost"}, "was deleted but is still there",
		},
		{
			// Item 13: the Node stays cordoned by an operation that no longer exists.
			"a Node left cordoned by a deleted operation",
			func() *History {
				w := newWorld().node("r", "reboot", "w-1", 0).gone("r", 300).ended("", "r")
				w.h.End.CordonedBy["w-1"] = opID("r")
				return w.h
			}(),
			[]string{"lost"}, "left cordoned by " + opID("r") + ", which is gone",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vs := Check(tc.h)
			var got []string
			for _, v := range vs {
				got = append(got, v.Invariant)
			}
			slices.Sort(got)
			want := slices.Clone(tc.want)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("broken %v, want %v: %+v", got, want, vs)
			}
			if tc.says != "" && !strings.Contains(vs[0].What, tc.says) {
				t.Errorf("first violation %q does not say %q", vs[0].What, tc.says)
			}
		})
	}
}

// TestHolderAt: the holder at a time is the last change at or before it.
func TestHolderAt(t *testing.T) {
	h := newWorld().lock(10, "a").lock(20, "").lock(30, "b").h
	for at, want := range map[int]string{0: "", 10: "a", 15: "a", 20: "", 29: "", 30: "b", 1000: "b"} {
		if got := h.holderAt(ms(at)); got != want {
			t.Errorf("holder at %d = %q, want %q", at, got, want)
		}
	}
}

// TestViolationKey: a violation keeps its key while the history grows (the
// action it names ends), so a run reports it once, with its fuller text.
func TestViolationKey(t *testing.T) {
	w := newWorld().upgrade("a", 1, 0, "w-1").act("w-1", sim.ActionReboot, 100, 0)
	w.h.Now = ms(200)
	before := Check(w.h)
	w.h.Actions[0].End, w.h.Now = ms(500), ms(600)
	after := Check(w.h)
	if len(before) != 1 || len(after) != 1 {
		t.Fatalf("violations %+v then %+v", before, after)
	}
	if before[0].What == after[0].What || before[0].key() != after[0].key() {
		t.Errorf("%q (%q) then %q (%q): want one key, a fuller text", before[0].What, before[0].key(), after[0].What, after[0].key())
	}
}
