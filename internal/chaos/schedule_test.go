package chaos

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to write it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs (run with -update to accept):\n%s", path, got)
	}
}

var testParams = Params{Span: 10 * time.Second, Kills: 3, Faults: 6, OperatorActions: 8}

// TestPlanGolden: the schedule of seed 1 on the campaign's fleet, as one
// reviewable file.
func TestPlanGolden(t *testing.T) {
	fleet := Layout(1, Spec())
	var b strings.Builder
	fmt.Fprintf(&b, "groups: a=%v b=%v, joiner %s\n", fleet.Groups["a"], fleet.Groups["b"], fleet.Joiner)
	for _, a := range Plan(1, fleet, testParams) {
		fmt.Fprintf(&b, "%8s  %s\n", a.At.Round(time.Millisecond), a)
	}
	golden(t, "schedule-seed-1.golden", b.String())
}

// TestPlan: a seed always draws the same schedule and another seed
// another; over a few seeds every kind of action appears, in time order,
// each acting on operations the schedule creates (maybe later: the API
// then says it is not there, as it would to an operator), a control plane
// reset only with a reboot, a machine left off powered on again, each
// upgrade group with a control plane.
func TestPlan(t *testing.T) {
	fleet := Layout(7, Spec())
	if !reflect.DeepEqual(Plan(7, fleet, testParams), Plan(7, fleet, testParams)) {
		t.Fatal("one seed drew two schedules")
	}
	if reflect.DeepEqual(Plan(7, fleet, testParams), Plan(8, fleet, testParams)) {
		t.Fatal("two seeds drew one schedule")
	}
	kinds := map[Kind]int{}
	for seed := int64(1); seed <= 40; seed++ {
		fleet := Layout(seed, Spec())
		plan := Plan(seed, fleet, testParams)
		created := map[string]bool{}
		for _, a := range plan {
			if a.Kind == CreateUpgrade || a.Kind == CreateNodeOp {
				created[a.Op] = true
			}
		}
		for i, a := range plan {
			kinds[a.Kind]++
			if i > 0 && a.At < plan[i-1].At {
				t.Fatalf("seed %d: %s before %s", seed, a, plan[i-1])
			}
			if a.At < 0 || a.At > testParams.Span*2 {
				t.Errorf("seed %d: %s outside the span", seed, a)
			}
			switch a.Kind {
			case CreateNodeOp:
				if slices.Contains(fleet.ControlPlanes, a.Machine) && a.NodeAction == "reset" && (!a.Reboot || !a.Graceful) {
					t.Errorf("seed %d: %s leaves a control plane off or in etcd", seed, a)
				}
			case Pause, Resume, Retry, Delete:
				if !created[a.Op] {
					t.Errorf("seed %d: %s acts on an operation the schedule never creates", seed, a)
				}
			case Fault:
				if a.For <= 0 || a.Fault == "" {
					t.Errorf("seed %d: %s", seed, a)
				}
			}
			if a.Kind == CreateNodeOp && (a.NodeAction == "shutdown" || (a.NodeAction == "reset" && !a.Reboot)) &&
				!slices.ContainsFunc(plan[i:], func(b Action) bool { return b.Kind == PowerOn && b.Machine == a.Machine }) {
				t.Errorf("seed %d: %s leaves %s off for good", seed, a, a.Machine)
			}
		}
		for g, ms := range fleet.Groups {
			if !slices.ContainsFunc(ms, func(m string) bool { return slices.Contains(fleet.ControlPlanes, m) }) {
				t.Errorf("seed %d: group %s has no control plane: %v", seed, g, ms)
			}
		}
	}
	for _, k := range []Kind{CreateUpgrade, CreateNodeOp, Kill, Fault, PowerOn, Join, Job, Pause, Resume, Retry, Delete, Hold, Cordon, Rotate} {
		if kinds[k] == 0 {
			t.Errorf("no %s in 40 schedules", k)
		}
	}
}

// TestShortMethod: the gap kills name calls as the simulator's recorder does.
func TestShortMethod(t *testing.T) {
	for full, want := range map[string]string{
		"/machine.MachineService/Reboot":    "MachineService/Reboot",
		"/machine.LifecycleService/Upgrade": "LifecycleService/Upgrade",
	} {
		if got := shortMethod(full); got != want || !slices.Contains(append(irreversible, "LifecycleService/Upgrade"), got) {
			t.Errorf("shortMethod(%q) = %q, want %q", full, got, want)
		}
	}
}
