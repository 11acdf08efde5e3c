package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"maesh.dev/ichor/internal/controlplane"
)

// Components says which of a working cluster's components a package of
// tests runs beside the API server. A package pays only for what it asks
// for: none of them by default.
type Components struct {
	// ControllerManager runs kube-controller-manager with the controllers
	// that make and remove pods, compute PodDisruptionBudgets, collect
	// garbage, finish namespaces and give ServiceAccounts tokens
	// (controlplane.Controllers).
	ControllerManager bool
	// Scheduler runs kube-scheduler, which binds pods to Nodes.
	Scheduler bool
	// NodeLifecycle adds the node-lifecycle and taint-eviction controllers
	// (NodeGracePeriod). Every Node must then renew its lease:
	// testcluster.StartFleet gives fleets NodeLease.
	NodeLifecycle bool
}

// Node heartbeats in tests: a fleet's machines renew their Node Leases
// every NodeLease/4 while up, and the node-lifecycle controller marks a
// Node whose lease is NodeGracePeriod old Unknown. Seconds, not the 40s and
// 50s of a real cluster, so that a test of a machine that stays down ends
// soon; with room for a loaded machine not to miss a renewal.
const (
	NodeLease       = 4 * time.Second
	NodeGracePeriod = 10 * time.Second
)

// With is a setup for Main that starts c.
func With(c Components) func(*Env) error {
	return func(e *Env) error { return e.StartComponents(c) }
}

// StartComponents starts the components c asks for; they stop with the Env.
func (e *Env) StartComponents(c Components) error {
	if e.env == nil {
		return errAttachedComponents
	}
	if c.NodeLifecycle && !c.ControllerManager {
		return fmt.Errorf("NodeLifecycle runs in the controller manager: set ControllerManager too")
	}
	e.components = c
	if c.ControllerManager {
		if err := e.startControllerManager(); err != nil {
			return err
		}
	}
	if c.Scheduler {
		p, err := controlplane.StartScheduler(context.Background(), e.componentOptions("kube-scheduler"))
		if err != nil {
			return err
		}
		e.stops = append(e.stops, e.stopper(p, "kube-scheduler"))
	}
	return nil
}

// NodeLifecycle reports whether the node-lifecycle controller runs, so that
// every Node must renew its lease.
func (e *Env) NodeLifecycle() bool { return e.components.NodeLifecycle && e.kcm != nil }

// SetNodeLifecycle restarts the controller manager with or without the
// node-lifecycle controllers: a benchmark whose thousands of machines do not
// renew Node Leases turns it off, and back on when it ends.
func (e *Env) SetNodeLifecycle(on bool) error {
	if e.kcm == nil {
		return fmt.Errorf("no controller manager runs: start the Env with testenv.With(testenv.Components{ControllerManager: true})")
	}
	if e.components.NodeLifecycle == on {
		return nil
	}
	e.kcm.Stop()
	e.components.NodeLifecycle = on
	return e.startControllerManager()
}

func (e *Env) startControllerManager() error {
	o := e.componentOptions("kube-controller-manager")
	o.ServiceAccountKey = e.saKey
	if e.components.NodeLifecycle {
		o.NodeMonitorGracePeriod = NodeGracePeriod
	}
	p, err := controlplane.StartControllerManager(context.Background(), o)
	if err != nil {
		return err
	}
	e.kcm = p
	e.stops = append(e.stops, e.stopper(p, "kube-controller-manager"))
	return nil
}

func (e *Env) componentOptions(name string) controlplane.Options {
	log, err := os.OpenFile(filepath.Join(e.dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		log = nil
	}
	o := controlplane.Options{Assets: os.Getenv("KUBEBUILDER_ASSETS"), Kubeconfig: e.Kubeconfig}
	if log != nil {
		o.Log = log
		e.stops = append(e.stops, func() { _ = log.Close() })
	}
	return o
}

// stopper stops p, first saying (with the end of its log) if it had died:
// tests that waited on it have timed out by then, and this says why.
func (e *Env) stopper(p *controlplane.Process, name string) func() {
	return func() {
		if err := p.Unexpected(); err != nil {
			tail, _ := os.ReadFile(filepath.Join(e.dir, name+".log"))
			if len(tail) > 4096 {
				tail = tail[len(tail)-4096:]
			}
			fmt.Fprintf(os.Stderr, "testenv: %v; the end of its log:\n%s\n", err, tail)
		}
		p.Stop()
	}
}
