package v1alpha1

import (
	"fmt"
	"strings"
)

// Annotations and labels that users and tools set, part of the API.
const (
	// RetryAnnotation on an operation paused by a failed step asks the
	// controller to run the failed step again. Only the value "true" counts.
	RetryAnnotation = "ichor.maesh.dev/retry"
	// RetryRequested is the one value of RetryAnnotation that is acted on.
	RetryRequested = "true"

	// CancelAnnotation on an operation cancels it for good; its value says
	// who asked (kubectl ichor operation cancel writes the requester's user
	// name). Unlike deleting, the record stays.
	CancelAnnotation = "ichor.maesh.dev/cancel"

	// RestoredFromAnnotation marks an operation ichor-controller wrote
	// back from its journal after an etcd restore rewound the store to a
	// snapshot that predates it: a new object (new UID) with the old one's
	// name and spec; its value is the UID the operation had before.
	RestoredFromAnnotation = "ichor.maesh.dev/restored-from-journal"

	// SkipAnnotation on an operation asks the controller to give up on one
	// machine whose step failed (broken hardware) and go on with the rest:
	// its value is the machine's name. The controller acts on it once, like
	// a retry request: it marks the machine Skipped ("skipped by ..."),
	// lifts Ichor's cordon on it when SkipUncordonAnnotation says so, and
	// removes the request's annotations. A request it cannot act on (no
	// such machine, a machine whose step did not fail) is removed with a
	// SkipIgnored Event saying why.
	SkipAnnotation = "ichor.maesh.dev/skip"
	// SkipByAnnotation beside SkipAnnotation names who asked (kubectl ichor
	// operation skip writes the requester's user name); "an operator" when
	// absent.
	SkipByAnnotation = "ichor.maesh.dev/skip-by"
	// SkipUncordonAnnotation set to "true" beside SkipAnnotation also lifts
	// Ichor's cordon on the skipped machine; without it the cordon stays.
	SkipUncordonAnnotation = "ichor.maesh.dev/skip-uncordon"

	// PlanApprovedAnnotation records the plan a person approved before the
	// operation started: its value is the PlanFingerprint of the plan shown
	// (kubectl ichor --plan sets it as it resumes the operation). The
	// controller starts the operation only on that plan: when the cluster
	// changed meanwhile and the plan made again differs, it holds the
	// operation (reason PlanChanged) until the new plan is approved.
	PlanApprovedAnnotation = "ichor.maesh.dev/plan-approved"

	// UpgradeHoldAnnotation on a Node skips that machine (machine phase Skipped).
	UpgradeHoldAnnotation = "ichor.maesh.dev/upgrade-hold"
	// UpgradeOrderLabel (an integer) on a Node sorts machines within their tier.
	UpgradeOrderLabel = "ichor.maesh.dev/upgrade-order"

	// Finalizer keeps an operation until the step in flight has settled and
	// the cluster lock is let go.
	Finalizer = "ichor.maesh.dev/operation"

	// ControlPlaneLabel marks control-plane Nodes.
	ControlPlaneLabel = "node-role.kubernetes.io/control-plane"

	// JobOperationUIDLabel on a Job (and its pods) names the UID of the
	// operation that started it: the watch finds an operation's Jobs by it.
	JobOperationUIDLabel = "ichor.maesh.dev/operation-uid"
)

// Objects in the controller's namespace that the plugin reads too.
const (
	// DefaultNamespace is where ichor-controller runs.
	DefaultNamespace = "ichor-system"
	// LockLeaseName is the coordination.k8s.io/v1 Lease that is the cluster lock.
	LockLeaseName = "ichor-cluster-lock"
	// LeaderLeaseName is the controller's leader-election Lease (not the cluster lock).
	LeaderLeaseName = "ichor-controller-leader"
	// VersionAnnotation on the leader Lease carries the leading controller's version.
	VersionAnnotation = "ichor.maesh.dev/version"
	// KindsAnnotation on the leader Lease lists the kinds the leading
	// controller carries out, comma-separated (FormatKinds, ParseKinds).
	KindsAnnotation = "ichor.maesh.dev/kinds"
	// TalosconfigSecret (key TalosconfigKey) holds the controller's talosconfig.
	TalosconfigSecret = "ichor-talosconfig"
	TalosconfigKey    = "talosconfig"
)

// Cluster lock holder identities.
const (
	lockIdentityPrefix = "ichor-controller/"
	opIdentityPrefix   = lockIdentityPrefix + "op/"
	machineIdentity    = lockIdentityPrefix + "machine/"
	jobIdentityPrefix  = "job/"
)

// OperationIdentity is the cluster lock holder identity of an operation.
func OperationIdentity(namespace, name string) string {
	return fmt.Sprintf("%s%s/%s", opIdentityPrefix, namespace, name)
}

// MachineIdentity is the cluster lock holder identity of a control-plane join
// or removal.
func MachineIdentity(node string) string { return machineIdentity + node }

// JobIdentity is the cluster lock holder identity of a Job (the Cilium Helm Job).
func JobIdentity(namespace, name string) string {
	return fmt.Sprintf("%s%s/%s", jobIdentityPrefix, namespace, name)
}

// DangerousKind reports whether starting an operation of this kind (and
// action, for kind node) can take the cluster down, so that it needs the
// start verb on its own subresource.
func DangerousKind(kind OperationKind, action NodeActionType) bool {
	switch kind {
	case KindShutdown, KindCARotation, KindKeyRotation, KindEtcdRestore:
		return true
	case KindNode:
		return action == NodeReset
	}
	return false
}

// Afterwards says what an operator must do once an operation of spec has
// succeeded ("" when nothing): the controller appends it to the message
// of a succeeded operation, and the plugin shows it.
func Afterwards(spec TalosOperationSpec) string {
	switch spec.Kind {
	case KindCARotation:
		return caAfterwards(spec)
	case KindKeyRotation:
		return keysAfterwards(spec)
	}
	return ""
}

func caAfterwards(spec TalosOperationSpec) string {
	talos, kubernetes := spec.CARotation.Rotates()
	var out []string
	if talos {
		out = append(out, "a talosconfig of the old Talos API CA is refused by every machine since the old CA was dropped: "+
			"take the new one from Secret "+TalosconfigSecret+" in the controller's namespace (`kubectl -n "+DefaultNamespace+
			" get secret "+TalosconfigSecret+" -o jsonpath='{.data.talosconfig}' | base64 -d > talosconfig`), "+
			"or mint your own with it from a control plane (`talosctl --talosconfig talosconfig -n <control plane> config new --roles os:admin my-talosconfig`)")
	}
	if kubernetes {
		out = append(out, "a kubeconfig of the old Kubernetes CA (its client certificate, and its trust in the old CA) is refused by the API servers since the old CA was dropped: "+
			"replace it with a new one from a control plane (`talosctl -n <control plane> kubeconfig --force`); "+
			"ServiceAccount tokens keep working, and pods read the new CA from ConfigMap kube-root-ca.crt when they restart")
	}
	return strings.Join(out, "; ")
}

func keysAfterwards(spec TalosOperationSpec) string {
	sa, secretbox := spec.KeyRotation.Rotates()
	var out []string
	if sa {
		restarted := "the pods Ichor restarted have new ones; restart those it could not (bare pods and Jobs' pods, named in the restart stage)"
		if !spec.KeyRotation.Restarts() {
			restarted = "restart every pod that talks to the API (spec.keyRotation.restartWorkloads was false)"
		}
		out = append(out, "every ServiceAccount token signed with the old service-account key is refused since the swap: "+restarted+
			"; legacy token Secrets were reissued, so copies of them kept outside the cluster must be read again; "+
			"tokens made outside the cluster (`kubectl create token`, CI systems) must be made again")
	}
	if secretbox {
		out = append(out, "every Secret is now encrypted with the new secretbox key, and the old key is gone from the cluster: "+
			"an etcd snapshot taken before the rotation holds Secrets the API servers can no longer read, "+
			"so take a new snapshot now (`talosctl -n <control plane> etcd snapshot db.snapshot`) and keep the old machine configuration "+
			"only for as long as you may restore an older one")
	}
	return strings.Join(out, "; ")
}
