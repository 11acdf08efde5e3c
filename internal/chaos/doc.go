// Package chaos is Ichor's fault campaign (make chaos): randomized, seeded
// runs of the real controller against the real API server (testenv) and a
// simulated fleet (sim), checked against the promises the controller keeps
// under every interleaving.
//
// A run starts a fleet and two ichor-controller replicas with leader
// election, draws a schedule from its seed (Plan: operations of both
// kinds, kills, Talos faults, operator actions, a Job taking the lock, a
// control-plane join), carries it out (run.go), then clears the faults and
// retries what failed until every operation has succeeded. The leader is
// also killed in every gap between an irreversible call and its status
// write (the operation runner's TestHookAfterRun). Kills are hard: every
// connection of a replica goes through a testcluster.Switch cut at once.
//
// What the run saw becomes a History: the simulator's record of
// disruptions, accepted calls and upgrades, every holder of the cluster
// lock and every version of every operation (observe.go). The Invariants
// judge it, continuously while the run goes and once at its end; a Report
// prints the figures and each violation with its run's seed, the command
// that reruns it and the events that led to it.
package chaos
