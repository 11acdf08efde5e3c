package executor

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/kubectl/pkg/drain"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/controller/watchlist"
)

// CordonedByAnnotation marks a Node that Ichor cordoned, with the lock
// identity of the operation that did, so that only Ichor's own cordons are
// lifted: a machine an operator had cordoned stays cordoned.
const CordonedByAnnotation = "ichor.maesh.dev/cordoned-by"

// Shared step names.
const (
	StepEtcdHealth = "etcd-health"
	StepCordon     = "cordon"
	StepDrain      = "drain"
	StepUncordon   = "uncordon"
	StepRebooted   = "wait-rebooted"
)

// etcdHealthStep checks etcd before a control plane is drained; the check
// that counts comes again right before the disruptive call (see call.make).
// A check: it follows the step before it in the same run.
func etcdHealthStep() Step {
	return Step{Name: StepEtcdHealth, Timeout: 2 * time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		return Outcome{}, checkEtcd(ctx, e)
	}}
}

func checkEtcd(ctx context.Context, e *Env) error {
	if err := talos.EtcdHealth(ctx, e.Talos, e.ControlPlanes); err != nil {
		return Fail("EtcdUnhealthy", "etcd is not healthy: %w", err)
	}
	return nil
}

// requireAddress fails a step that talks to the machine's Talos API when
// its Node reports no InternalIP: there is no address to reach it at, which
// is not the same as a machine that does not answer.
func (e *Env) requireAddress() error {
	if e.Address != "" {
		return nil
	}
	return Fail("NoNodeAddress", "the Node %s has no InternalIP, and Ichor reaches a machine's Talos API at its Node's InternalIP: "+
		"once the kubelet reports one (`kubectl get node %s -o wide`), retry", e.Machine.Name, e.Machine.Name)
}

// cordonStep cordons the machine, marking the cordon as the operation's.
// It follows the step before it in the same run: cordoning again is
// harmless.
func cordonStep() Step {
	return Step{Name: StepCordon, Timeout: time.Minute, Chained: true, Cordons: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		return Outcome{}, e.changeNode(ctx, func(node *corev1.Node) map[string]any {
			if node.Spec.Unschedulable {
				// Already cordoned: by us (a rerun) or by someone else, whose cordon we leave alone.
				return nil
			}
			return map[string]any{
				"metadata": map[string]any{"annotations": map[string]any{CordonedByAnnotation: e.Identity}},
				"spec":     map[string]any{"unschedulable": true},
			}
		})
	}}
}

// Uncordon is the step that lifts the cordon this operation made (its
// identity marks it) and leaves anyone else's alone.
func Uncordon() Step { return uncordonStep() }

// uncordonStep is Chained: it gives the machine back and takes nothing
// away, so it starts beside the status write that records it (right after
// the reboot it follows is seen) rather than a round trip later, on every
// machine's path. Lifting only this operation's own cordon, it is
// idempotent, and harmless after a takeover.
func uncordonStep() Step {
	return Step{Name: StepUncordon, Timeout: time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		return Outcome{}, e.changeNode(ctx, func(node *corev1.Node) map[string]any {
			if node.Annotations[CordonedByAnnotation] != e.Identity {
				return nil
			}
			return map[string]any{
				"metadata": map[string]any{"annotations": map[string]any{CordonedByAnnotation: nil}},
				"spec":     map[string]any{"unschedulable": false},
			}
		})
	}}
}

// drainStep evicts the machine's pods within spec.drain.timeout (the step's
// own timeout leaves it room). Only a drain that ran out of time is forced
// with onTimeout: force; any other error fails the step. It follows the
// step before it in the same run, as kubectl drain follows its cordon: the
// disruption it prepares is the next step's, whose start status records.
func drainStep(op *ichorv1.TalosOperation) Step {
	d := op.Spec.Drain
	timeout := DefaultDrainTimeout
	if d != nil && d.Timeout != nil && d.Timeout.Duration > 0 {
		timeout = d.Timeout.Duration
	}
	force := d != nil && d.OnTimeout == ichorv1.DrainForce
	// Room for the forced drain, which has the same time again, and for
	// listing the pods.
	stepTimeout := timeout + time.Minute
	if force {
		stepTimeout += timeout
	}
	return Step{Name: StepDrain, Timeout: stepTimeout, Chained: true, Cordons: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		timedOut, err := runDrain(ctx, e, timeout, false)
		if err == nil {
			return Outcome{}, nil
		}
		if !timedOut {
			return Outcome{}, Fail("DrainFailed", "%w (fix what blocks the drain, then retry)", err)
		}
		if !force {
			return Outcome{}, Fail("DrainFailed", "the drain did not finish within %s: %w (set spec.drain.onTimeout: force to delete the remaining pods, or fix what blocks eviction and retry)", timeout, err)
		}
		e.Log.Info("drain did not finish in time; deleting the remaining pods, ignoring PodDisruptionBudgets", "machine", e.Machine.Name, "err", err)
		if _, err := runDrain(ctx, e, timeout, true); err != nil {
			return Outcome{}, Fail("DrainFailed", "forced drain: %w", err)
		}
		return Outcome{Message: "drain timed out; remaining pods deleted (onTimeout: force)"}, nil
	}}
}

// DefaultDrainTimeout bounds a drain when spec.drain.timeout is not set
// (the API's default).
const DefaultDrainTimeout = 5 * time.Minute

// runDrain drains the machine's Node within timeout (force deletes pods
// instead of evicting them) and says whether an error came from running out
// of that time.
func runDrain(ctx context.Context, e *Env, timeout time.Duration, force bool) (timedOut bool, err error) {
	dctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	asOf, err := e.cordonedAt(dctx)
	if err != nil {
		return false, err
	}
	report := newDrainReport(ctx, e, "draining")
	h := &drain.Helper{
		Ctx: dctx,
		// No LIST of every pod per drain, and its pods as of the cordon.
		Client:              watchlist.AsOf(e.Clientset, asOf),
		Force:               true, // bare pods would not survive the reboot either
		GracePeriodSeconds:  -1,
		IgnoreAllDaemonSets: true,
		DeleteEmptyDirData:  true,
		Timeout:             timeout,
		DisableEviction:     force,
		// kubectl drain's pause before asking again when a budget refuses.
		EvictErrorRetryDelay:            5 * time.Second,
		Out:                             logWriter{e.Log},
		ErrOut:                          report,
		OnPodDeletionOrEvictionStarted:  report.started,
		OnPodDeletionOrEvictionFinished: report.finished,
	}
	if self := e.Controller.Pod; self != "" {
		// The controller's own pod goes last: its eviction ends this
		// process, which cancels the evictions still in flight, and one cut
		// after its PodDisruptionBudget counted it holds the budget for 2
		// minutes (the disruption controller's wait for the deletion).
		others := *h
		others.AdditionalFilters = []drain.PodFilter{func(p corev1.Pod) drain.PodDeleteStatus {
			if podKey(&p) == self {
				return drain.MakePodDeleteStatusSkip()
			}
			return drain.MakePodDeleteStatusOkay()
		}}
		if err = drain.RunNodeDrain(&others, e.Machine.Name); err != nil {
			return dctx.Err() == context.DeadlineExceeded && ctx.Err() == nil, err
		}
	}
	err = drain.RunNodeDrain(h, e.Machine.Name)
	return err != nil && dctx.Err() == context.DeadlineExceeded && ctx.Err() == nil, err
}

type logWriter struct{ log logr.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.V(1).Info(string(p))
	return len(p), nil
}

var _ io.Writer = logWriter{}

// rebootedStep waits until the machine is back from the reboot recorded in
// its status: a new boot ID, its Node Ready, and, when want is set, on that
// Talos version. Coming back on another version means Talos rolled back.
func rebootedStep(want func(e *Env) string, retryFrom string) Step {
	return Step{Name: StepRebooted, Timeout: 15 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		if e.Node == nil || !machine.Ready(e.Node) {
			return false, Outcome{Message: "waiting for the machine to come back (" + notReady(e.Node) + ")"}, nil
		}
		if e.Node.Status.NodeInfo.BootID != "" && e.Node.Status.NodeInfo.BootID == e.Machine.BootID {
			return false, Outcome{Message: "waiting for the machine to reboot"}, nil
		}
		if err := e.requireAddress(); err != nil {
			return false, Outcome{}, err
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		boot, err := talos.BootID(cctx, e.Talos, e.Address)
		if err != nil {
			if talos.Unreachable(err) {
				return false, Outcome{Message: "waiting for the Talos API to answer", Recheck: time.Second}, nil
			}
			return false, Outcome{}, err
		}
		if boot == e.Machine.BootID {
			// The Node is Ready and Talos still reports the old boot: the
			// reboot has not begun (Talos answers before it goes down).
			return false, Outcome{Message: "waiting for the machine to reboot", Recheck: time.Second}, nil
		}
		if want == nil || want(e) == "" {
			return true, Outcome{}, nil
		}
		version, err := talos.Version(cctx, e.Talos, e.Address)
		if err != nil {
			return false, Outcome{}, err
		}
		if version != want(e) {
			return false, Outcome{}, &StepError{Reason: "RolledBack", RetryFrom: retryFrom, Err: fmt.Errorf(
				"came back on %s instead of %s: Talos rolled back to the previous boot slot (see `talosctl -n %s dmesg`); a retry installs again",
				version, want(e), e.Address)}
		}
		return true, Outcome{}, nil
	}}
}

// changeNode makes the change that decide asks of the machine's Node as
// one guarded write: the patch carries the resourceVersion of the Node it
// was decided on, so that a change made since (an operator's cordon between
// the read and the write) makes it conflict, and it is decided again on a
// fresh read. The first decision is on the cache's Node, which saves a read
// on every machine's path; a decision to change nothing (decide returns
// nil) is only taken on a fresh read, as the cache may not have the change
// that calls for one yet.
func (e *Env) changeNode(ctx context.Context, decide func(*corev1.Node) map[string]any) error {
	var node *corev1.Node
	if cached := (&corev1.Node{}); e.Kube.Get(ctx, client.ObjectKey{Name: e.Machine.Name}, cached) == nil {
		node = cached
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var patch map[string]any
		if node != nil {
			patch = decide(node)
		}
		if patch == nil {
			// Nothing to change, nothing cached, or a conflict: decide on the API server's Node.
			fresh, err := e.freshNode(ctx)
			if err != nil {
				return err
			}
			if patch = decide(fresh); patch == nil {
				return nil
			}
			node = fresh
		}
		meta, _ := patch["metadata"].(map[string]any)
		if meta == nil {
			meta = map[string]any{}
			patch["metadata"] = meta
		}
		meta["resourceVersion"] = node.ResourceVersion
		node = nil
		return e.patchNode(ctx, patch)
	})
}

// cordonedAt is the resourceVersion of the machine's Node as the API server
// has it now, if it is cordoned ("" if not). A drain lists the pods as of
// that version: no pod is scheduled on a cordoned Node, so those are every
// pod the drain must evict (DaemonSets' pods, which tolerate a cordon, it
// leaves). It reads the API server's Node, not the cache's, whose older
// cordon may have been lifted and set again since.
func (e *Env) cordonedAt(ctx context.Context) (string, error) {
	n, err := e.freshNode(ctx)
	if err != nil || !n.Spec.Unschedulable {
		return "", err
	}
	return n.ResourceVersion, nil
}

// freshNode reads the Node from the API server, not the cache.
func (e *Env) freshNode(ctx context.Context) (*corev1.Node, error) {
	n, err := e.Clientset.CoreV1().Nodes().Get(ctx, e.Machine.Name, metav1GetOptions)
	if err != nil {
		return nil, fmt.Errorf("read node %s: %w", e.Machine.Name, err)
	}
	return n, nil
}

func (e *Env) patchNode(ctx context.Context, patch map[string]any) error {
	b, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := e.Clientset.CoreV1().Nodes().Patch(ctx, e.Machine.Name, types.MergePatchType, b, patchOptions); err != nil {
		return fmt.Errorf("patch node %s: %w", e.Machine.Name, err)
	}
	return nil
}
