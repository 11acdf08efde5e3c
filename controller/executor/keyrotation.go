package executor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
)

// KeyRotation replaces the cluster's service-account signing key and the
// secretbox key Secrets are encrypted with at rest: keys Talos keeps in
// the control planes' cluster section (cluster.serviceAccount.key,
// cluster.secretboxEncryptionSecret, cluster.aescbcEncryptionSecret) and
// renders for kube-apiserver and kube-controller-manager, which restart
// on a change (TALOS_API.md §4.2). Each key's new value is made and
// stored in a Secret of the controller's namespace before any machine
// changes, so a controller killed at any point resumes with the same one.
//
// The service-account key is a cut-over (Talos 1.13 holds one key): the
// new key on every control plane back to back, then the pods whose
// projected tokens the old key signed restarted within their budgets, and
// legacy token Secrets reissued (keyrotation_sa.go).
//
// The secretbox key is rotated without a moment in which any Secret is
// unreadable, through the aescbc slot as a bridge (secretbox.go).
//
// It is a Planner: an operation created paused says, per machine, which
// keys it takes and which pods restart.
type KeyRotation struct {
	// plans caches each machine's plan for a while: preflight runs on
	// every turn of an operation that waits, and a plan lists the
	// machine's pods. Nil plans afresh every time.
	plans *planCache
}

// NewKeyRotation returns the key-rotation kind's executor.
func NewKeyRotation() KeyRotation {
	return KeyRotation{plans: &planCache{ttl: time.Minute, m: map[string]planEntry{}}}
}

// Target implements Executor.
func (KeyRotation) Target(op *ichorv1.TalosOperation) (string, string) {
	switch sa, secretbox := op.Spec.KeyRotation.Rotates(); {
	case sa && secretbox:
		return "service-account and secretbox key rotation", ""
	case secretbox:
		return "secretbox key rotation", ""
	}
	return "service-account key rotation", ""
}

// Scope implements Executor: the control planes, which hold the keys, and,
// when the workloads restart, the workers too (their pods restart).
func (KeyRotation) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: a key rotation changes every control plane (the API servers must agree on the keys); remove spec.machines")
	}
	if op.Spec.KeyRotation.Restarts() {
		return nodes, nil
	}
	var out []*corev1.Node
	for _, n := range nodes {
		if machine.Role(n) == ichorv1.RoleControlPlane {
			out = append(out, n)
		}
	}
	return out, nil
}

// HonourHold implements Executor: every control plane must take the keys,
// and a pod left on a held machine would keep a token no API server accepts.
func (KeyRotation) HonourHold() bool { return false }

// Check implements Executor with the refusals of Plan, each naming the
// machine.
func (k KeyRotation) Check(ctx context.Context, e *Env) []string {
	out := k.refusals(ctx, e)
	for i := range out {
		out[i] = e.Machine.Name + ": " + out[i]
	}
	return out
}

// Plan implements Planner: a control plane takes the new keys (its API
// server restarts), and when the workloads restart, the machine's pods
// that hold a ServiceAccount token restart, by workload, and those that
// cannot be restarted are named; within a machine's message.
func (k KeyRotation) Plan(ctx context.Context, e *Env) (string, []string) {
	key := fmt.Sprintf("%s/%d/%s", e.Op.UID, e.Op.Generation, e.Machine.Name)
	if k.plans != nil {
		if p, ok := k.plans.get(key); ok {
			return p.plan, p.refusals
		}
	}
	p := planEntry{plan: k.plan(ctx, e), refusals: k.refusals(ctx, e)}
	if k.plans != nil {
		k.plans.put(key, p)
	}
	return p.plan, p.refusals
}

// plan is the machine's plan, as Plan shows it.
func (KeyRotation) plan(ctx context.Context, e *Env) string {
	var parts []string
	if e.Machine.Role == ichorv1.RoleControlPlane {
		parts = append(parts, "takes the new "+keyWords(e.Op.Spec.KeyRotation)+" (its API server restarts)")
	}
	if e.Op.Spec.KeyRotation.Restarts() {
		const prefix = "plan: "
		budget := ichorv1.MachineMessageMax - len(prefix) - len(strings.Join(parts, "; ")) - len("; ")
		p, err := planRestart(ctx, e, time.Time{})
		if err != nil {
			parts = append(parts, fmt.Sprintf("restarts the pods that hold a ServiceAccount token (they could not be listed now: %v)", err))
		} else {
			parts = append(parts, p.words("restarts", "restarts no pod", budget))
		}
	}
	return "plan: " + strings.Join(parts, "; ")
}

// keyWords names the keys a rotation replaces.
func keyWords(k *ichorv1.KeyRotation) string {
	switch sa, secretbox := k.Rotates(); {
	case sa && secretbox:
		return "service-account and secretbox keys"
	case secretbox:
		return "secretbox key"
	}
	return "service-account key"
}

// refusals are the machine's refusals, without its name. A control plane
// must be up and its API server running (each takes the keys in turn and
// restarts its API server; one down would come back with the old keys, or
// none), and a worker whose pods restart must be up (an eviction there
// waits for a kubelet that does not answer); the first control plane also
// answers for the cluster's keys.
func (KeyRotation) refusals(ctx context.Context, e *Env) []string {
	cp := e.Machine.Role == ichorv1.RoleControlPlane
	switch {
	case e.Node != nil && !machine.Ready(e.Node) && cp:
		return []string{"not Ready: every control plane takes the new keys and restarts its API server, so bring it back first"}
	case e.Node != nil && !machine.Ready(e.Node):
		return []string{"not Ready: its pods cannot restart onto tokens of the new service-account key while its kubelet does not answer; " +
			"bring it back first, or set spec.keyRotation.restartWorkloads: false and restart its pods yourself"}
	case !cp:
		return nil
	}
	var out []string
	sa, secretbox := e.Op.Spec.KeyRotation.Rotates()
	if sa {
		out = append(out, saChecks(ctx, e)...)
	}
	if secretbox {
		out = append(out, secretboxChecks(ctx, e)...)
	}
	return out
}

// Stages implements Stager: the service-account key's stages, then the
// secretbox key's.
func (KeyRotation) Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus {
	sa, secretbox := op.Spec.KeyRotation.Rotates()
	var out []ichorv1.StageStatus
	if sa {
		out = append(out, saStages(op.Spec.KeyRotation.Restarts())...)
	}
	if secretbox {
		out = append(out, secretboxStages()...)
	}
	return out
}

// Steps implements Executor.
func (KeyRotation) Steps(op *ichorv1.TalosOperation, _ *ichorv1.MachineStatus) []Step {
	if steps := saSteps(op.Status.Stage); steps != nil {
		return steps
	}
	return secretboxSteps(op.Status.Stage)
}
