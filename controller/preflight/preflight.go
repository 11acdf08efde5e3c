// Package preflight decides whether an upgrade may start: the target is a
// final version newer than what runs, within the Talos and Kubernetes skew
// rules (machinery's compatibility package, the rules talosctl applies), and
// the Talos x Kubernetes x Cilium combination after the operation is in
// Ichor's compatibility table. It is pure: the controller gathers the facts
// (Cluster), calls Check before it takes the cluster lock and again once it
// holds it, and owns what follows (Refused, or spec.override).
package preflight

import (
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

// Check names. Each failed check is reported once, under its name, which is
// stable: it is the condition type on a Refused operation and appears in the
// PreflightOverridden Event.
const (
	// MachinesInScope: at least one machine is in scope.
	MachinesInScope = "MachinesInScope"
	// VersionsReadable: every version the checks need could be read.
	VersionsReadable = "VersionsReadable"

	TalosVersionValid        = "TalosVersionValid"
	TalosVersionFinal        = "TalosVersionFinal"
	TalosVersionKnown        = "TalosVersionKnown"
	TalosVersionNewer        = "TalosVersionNewer"
	TalosMinorSkip           = "TalosMinorSkip"
	TalosUpgradeableFrom     = "TalosUpgradeableFrom"
	TalosKubernetesSupported = "TalosKubernetesSupported"

	KubernetesVersionValid   = "KubernetesVersionValid"
	KubernetesVersionFinal   = "KubernetesVersionFinal"
	KubernetesVersionKnown   = "KubernetesVersionKnown"
	KubernetesVersionNewer   = "KubernetesVersionNewer"
	KubernetesMinorSkip      = "KubernetesMinorSkip"
	KubernetesTalosSupported = "KubernetesTalosSupported"
	KubeletSkew              = "KubeletSkew"
	// KubernetesRemovedItems: nothing the upgrade removes (feature gates,
	// flags, API resources; removed.yaml) is still in use.
	KubernetesRemovedItems = "KubernetesRemovedItems"

	CiliumChartShipped = "CiliumChartShipped"
	CiliumVersionNewer = "CiliumVersionNewer"
	CiliumMinorSkip    = "CiliumMinorSkip"

	IchorVersionValid = "IchorVersionValid"
	IchorVersionFinal = "IchorVersionFinal"
	IchorVersionNewer = "IchorVersionNewer"

	// CompatibilityTable: the combination after the operation is in the table.
	CompatibilityTable = "CompatibilityTable"
)

// Checks lists every check name, in the order Check reports failures.
var Checks = []string{
	TalosVersionValid, KubernetesVersionValid, MachinesInScope, VersionsReadable,
	TalosVersionFinal, TalosVersionKnown, TalosVersionNewer, TalosMinorSkip, TalosUpgradeableFrom,
	TalosKubernetesSupported,
	KubernetesVersionFinal, KubernetesVersionKnown, KubernetesVersionNewer, KubernetesMinorSkip,
	KubernetesTalosSupported, KubeletSkew, KubernetesRemovedItems,
	CiliumChartShipped, CiliumVersionNewer, CiliumMinorSkip,
	IchorVersionValid, IchorVersionFinal, IchorVersionNewer,
	CompatibilityTable,
}

// Event reasons the controller uses for preflight.
const (
	// EventRefused is the Warning Event of a Refused operation.
	EventRefused = "PreflightRefused"
	// EventOverridden is the Warning Event of an operation that runs although
	// preflight refused it, because spec.override is true.
	EventOverridden = "PreflightOverridden"
	// ConditionReason is the reason of each failed check's condition.
	ConditionReason = "PreflightFailed"
)

// Machine is what the controller knows of one machine.
type Machine struct {
	// Name is the Node name.
	Name string
	Role v1alpha1.MachineRole
	// Talos is the running Talos version, "v1.12.4" (compat.ParseOSImage
	// reads it from the Node's osImage).
	Talos string
	// Kubelet is the Node's kubeletVersion, "v1.35.2".
	Kubelet string
}

// Cluster is what the controller gathered before asking.
type Cluster struct {
	// Machines are the machines in scope: the Nodes spec.machines selects.
	Machines []Machine
	// Others are the Nodes out of scope. They keep their versions, so their
	// Talos must support a new Kubernetes and their kubelets count for skew.
	Others []Machine
	// ControlPlane is the Kubernetes version the cluster runs, "v1.35.2":
	// the lowest among the control-plane mirror pods and kube-proxy
	// (RunningKubernetes), as talosctl upgrade-k8s detects it.
	ControlPlane string
	// Configured is what the configurations of the machines in scope give
	// the components (ConfiguredIn each), for kind kubernetes.
	Configured []Configured
	// InUse counts the objects stored in each API resource the upgrade
	// removes, by "resource.version.group", for kind kubernetes.
	InUse map[string]int
	// Unreadable names what the controller could not read for the
	// removed-items checks ("the configuration of cp-1: ..."): reported
	// under VersionsReadable.
	Unreadable []string
	// Cilium is the version of the Cilium Ichor installed, "" when it
	// installed none. For kind cni, the Cilium that runs.
	Cilium string
	// CiliumChart is the version of the chart this Ichor ships ("" reads
	// the table's pin).
	CiliumChart string
	// Ichor is the running controller's version (kind ichor).
	Ichor string
}

// Failure is one failed check.
type Failure struct {
	// Check is the check's name, one of Checks.
	Check string
	// Message says what is wrong and what would pass.
	Message string
}

// Check runs the checks of the operation's kind and returns the failures, in
// the order of Checks; none means the operation may run. Kinds other than
// talos, kubernetes, cni and ichor have no version checks. A nil table is the embedded one.
func Check(spec v1alpha1.TalosOperationSpec, c Cluster, t *compat.Table) []Failure {
	if t == nil {
		var err error
		if t, err = compat.Default(); err != nil {
			// The embedded table is checked by its tests; this is a broken build.
			panic(err)
		}
	}
	var r report
	switch spec.Kind {
	case v1alpha1.KindTalos:
		checkTalos(&r, spec.Talos, c, t)
	case v1alpha1.KindKubernetes:
		checkKubernetes(&r, spec.Kubernetes, c, t)
	case v1alpha1.KindCNI:
		checkCNI(&r, spec.CNI, c, t)
	case v1alpha1.KindIchor:
		checkIchor(&r, spec.Ichor, c)
	default:
		return nil
	}
	return r.sorted()
}

// Names joins the names of the failed checks: "TalosMinorSkip, CompatibilityTable".
func Names(failures []Failure) string {
	names := make([]string, len(failures))
	for i, f := range failures {
		names[i] = f.Check
	}
	return strings.Join(names, ", ")
}

// RefusedMessage is the phase message of a refused operation, which its
// standard conditions and the PreflightRefused Event carry too: the names of
// the failed checks and, last, the override where it helps. Each check's
// own message (what would pass) is in its condition only.
func RefusedMessage(failures []Failure) string {
	names := make([]string, len(failures))
	for i, f := range failures {
		names[i] = f.Check
	}
	return v1alpha1.RefusedSummary(names)
}

// Overridable reports whether spec.override runs an operation these checks
// refuse: not when there is nothing to run (no kind this controller carries
// out, no machine, no version) or nothing else to install.
func Overridable(failures []Failure) bool {
	names := make([]string, len(failures))
	for i, f := range failures {
		names[i] = f.Check
	}
	return v1alpha1.OverrideHelps(names)
}

// OverriddenMessage is the message of the PreflightOverridden Warning Event.
func OverriddenMessage(failures []Failure) string {
	return "spec.override is true: running although preflight refused it; bypassed checks: " + Names(failures)
}

// Conditions are the conditions a Refused operation carries, one per failed
// check: type the check's name, status False.
func Conditions(failures []Failure, generation int64, now metav1.Time) []metav1.Condition {
	conds := make([]metav1.Condition, len(failures))
	for i, f := range failures {
		conds[i] = metav1.Condition{
			Type: f.Check, Status: metav1.ConditionFalse, Reason: ConditionReason,
			Message: f.Message, ObservedGeneration: generation, LastTransitionTime: now,
		}
	}
	return conds
}
