package chaos

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// Report sums up a campaign: its seed, what it did, and every violation
// with the events that led to it.
type Report struct {
	// Seed is the campaign's; run i runs with Seed+i.
	Seed   int64
	Params Params
	Runs   []Result
}

// Kills is the campaign's number of kills.
func (r Report) Kills() int { return r.sum(func(x Result) int { return x.Kills }) }

// Violations is the campaign's number of invariant violations.
func (r Report) Violations() int { return r.sum(func(x Result) int { return len(x.Violations) }) }

func (r Report) sum(f func(Result) int) int {
	n := 0
	for _, x := range r.Runs {
		n += f(x)
	}
	return n
}

// rerun is the command that runs the campaign (or one run of it) again.
func (r Report) rerun(seed int64, runs int) string {
	p := r.Params
	return fmt.Sprintf("make chaos SEED=%d RUNS=%d KILLS=%d FAULTS=%d ACTIONS=%d SPAN=%s", seed, runs, p.Kills, p.Faults, p.OperatorActions, p.Span)
}

// String prints the report: the figures, then each violation with the
// run's seed, how to rerun it, and its history.
func (r Report) String() string {
	var b strings.Builder
	row := func(name, format string, args ...any) {
		fmt.Fprintf(&b, "  %-21s %s\n", name, fmt.Sprintf(format, args...))
	}
	var took time.Duration
	for _, x := range r.Runs {
		took += x.Took
	}
	fmt.Fprintf(&b, "ichor chaos campaign, seed %d\n", r.Seed)
	row("runs", "%d (%s)", len(r.Runs), took.Round(time.Second))
	row("kills", "%d (%d in the gap between an irreversible call and its status write, %d at random; %d replicas lost their leader election by themselves)",
		r.Kills(), r.sum(func(x Result) int { return x.GapKills }), r.Kills()-r.sum(func(x Result) int { return x.GapKills }), r.sum(func(x Result) int { return x.Lost }))
	row("leader changes", "%d", r.sum(func(x Result) int { return x.LeaderChanges }))
	row("faults", "%d", r.sum(func(x Result) int { return x.Faults }))
	row("operator actions", "%d", r.sum(func(x Result) int { return x.OperatorActions }))
	row("operations", "%d (%d succeeded, %d deleted); %d Jobs took the lock, %d control planes joined",
		r.sum(func(x Result) int { return x.Operations }), r.sum(func(x Result) int { return x.Succeeded }),
		r.sum(func(x Result) int { return x.Deleted }), r.sum(func(x Result) int { return x.Jobs }), r.sum(func(x Result) int { return x.Joins }))
	row("invariant violations", "%d%s", r.Violations(), byInvariant(r.Runs))
	fmt.Fprintf(&b, "rerun: %s\n", r.rerun(r.Seed, len(r.Runs)))
	n := 0
	for _, x := range r.Runs {
		for i, v := range x.Violations {
			n++
			fmt.Fprintf(&b, "\nviolation %d [%s], run seed %d, at t+%.3fs:\n  %s\n", n, v.Invariant, x.Seed, v.At.Sub(x.Start).Seconds(), v.What)
			fmt.Fprintf(&b, "  rerun this run: %s\n  history:\n%s\n", r.rerun(x.Seed, 1), x.Histories[i])
		}
		if x.Rerun != nil {
			fmt.Fprintf(&b, "\nrun seed %d, rerun from its seed: %d violations%s\n", x.Seed, len(x.Rerun.Violations), byInvariant([]Result{*x.Rerun}))
			for _, v := range x.Rerun.Violations {
				fmt.Fprintf(&b, "  [%s] at t+%.3fs: %s\n", v.Invariant, v.At.Sub(x.Rerun.Start).Seconds(), v.What)
			}
		}
	}
	return b.String()
}

// byInvariant counts the violations of runs per invariant, as " (name n, ...)".
func byInvariant(runs []Result) string {
	count := map[string]int{}
	for _, x := range runs {
		for _, v := range x.Violations {
			count[v.Invariant]++
		}
	}
	if len(count) == 0 {
		return ""
	}
	names := make([]string, 0, len(count))
	for k := range count {
		names = append(names, k)
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, k := range names {
		parts[i] = fmt.Sprintf("%s %d", k, count[k])
	}
	return " (" + strings.Join(parts, ", ") + ")"
}
