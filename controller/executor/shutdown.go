package executor

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/controller/talos"
)

// Stages of the shutdown kind: the etcd safety snapshot where
// spec.shutdown.snapshot asks for one, the workers within maxUnavailable,
// then every control plane together, in one call.
const (
	StageSnapshot      = "etcd-snapshot"
	StageWorkers       = "workers"
	StageControlPlanes = "control-planes"
)

// Steps of the shutdown kind besides the shared ones.
const (
	StepSaveSnapshot          = "save-etcd-snapshot"
	StepEvictSelf             = "evict-controller"
	StepCheckControlPlanes    = "check-control-planes"
	StepShutdownControlPlanes = "shutdown-control-planes"
)

// NoSnapshotLocation says why a shutdown took no etcd safety snapshot.
const NoSnapshotLocation = "no etcd safety snapshot taken: spec.shutdown.snapshot names no location (set it, as kubectl ichor shutdown --snapshot does, or take one with `talosctl etcd snapshot` before a shutdown you may need to restore from)"

// shutdownEnds is the operation's final message but for what it says of
// the safety snapshot (ShutdownEnds).
const shutdownEnds = "the control planes are shutting down together (one call: etcd stops on every member at once); the API goes away now. " +
	"To bring the cluster back, power on the control planes first: etcd re-forms quorum from its data once a majority is up (no bootstrap, and NTP must be reachable); " +
	"then power on the workers. Once the API answers again, ichor-controller records here when the cluster came back (condition ClusterBack) and lifts the cordons it made. "

// ShutdownEnds is the operation's final message, written before the call
// that takes the API away: how to bring the cluster back, and where the
// safety snapshot is to restore from.
func ShutdownEnds(op *ichorv1.TalosOperation) string {
	if loc := snapshotLocation(op); loc != "" {
		return shutdownEnds + "The etcd snapshot saved before the shutdown is at " + loc +
			": if the cluster does not come back whole, restore from it (kubectl ichor restore etcd --from " + loc + ")."
	}
	return shutdownEnds + NoSnapshotLocation
}

// ClusterShutdown stops the whole cluster for planned downtime, in the
// order Talos's own sequences call for (TALOS_API.md, whole-cluster
// shutdown): the workers first, cordoned and drained (unless
// spec.shutdown.force) and shut down within maxUnavailable, the one the
// controller runs on last; then every control plane together, in one
// Shutdown request, so that etcd stops on every member at once instead of
// losing quorum half way. That request takes the API away, so the
// operation's final status is written before it (Step.Ends). When the
// cluster is powered on again, the controller records when it came back and
// whether every machine did (condition ClusterBack), and lifts its cordons.
type ClusterShutdown struct{}

// Target implements Executor.
func (ClusterShutdown) Target(op *ichorv1.TalosOperation) (string, string) {
	if force(op) {
		return "shutdown (force: no drain)", ""
	}
	return "shutdown", ""
}

func force(op *ichorv1.TalosOperation) bool { return op.Spec.Shutdown != nil && op.Spec.Shutdown.Force }

// Scope implements Executor: the whole cluster. Stopping some machines is
// the node kind's shutdown.
func (ClusterShutdown) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, fmt.Errorf("spec.machines: a shutdown stops the whole cluster; remove spec.machines (to stop some machines, use kind node with action shutdown)")
	}
	for _, n := range nodes {
		if _, held := n.Annotations[ichorv1.UpgradeHoldAnnotation]; held && machine.Role(n) == ichorv1.RoleControlPlane {
			return nil, fmt.Errorf("control plane %s carries %s, but a shutdown stops every control plane together, in one call: "+
				"remove the annotation (`kubectl annotate node %s %s-`) to shut the cluster down", n.Name, ichorv1.UpgradeHoldAnnotation, n.Name, ichorv1.UpgradeHoldAnnotation)
		}
	}
	return nodes, nil
}

// HonourHold implements Executor: a held worker stays up (an operator
// keeps it running on purpose); a held control plane refuses the
// operation (Scope), as the control planes all stop together.
func (ClusterShutdown) HonourHold() bool { return true }

// StopsMachines implements StopsMachines.
func (ClusterShutdown) StopsMachines() bool { return true }

// Check implements Executor.
func (ClusterShutdown) Check(context.Context, *Env) []string { return nil }

// Stages implements Stager.
func (ClusterShutdown) Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus {
	var stages []ichorv1.StageStatus
	if snapshotLocation(op) != "" {
		stages = append(stages, ichorv1.StageStatus{Name: StageSnapshot, Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOnce})
	}
	return append(stages,
		ichorv1.StageStatus{Name: StageWorkers, Roles: []ichorv1.MachineRole{ichorv1.RoleWorker}, Order: ichorv1.StageRolling},
		ichorv1.StageStatus{Name: StageControlPlanes, Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOnce},
	)
}

// snapshotLocation is where the shutdown saves its etcd safety snapshot,
// or "" for none.
func snapshotLocation(op *ichorv1.TalosOperation) string {
	if op.Spec.Shutdown == nil {
		return ""
	}
	return op.Spec.Shutdown.Snapshot
}

// Steps implements Executor.
func (ClusterShutdown) Steps(op *ichorv1.TalosOperation, _ *ichorv1.MachineStatus) []Step {
	switch op.Status.Stage {
	case StageSnapshot:
		return []Step{saveSnapshotStep()}
	case StageControlPlanes:
		return []Step{checkControlPlanesStep(), {Name: StepShutdownControlPlanes, Timeout: 2 * time.Minute,
			Irreversible: true, Ends: ShutdownEnds(op), Run: shutdownControlPlanes.make}}
	}
	steps := []Step{recordBootStep()}
	if force(op) {
		// No drain, but the controller's own pod still moves away before its
		// machine stops: the shutdown of the control planes needs it. The
		// cordon first, or the scheduler may put its replacement back on
		// the machine about to stop.
		steps = append(steps, cordonStep(), evictSelfStep())
	} else {
		steps = append(steps, cordonStep(), drainStep(op))
	}
	return append(steps, callStep(StepShutdown, 2*time.Minute, workerShutdown), waitDownStep())
}

// Force on every call: Ichor has drained the worker already (or was told
// not to), and the control planes' own drain would wait a minute for an
// API that goes away with them.
var (
	workerShutdown = call{what: "shutdown", reason: "ShutdownFailed",
		stages: []runtime.MachineStage{runtime.MachineStageShuttingDown},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return Outcome{}, talos.Shutdown(ctx, e.Talos, e.Address, true)
		}}
	shutdownControlPlanes = call{what: "shutdown of every control plane", reason: "ShutdownFailed",
		stages: []runtime.MachineStage{runtime.MachineStageShuttingDown},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return Outcome{Message: ShutdownEnds(e.Op)}, talos.ShutdownAll(ctx, e.Talos, e.ControlPlanes, true)
		}}
)

// saveSnapshotStep saves the safety snapshot: etcd's, streamed from the
// first control plane, verified, and stored where spec.shutdown.snapshot
// says, before any machine stops. It can run again (it overwrites), and a
// failure pauses the shutdown with every machine still up.
func saveSnapshotStep() Step {
	return Step{Name: StepSaveSnapshot, Timeout: 10 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s := e.Op.Spec.Shutdown
		loc, err := snapshot.Parse(s.Snapshot)
		if err != nil {
			return Outcome{}, Fail("SnapshotFailed", "spec.shutdown.snapshot: %w", err)
		}
		creds, err := s3Credentials(ctx, e, s.Secret, "spec.shutdown.secret")
		if err != nil {
			return Outcome{}, Fail("SnapshotFailed", "%w", err)
		}
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		local, err := os.CreateTemp("", "ichor-etcd-snapshot-*.db")
		if err != nil {
			return Outcome{}, fmt.Errorf("etcd snapshot: %w", err)
		}
		defer os.Remove(local.Name()) //nolint:errcheck
		err = talos.EtcdSnapshot(ctx, e.Talos, e.Address, local)
		if cerr := local.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return Outcome{}, err
		}
		st, err := snapshot.Verify(local.Name())
		if err != nil {
			return Outcome{}, Fail("SnapshotFailed", "the etcd snapshot %s streamed does not verify: %w", e.Machine.Name, err)
		}
		if err := snapshot.Save(ctx, loc, creds, local.Name()); err != nil {
			return Outcome{}, Fail("SnapshotFailed", "%w (nothing was shut down; fix the location, then retry)", err)
		}
		return Outcome{Message: fmt.Sprintf("etcd snapshot saved to %s: %s", s.Snapshot, st)}, nil
	}}
}

// evictSelfStep evicts the controller's own pod when it runs on the
// machine (a forced shutdown drains nothing else): its replacement, on a
// machine that stays up, goes on with the operation from status.
func evictSelfStep() Step {
	return Step{Name: StepEvictSelf, Timeout: time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		ns, name, ok := strings.Cut(e.Controller.Pod, "/")
		if !ok {
			return Outcome{}, nil
		}
		pod, err := e.Clientset.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return Outcome{}, nil
		}
		if err != nil {
			return Outcome{}, fmt.Errorf("read the controller's pod %s: %w", e.Controller.Pod, err)
		}
		if pod.Spec.NodeName != e.Machine.Name {
			return Outcome{}, nil
		}
		ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
		if err := e.Clientset.PolicyV1().Evictions(ns).Evict(ctx, ev); err != nil && !apierrors.IsNotFound(err) {
			return Outcome{}, Fail("DrainFailed", "evict the controller's own pod %s from %s: %w", e.Controller.Pod, e.Machine.Name, err)
		}
		return Outcome{Message: "the controller's own pod evicted"}, nil
	}}
}

// checkControlPlanesStep records the boot of the control plane that runs
// the stage (the evidence, after a restart, of whether the shutdown call
// was made and whether the cluster has come back), and checks, while the
// API is still here to report a failure, that every control plane answers
// and etcd is healthy: after the next step's intent nothing can fail
// visibly any more.
func checkControlPlanesStep() Step {
	return Step{Name: StepCheckControlPlanes, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		var silent []string
		for _, cp := range e.ControlPlanes {
			if !talos.Answers(ctx, e.Talos, cp, probeTimeout) {
				silent = append(silent, cp)
			}
		}
		if len(silent) > 0 {
			return Outcome{}, Fail("Unreachable", "the control planes at %s do not answer the Talos API, so none was shut down: "+
				"the shutdown stops every control plane in one call; bring them back (or remove them from the cluster), then retry", strings.Join(silent, ", "))
		}
		if err := checkEtcd(ctx, e); err != nil {
			return Outcome{}, err
		}
		boot, err := talos.BootID(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, err
		}
		msg := NoSnapshotLocation
		if loc := snapshotLocation(e.Op); loc != "" {
			msg = "etcd snapshot saved before the shutdown: " + loc
		}
		return Outcome{BootID: boot, Message: msg}, nil
	}}
}

// Reasons of the ClusterBack condition.
const (
	ReasonAllMachinesBack = "AllMachinesBack"
	ReasonMachinesMissing = "MachinesMissing"
)

// Ended implements EndRecorder. The control plane that ran the call (e)
// tells what happened since the final status was written, and when it
// still runs as before, the other control planes of the call tell too:
//   - it is shutting down or does not answer: the cluster is going down;
//     look again soon (the API goes too);
//   - it answers with another boot: the cluster was powered on again and
//     has come back: record when, and which machines are back (Ready since
//     the shutdown), and lift the cordons; look again at each Node event
//     until every machine is;
//   - it answers with the boot status recorded before the call, and is not
//     shutting down, and so does every other control plane: the call did
//     not go out (the controller that wrote it was stopped first), or not
//     yet: run the step again, which decides from the machine;
//   - it runs as before, but the call reached another control plane (it is
//     shutting down, does not answer, or has booted since): the call went
//     out and this machine's part of it failed, while no controller was
//     there to record it. Never call again (the others may have been
//     powered on since): wait while any is down, then record the cluster
//     back, saying that this machine kept running.
func (ClusterShutdown) Ended(ctx context.Context, e *Env) (EndState, error) {
	boot, stage, err := observe(ctx, e)
	if talos.Unreachable(err) {
		return EndState{Recheck: 2 * time.Second}, nil
	}
	if err != nil {
		return EndState{}, fmt.Errorf("read the boot of %s after the shutdown: %w", e.Machine.Name, err)
	}
	if boot == e.Machine.BootID {
		if stage == runtime.MachineStageShuttingDown {
			return EndState{Recheck: 2 * time.Second}, nil
		}
		down, back, err := othersReached(ctx, e)
		switch {
		case err != nil:
			return EndState{}, err
		case down:
			return EndState{Recheck: 2 * time.Second}, nil
		case !back:
			return EndState{Relaunch: true, Recheck: 2 * time.Second}, nil
		}
		cond := cameBack(e, e.Machine.Name)
		return EndState{Condition: &cond, Uncordon: true, Done: cond.Reason == ReasonAllMachinesBack}, nil
	}
	cond := cameBack(e, "")
	return EndState{Condition: &cond, Uncordon: true, Done: cond.Reason == ReasonAllMachinesBack}, nil
}

// othersReached looks at the control planes that the ending call covered
// besides e's machine, each against the boot its entry recorded before the
// call: down, when one is shutting down or does not answer; back, when one
// has booted since. Neither: the call reached none of them.
func othersReached(ctx context.Context, e *Env) (down, back bool, err error) {
	for _, m := range e.Op.Status.Machines {
		if m.Role != ichorv1.RoleControlPlane || m.Name == e.Machine.Name || m.BootID == "" {
			continue // not in the call
		}
		addr := nodeAddress(e, m.Name)
		if addr == "" {
			continue // not reachable to the call either
		}
		boot, stage, err := observeAt(ctx, e, addr)
		switch {
		case talos.Unreachable(err):
			down = true
		case err != nil:
			return false, false, fmt.Errorf("read the boot of %s after the shutdown: %w", m.Name, err)
		case boot != m.BootID:
			back = true
		case stage == runtime.MachineStageShuttingDown:
			down = true
		}
	}
	return down, back, nil
}

// cameBack is the ClusterBack condition: when the cluster came back (the
// first time the controller found it so, kept afterwards) and which
// machines are back, each Node Ready since the operation ended, or named
// by keptRunning: the control plane whose part of the call failed, up all
// along (its Node need not have said anything since).
func cameBack(e *Env, keptRunning string) metav1.Condition {
	since := e.Op.Status.CompletionTime
	at := metav1.Now()
	if c := meta.FindStatusCondition(e.Op.Status.Conditions, ichorv1.ConditionClusterBack); c != nil {
		at = c.LastTransitionTime
	}
	byName := map[string]*corev1.Node{}
	for _, n := range e.Nodes {
		byName[n.Name] = n
	}
	var missing []string
	ms := e.Op.Status.Machines
	for _, m := range ms {
		if n := byName[m.Name]; m.Name != keptRunning && (n == nil || !backSince(n, since)) {
			missing = append(missing, m.Name)
		}
	}
	msg := fmt.Sprintf("the cluster came back at %s: %d/%d machines back", at.UTC().Format(time.RFC3339), len(ms)-len(missing), len(ms))
	reason := ReasonAllMachinesBack
	if len(missing) > 0 {
		reason = ReasonMachinesMissing
		msg += "; not back yet (Node not Ready since the shutdown): " + strings.Join(missing, ", ")
	}
	if keptRunning != "" {
		msg += "; " + keptRunning + " kept running: its part of the shutdown call failed while no controller was there to record it"
	}
	return metav1.Condition{Type: ichorv1.ConditionClusterBack, Status: metav1.ConditionTrue, Reason: reason, Message: msg,
		LastTransitionTime: at, ObservedGeneration: e.Op.Generation}
}

// backSince says whether the Node is Ready and has said so since t: a
// Node whose machine stayed off keeps the Ready it last reported.
func backSince(n *corev1.Node, t *metav1.Time) bool {
	if !machine.Ready(n) {
		return false
	}
	if t == nil {
		return true
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.LastHeartbeatTime.After(t.Time) || c.LastTransitionTime.After(t.Time)
		}
	}
	return false
}
