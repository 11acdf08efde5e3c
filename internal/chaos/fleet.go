package chaos

import (
	"math/rand/v2"
	"time"

	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/sim"
)

// target is the version every upgrade of a run moves to.
const target = "v1.13.7"

// irreversibleSteps are the steps whose Talos call cannot be taken back.
var irreversibleSteps = []string{executor.StepInstall, executor.StepReboot, executor.StepReset, executor.StepShutdown}

// groupLabel on a Node names the upgrade group it belongs to.
const groupLabel = "chaos.ichor.maesh.dev/group"

// Spec is the fleet of every run: three control planes and four workers,
// half on Talos 1.12 (the legacy upgrade, which reboots by itself) and
// half on 1.13 (install, then reboot), and a fourth control plane that
// joins during the run. Durations are short but long enough to overlap; a
// drain waits a second for the workload's pod to go.
func Spec() sim.Spec {
	spec := sim.Cluster("chaos", 4, 4)
	for i := range spec.Machines {
		if i%2 == 1 {
			spec.Machines[i].Talos = "v1.13.2"
		}
	}
	joiner := &spec.Machines[3]
	joiner.Joins, joiner.Talos = true, target
	spec.Durations = sim.Durations{
		Stop: 30 * time.Millisecond, Reboot: 200 * time.Millisecond, Install: 30 * time.Millisecond,
		ImagePull: 10 * time.Millisecond, PodGrace: time.Second, NodeReady: 500 * time.Millisecond,
		DrainTimeout: 5 * time.Second,
	}
	return spec
}

// Layout is the fleet a schedule sees: the machines of Spec, split at
// random (from seed) into upgrade groups a and b, each with a control plane.
func Layout(seed int64, spec sim.Spec) Fleet {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x9a0b))
	f := Fleet{Groups: map[string][]string{}}
	for _, m := range spec.Machines {
		switch {
		case m.Joins:
			f.Joiner = m.Name
			continue
		case m.Role == sim.ControlPlane:
			f.ControlPlanes = append(f.ControlPlanes, m.Name)
		default:
			f.Workers = append(f.Workers, m.Name)
		}
	}
	for i, m := range append(append([]string(nil), f.ControlPlanes...), f.Workers...) {
		g := []string{"a", "b"}[rng.IntN(2)]
		if i < 2 {
			g = []string{"a", "b"}[i] // each group has a control plane
		}
		f.Groups[g] = append(f.Groups[g], m)
	}
	return f
}
