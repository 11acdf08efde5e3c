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
	"k8s.io/kubectl/pkg/drain"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/talos"
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

func etcdHealthStep() Step {
	return Step{Name: StepEtcdHealth, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := talos.EtcdHealth(ctx, e.Talos, e.ControlPlanes); err != nil {
			return Outcome{}, Fail("EtcdUnhealthy", "etcd is not healthy: %w", err)
		}
		return Outcome{}, nil
	}}
}

func cordonStep() Step {
	return Step{Name: StepCordon, Timeout: time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		node, err := e.freshNode(ctx)
		if err != nil {
			return Outcome{}, err
		}
		if node.Spec.Unschedulable {
			// Already cordoned: by us (a rerun) or by someone else, whose cordon we leave alone.
			return Outcome{}, nil
		}
		patch := map[string]any{
			"metadata": map[string]any{"annotations": map[string]any{CordonedByAnnotation: e.Identity}},
			"spec":     map[string]any{"unschedulable": true},
		}
		return Outcome{}, e.patchNode(ctx, patch)
	}}
}

func uncordonStep() Step {
	return Step{Name: StepUncordon, Timeout: time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		node, err := e.freshNode(ctx)
		if err != nil {
			return Outcome{}, err
		}
		if node.Annotations[CordonedByAnnotation] != e.Identity {
			return Outcome{}, nil
		}
		patch := map[string]any{
			"metadata": map[string]any{"annotations": map[string]any{CordonedByAnnotation: nil}},
			"spec":     map[string]any{"unschedulable": false},
		}
		return Outcome{}, e.patchNode(ctx, patch)
	}}
}

func drainStep() Step {
	return Step{Name: StepDrain, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		d := e.Op.Spec.Drain
		timeout := 5 * time.Minute
		if d != nil && d.Timeout != nil {
			timeout = d.Timeout.Duration
		}
		err := runDrain(ctx, e, timeout, false)
		if err == nil {
			return Outcome{}, nil
		}
		if d != nil && d.OnTimeout == ichorv1.DrainForce {
			e.Log.Info("drain did not finish in time; deleting the remaining pods, ignoring PodDisruptionBudgets", "machine", e.Machine.Name, "err", err)
			if err := runDrain(ctx, e, timeout, true); err != nil {
				return Outcome{}, Fail("DrainFailed", "forced drain: %w", err)
			}
			return Outcome{Message: "drain timed out; remaining pods deleted (onTimeout: force)"}, nil
		}
		return Outcome{}, Fail("DrainFailed", "%w (set spec.drain.onTimeout: force to delete the remaining pods, or fix what blocks eviction and retry)", err)
	}}
}

func runDrain(ctx context.Context, e *Env, timeout time.Duration, force bool) error {
	h := &drain.Helper{
		Ctx:                 ctx,
		Client:              e.Clientset,
		Force:               true, // bare pods would not survive the reboot either
		GracePeriodSeconds:  -1,
		IgnoreAllDaemonSets: true,
		DeleteEmptyDirData:  true,
		Timeout:             timeout,
		DisableEviction:     force,
		Out:                 logWriter{e.Log},
		ErrOut:              logWriter{e.Log},
	}
	return drain.RunNodeDrain(h, e.Machine.Name)
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
			return false, Outcome{Message: "waiting for the machine to come back"}, nil
		}
		if e.Node.Status.NodeInfo.BootID != "" && e.Node.Status.NodeInfo.BootID == e.Machine.BootID {
			return false, Outcome{Message: "waiting for the machine to reboot"}, nil
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

// freshNode reads the Node from the API server, not the cache, before changing it.
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
