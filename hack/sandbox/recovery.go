package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/sim"
)

// Names of the recovery walk-through (--demo=recovery).
const (
	restoreName  = "restore-etcd"
	shutdownName = "shutdown"
)

// restoreTimeout bounds the restore's watch.
const restoreTimeout = 6 * time.Minute

// afterSnapshot are the ConfigMaps created after the snapshot, which the
// restore takes away.
var afterSnapshot = []string{"after-snapshot-1", "after-snapshot-2", "after-snapshot-3"}

// recovery is the second walk-through: the two operations that take the
// API away. An etcd restore rewinds the store the operation lives in; a
// shutdown stops the machines the controller and the API run on. Each is
// followed with kubectl ichor until the API goes, and checked once the
// cluster is back.
func (d *demo) recovery() []func(context.Context) error {
	return []func(context.Context) error{d.recoveryCluster, d.snapshot, d.restore, d.restored, d.shutdown, d.powerOn}
}

// 1. The cluster, and where the controller runs.
func (d *demo) recoveryCluster(ctx context.Context) error {
	c := d.sb.cfg
	d.heading(fmt.Sprintf("A Talos cluster of %d control planes and %d workers (simulated) hosting their own API and etcd, Ichor installed", c.ControlPlanes, c.Workers))
	if _, err := d.run(ctx, 0, "kubectl", "get", "nodes", "-o", "wide"); err != nil {
		return err
	}
	if err := d.nodesRun(ctx, c.Talos); err != nil {
		return err
	}
	d.say("ichor-controller's pods prefer the workers and tolerate the control planes' taint: a shutdown moves them there.")
	_, err := d.run(ctx, 0, "kubectl", "get", "pods", "-n", ichorv1.DefaultNamespace, "-o", "wide")
	return err
}

// 2. A snapshot of etcd, then three objects it does not hold.
func (d *demo) snapshot(ctx context.Context) error {
	cp := d.sb.Fleet.ControlPlanes()[0]
	path := d.sb.Path(fileSnapshot)
	d.heading("A snapshot of etcd, then three ConfigMaps created after it")
	d.say("The sandbox takes the snapshot through %s's Talos API, as `talosctl -n %s etcd snapshot %s` does.", cp.Name(), cp.Address(), relative(path))
	if err := d.takeSnapshot(ctx, cp.Address(), path); err != nil {
		return err
	}
	st, err := snapshot.Verify(path)
	if err != nil {
		return fmt.Errorf("the snapshot just taken does not verify: %w", err)
	}
	d.snapshotRevision = st.Revision
	d.say("Snapshot %s: %s.", relative(path), st)
	for _, name := range afterSnapshot {
		if _, err := d.run(ctx, 0, "kubectl", "create", "configmap", name, "--from-literal=created=after the snapshot"); err != nil {
			return err
		}
	}
	return nil
}

// takeSnapshot streams etcd's snapshot from the control plane at address into path.
func (d *demo) takeSnapshot(ctx context.Context, address, path string) (err error) {
	c, err := talosclient.New(ctx, talosclient.WithConfig(d.sb.Fleet.Talosconfig()))
	if err != nil {
		return err
	}
	defer c.Close() //nolint:errcheck
	ctx, cancel := context.WithTimeout(ctx, d.short)
	defer cancel()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	d.sb.remember(fileSnapshot)
	err = talos.EtcdSnapshot(ctx, c, address, f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// 3. The restore, followed live through the API's absence.
func (d *demo) restore(ctx context.Context) error {
	d.heading("Restore etcd from the snapshot: the API goes away, and comes back rewound")
	d.say("Every control plane but the first leaves etcd, all are reset (EPHEMERAL wiped), the first recovers from the")
	d.say("snapshot and the others join it. The operation is not in the snapshot: ichor-controller journals it in the")
	d.say("control planes' META while the API is away and writes it back at the end. The watch follows it through.")
	// The restore's time is that of the API servers' restarts, and of etcd
	// re-forming, not the pace: 13 to 22 s whether the machine is quiet or
	// busy; 6 minutes, as TestEtcdRestore allows, for a far busier one.
	_, err := d.run(ctx, 0, "kubectl", "ichor", "restore", "etcd", "--from", "file://"+d.sb.Path(fileSnapshot),
		"--name", restoreName, "--yes", "--watch", "--timeout", max(d.long, restoreTimeout).String())
	return err
}

// 4. The store is the snapshot's, etcd is whole, the operation is back.
func (d *demo) restored(ctx context.Context) error {
	d.heading("The store is the snapshot's: the three ConfigMaps are gone, the operation is back")
	op, err := d.waitOp(ctx, restoreName, "Succeeded, written back from the journal", d.short, func(op *ichorv1.TalosOperation) (bool, error) {
		return op.Succeeded() && op.Annotations[ichorv1.RestoredFromAnnotation] != "", nil
	})
	if err != nil {
		return err
	}
	if want := fmt.Sprintf("revision %d", d.snapshotRevision); len(op.Status.Machines) != 1 || op.Status.Machines[0].To != want {
		return fmt.Errorf("expected %s to record the snapshot's %s, its machines: %+v", restoreName, want, op.Status.Machines)
	}
	if _, err := d.run(ctx, 0, "kubectl", "get", "talosoperation", restoreName, "-o", "wide"); err != nil {
		return err
	}
	if _, err := d.run(ctx, 0, "kubectl", "get", "configmaps"); err != nil {
		return err
	}
	for _, name := range afterSnapshot {
		err := d.sb.Client.Get(ctx, client.ObjectKey{Namespace: demoNamespace, Name: name}, &corev1.ConfigMap{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("expected ConfigMap %s, created after the snapshot, gone after the restore: %v", name, err)
		}
	}
	st := d.sb.Fleet.Etcd()
	healthy := 0
	for _, m := range st.Members {
		if m.Healthy {
			healthy++
		}
	}
	if n := len(d.sb.Fleet.ControlPlanes()); len(st.Members) != n || healthy != n || st.Leader == "" {
		return fmt.Errorf("expected the %d control planes healthy members of etcd with a leader, etcd is %+v", n, st)
	}
	d.say("etcd: %d healthy members, leader %s.", healthy, st.Leader)
	return nil
}

// 5. The shutdown, followed until the API goes.
func (d *demo) shutdown(ctx context.Context) error {
	d.heading("Shut the whole cluster down: the workers one at a time, then every control plane in one call")
	d.say("Draining every worker would leave the workloads nowhere to run (web's budget holds the last drain), so")
	d.say("--force stops the workers without draining; the controller's own pod still moves, last, to a control plane.")
	d.say("First, before any machine stops, it saves an etcd snapshot to restore from (--snapshot).")
	d.say("The final status is written before the control planes' call, which takes the API away: the watch exits 0.")
	path := d.sb.Path(fileShutdownSnapshot)
	d.sb.remember(fileShutdownSnapshot)
	if _, err := d.run(ctx, 0, "kubectl", "ichor", "shutdown", "--force", "--snapshot", "file://"+path,
		"--name", shutdownName, "--yes", "--watch", "--timeout", d.long.String()); err != nil {
		return err
	}
	st, err := snapshot.Verify(path)
	if err != nil {
		return fmt.Errorf("expected the shutdown's safety snapshot at %s: %w", relative(path), err)
	}
	d.say("The safety snapshot %s: %s.", relative(path), st)
	return d.poll(ctx, "every machine off", d.short, func(context.Context) (bool, error) {
		for _, m := range d.sb.Fleet.Machines() {
			if !m.Off() {
				return false, nil
			}
		}
		return true, nil
	})
}

// 6. Power on, control planes first; the controller records the return.
func (d *demo) powerOn(ctx context.Context) error {
	d.heading("Power the cluster on, the control planes first: etcd re-forms quorum, the controller records the return")
	d.say("A person presses the power buttons; here the sandbox does, as the operation's message says: control planes, then workers.")
	for _, role := range []sim.Role{sim.ControlPlane, sim.Worker} {
		for _, name := range d.machines(role) {
			if err := d.sb.Fleet.Machine(name).PowerOn(); err != nil {
				return err
			}
		}
	}
	op, err := d.waitOp(ctx, shutdownName, "to record that every machine came back (condition ClusterBack)", d.long, func(op *ichorv1.TalosOperation) (bool, error) {
		c := meta.FindStatusCondition(op.Status.Conditions, ichorv1.ConditionClusterBack)
		return c != nil && c.Reason == executor.ReasonAllMachinesBack, nil
	})
	if err != nil {
		return err
	}
	if !op.Succeeded() {
		return fmt.Errorf("expected %s Succeeded, it is %s: %s", shutdownName, op.Status.Phase, op.Status.Message)
	}
	back := meta.FindStatusCondition(op.Status.Conditions, ichorv1.ConditionClusterBack)
	d.say("ClusterBack: %s", back.Message)
	if n := len(d.sb.Fleet.Machines()); !strings.Contains(back.Message, fmt.Sprintf("%d/%d machines back", n, n)) {
		return fmt.Errorf("expected ClusterBack to count every machine back: %s", back.Message)
	}
	if _, err := d.run(ctx, 0, "kubectl", "get", "talosoperations", "-o", "wide"); err != nil {
		return err
	}
	// The cordons lifted, every Node Ready and on the version it had.
	if err := d.poll(ctx, "every Node Ready and uncordoned", d.short, func(ctx context.Context) (bool, error) {
		return d.nodesRun(ctx, d.sb.cfg.Talos) == nil, nil
	}); err != nil {
		return fmt.Errorf("%w: %v", err, d.nodesRun(ctx, d.sb.cfg.Talos))
	}
	_, err = d.run(ctx, 0, "kubectl", "get", "nodes")
	return err
}
