package executor

import (
	"context"
	"errors"
	"fmt"

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
type KeyRotation struct{}

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
func (KeyRotation) Scope(op *ichorv1.TalosOperation, nodes []corev1.Node) ([]corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: a key rotation changes every control plane (the API servers must agree on the keys); remove spec.machines")
	}
	if op.Spec.KeyRotation.Restarts() {
		return nodes, nil
	}
	var out []corev1.Node
	for i := range nodes {
		if machine.Role(&nodes[i]) == ichorv1.RoleControlPlane {
			out = append(out, nodes[i])
		}
	}
	return out, nil
}

// HonourHold implements Executor: every control plane must take the keys,
// and a pod left on a held machine would keep a token no API server accepts.
func (KeyRotation) HonourHold() bool { return false }

// Check implements Executor: a control plane must be up and its API server
// running (each takes the keys in turn and restarts its API server; one
// down would come back with the old keys, or none).
func (KeyRotation) Check(ctx context.Context, e *Env) []string {
	if e.Machine.Role != ichorv1.RoleControlPlane {
		return nil
	}
	if e.Node != nil && !machine.Ready(e.Node) {
		return []string{fmt.Sprintf("%s is not Ready: every control plane takes the new keys and restarts its API server, so bring it back first", e.Machine.Name)}
	}
	if _, secretbox := e.Op.Spec.KeyRotation.Rotates(); secretbox {
		return secretboxChecks(ctx, e)
	}
	return nil
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
