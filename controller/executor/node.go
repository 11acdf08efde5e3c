package executor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/talos"
)

// Steps of the node kind.
const (
	StepRecordBoot     = "record-boot"
	StepShutdown       = "shutdown"
	StepReset          = "reset"
	StepWaitDown       = "wait-down"
	StepRestartService = "restart-service"
	StepDefragment     = "etcd-defrag"
	StepForfeit        = "etcd-forfeit-leadership"
)

// NodeAction is one action on one machine: reboot (verified by a new boot ID
// and the Node Ready), shutdown, restart-service (verified by the Service
// coming back healthy), etcd-defrag, etcd-forfeit-leadership (verified by
// the new leader) and reset. Disruptive actions on a control plane are
// preceded by the etcd health check, and machines are cordoned and drained
// first (unless spec.drain.disabled).
type NodeAction struct{}

// Target implements Executor.
func (NodeAction) Target(op *ichorv1.TalosOperation) (string, string) {
	n := op.Spec.Node
	if n == nil {
		return "", ""
	}
	s := fmt.Sprintf("%s %s", n.Action, n.Machine)
	if n.Service != "" {
		s = fmt.Sprintf("restart %s on %s", n.Service, n.Machine)
	}
	return s, ""
}

// Scope implements Executor: the one machine named.
func (NodeAction) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	name := op.Spec.Node.Machine
	for _, n := range nodes {
		if n.Name == name {
			return []*corev1.Node{n}, nil
		}
	}
	return nil, errors.New(ichorv1.MachineNotANode(name, op.Spec.Machines != nil))
}

// HonourHold implements Executor: a node action names its machine explicitly.
func (NodeAction) HonourHold() bool { return false }

// MachineBound implements MachineBound: a step reads its own machine only.
func (NodeAction) MachineBound() bool { return true }

// Check implements Executor: actions that make no sense on the machine.
func (NodeAction) Check(ctx context.Context, e *Env) []string {
	n := e.Op.Spec.Node
	cp := e.Machine.Role == ichorv1.RoleControlPlane
	switch n.Action {
	case ichorv1.NodeEtcdDefrag, ichorv1.NodeEtcdForfeitLeadership:
		if !cp {
			return []string{fmt.Sprintf("%s is a worker: %s runs only on control planes, which run etcd", e.Machine.Name, n.Action)}
		}
		if n.Action == ichorv1.NodeEtcdForfeitLeadership {
			if err := e.requireAddress(); err != nil {
				return []string{err.Error()}
			}
			ms, err := talos.EtcdMembers(ctx, e.Talos, e.Address)
			if err != nil {
				return []string{fmt.Sprintf("cannot read the etcd members from %s: %v", e.Machine.Name, err)}
			}
			if len(ms) < 2 {
				return []string{fmt.Sprintf("etcd has %d member(s): there is no other member to forfeit leadership to", len(ms))}
			}
		}
	case ichorv1.NodeRestartService:
		if n.Service != "kubelet" && !strings.HasPrefix(n.Service, "ext-") {
			return []string{fmt.Sprintf("service %q cannot be restarted through the Talos API: only kubelet and extension services (ext-*) can", n.Service)}
		}
	}
	return nil
}

// LockIdentity implements LockIdentifier: resetting a control plane is a
// removal, which takes the lock under the machine's identity.
func (NodeAction) LockIdentity(op *ichorv1.TalosOperation, role ichorv1.MachineRole) string {
	if op.Spec.Node.Action == ichorv1.NodeReset && role == ichorv1.RoleControlPlane {
		return ichorv1.MachineIdentity(op.Spec.Node.Machine)
	}
	return ""
}

// Steps implements Executor.
func (NodeAction) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	n := op.Spec.Node
	cp := m.Role == ichorv1.RoleControlPlane
	drainOn := op.Spec.Drain == nil || !op.Spec.Drain.Disabled
	var steps []Step
	// disrupt adds what comes before a disruptive call: the boot ID recorded
	// (the call's evidence), an etcd check before a control plane is
	// drained, cordon and drain.
	disrupt := func(graceful bool) {
		steps = append(steps, recordBootStep())
		if cp {
			steps = append(steps, etcdHealthStep())
		}
		if drainOn && graceful {
			steps = append(steps, cordonStep(), drainStep(op))
		}
	}
	switch n.Action {
	case ichorv1.NodeReboot:
		return rebootSteps(op, m)
	case ichorv1.NodeShutdown:
		disrupt(true)
		steps = append(steps, callStep(StepShutdown, 2*time.Minute, shutdown), waitDownStep())
	case ichorv1.NodeReset:
		graceful := n.Reset == nil || ptr.Deref(n.Reset.Graceful, true)
		disrupt(graceful)
		steps = append(steps, callStep(StepReset, 10*time.Minute, reset), waitDownStep())
	case ichorv1.NodeRestartService:
		steps = append(steps, restartServiceStep())
	case ichorv1.NodeEtcdDefrag:
		steps = append(steps, defragStep())
	case ichorv1.NodeEtcdForfeitLeadership:
		steps = append(steps, forfeitStep())
	}
	return steps
}

// rebootSteps reboot a machine gracefully: its boot recorded, etcd's
// health checked (control planes), cordoned and drained (unless
// spec.drain.disabled), rebooted, back with a new boot ID and Ready, and
// uncordoned.
func rebootSteps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	drainOn := op.Spec.Drain == nil || !op.Spec.Drain.Disabled
	steps := []Step{recordBootStep()}
	if m.Role == ichorv1.RoleControlPlane {
		steps = append(steps, etcdHealthStep())
	}
	if drainOn {
		steps = append(steps, cordonStep(), drainStep(op))
	}
	steps = append(steps, callStep(StepReboot, 2*time.Minute, nodeReboot), rebootedStep(nil, StepRecordBoot))
	if drainOn {
		steps = append(steps, uncordonStep())
	}
	return steps
}

func recordBootStep() Step {
	return Step{Name: StepRecordBoot, Timeout: time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		f, err := talos.ReadFacts(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, err
		}
		return Outcome{BootID: f.BootID, From: f.Version}, nil
	}}
}

// callStep is a step that makes one irreversible call.
func callStep(name string, timeout time.Duration, c call) Step {
	return Step{Name: name, Timeout: timeout, Irreversible: true, Run: c.make}
}

var (
	nodeReboot = call{what: "reboot", reason: "RebootFailed",
		stages: []runtime.MachineStage{runtime.MachineStageRebooting},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return Outcome{}, talos.Reboot(ctx, e.Talos, e.Address, false)
		}}
	shutdown = call{what: "shutdown", reason: "ShutdownFailed",
		stages: []runtime.MachineStage{runtime.MachineStageShuttingDown},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return Outcome{}, talos.Shutdown(ctx, e.Talos, e.Address, false)
		}}
	reset = call{what: "reset", reason: "ResetFailed",
		stages: []runtime.MachineStage{runtime.MachineStageResetting},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			graceful, reboot, wipe := resetOptions(e.Op.Spec.Node.Reset)
			return Outcome{}, talos.Reset(ctx, e.Talos, e.Address, graceful, reboot, wipe)
		}}
)

func resetOptions(r *ichorv1.ResetOptions) (graceful, reboot bool, wipe talos.Wipe) {
	if r == nil {
		return true, false, talos.WipeAll
	}
	switch r.Wipe {
	case ichorv1.WipeSystemDisk:
		wipe = talos.WipeSystemDisk
	case ichorv1.WipeEphemeral:
		wipe = talos.WipeEphemeral
	default:
		wipe = talos.WipeAll
	}
	return ptr.Deref(r.Graceful, true), r.Reboot, wipe
}

// waitDownStep waits until the machine that was sent a shutdown or reset
// has gone: its Node NotReady and the Talos API no longer answering. A
// machine that answers with a boot ID other than the one recorded before
// the call went down and came back (a reset with reboot, a machine powered
// on again) while nobody watched, a controller restart say: it is done.
func waitDownStep() Step {
	return Step{Name: StepWaitDown, Timeout: 15 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		if e.Node == nil {
			return true, Outcome{Message: "down; its Node is gone"}, nil
		}
		if machine.Ready(e.Node) {
			if bootedSince(ctx, e) {
				return true, Outcome{Message: "went down and is back: the machine has booted again since"}, nil
			}
			// Looked at again: a reboot shorter than the Node's NotReady
			// round trip shows no change that Kubernetes announces.
			return false, Outcome{Message: "waiting for the machine to go down", Recheck: time.Second}, nil
		}
		if err := e.requireAddress(); err != nil {
			return false, Outcome{}, err
		}
		if talos.Answers(ctx, e.Talos, e.Address, 5*time.Second) {
			return false, Outcome{Message: "waiting for the Talos API to stop answering", Recheck: time.Second}, nil
		}
		return true, Outcome{Message: "down"}, nil
	}}
}

// bootedSince says whether the machine answers with a boot ID other than
// the one status recorded before the call (false when it does not answer).
func bootedSince(ctx context.Context, e *Env) bool {
	if e.Machine.BootID == "" || e.Address == "" {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	boot, err := talos.BootID(ctx, e.Talos, e.Address)
	return err == nil && boot != e.Machine.BootID
}

func restartServiceStep() Step {
	return Step{Name: StepRestartService, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		svc := e.Op.Spec.Node.Service
		if err := talos.RestartService(ctx, e.Talos, e.Address, svc); err != nil {
			return Outcome{}, Fail("RestartFailed", "%w", err)
		}
		return Outcome{Message: svc + " restarted and healthy"}, nil
	}}
}

func defragStep() Step {
	return Step{Name: StepDefragment, Timeout: 10 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		if err := talos.Defragment(ctx, e.Talos, e.Address); err != nil {
			return Outcome{}, Fail("DefragmentFailed", "%w", err)
		}
		return Outcome{Message: "etcd defragmented"}, nil
	}}
}

func forfeitStep() Step {
	return Step{Name: StepForfeit, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		leader, err := talos.IsLeader(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, err
		}
		if !leader {
			return Outcome{Message: "not the etcd leader: nothing to forfeit"}, nil
		}
		to, err := talos.ForfeitLeadership(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, Fail("ForfeitFailed", "%w", err)
		}
		if still, err := talos.IsLeader(ctx, e.Talos, e.Address); err != nil || still {
			return Outcome{}, Fail("ForfeitFailed", "still the etcd leader after forfeiting (err: %v)", err)
		}
		return Outcome{Message: "etcd leadership moved to " + to}, nil
	}}
}
