package v1alpha1

import (
	"fmt"
	"slices"
	"strings"
)

// Checks that the plugin makes as well, before it creates an operation, with
// the messages the controller's preflight gives: the plugin refuses what it
// can know is wrong with the controller's own words. The controller stays
// the authority.
const (
	// CheckKindSupported: the running controller carries out the kind.
	CheckKindSupported = "KindSupported"
	// CheckMachinesInScope: at least one machine is in scope.
	CheckMachinesInScope = "MachinesInScope"
)

// KindNotCarriedOut is the message of a failed KindSupported check.
func KindNotCarriedOut(kind OperationKind, carried []OperationKind) string {
	names := make([]string, len(carried))
	for i, k := range carried {
		names[i] = string(k)
	}
	return fmt.Sprintf("this ichor-controller does not carry out kind %s yet (it carries out %s)",
		kind, strings.Join(names, ", "))
}

// MachineNotANode is the message of a failed MachinesInScope check for a
// kind that names its machine (spec.node.machine): selected says
// spec.machines narrows the Nodes.
func MachineNotANode(name string, selected bool) string {
	if selected {
		return fmt.Sprintf("machine %s is not a Node that spec.machines selects: check the name (`kubectl get nodes`) or drop the selector", name)
	}
	return fmt.Sprintf("machine %s is not a Node of this cluster: check the name with `kubectl get nodes`", name)
}

// ParseKinds reads the kinds annotation of the leader Lease, keeping the
// kinds this API knows.
func ParseKinds(s string) []OperationKind {
	var out []OperationKind
	for _, k := range strings.Split(s, ",") {
		for _, known := range Kinds {
			if OperationKind(strings.TrimSpace(k)) == known {
				out = append(out, known)
			}
		}
	}
	return out
}

// FormatKinds writes the kinds annotation of the leader Lease.
func FormatKinds(kinds []OperationKind) string {
	names := make([]string, len(kinds))
	for i, k := range kinds {
		names[i] = string(k)
	}
	return strings.Join(names, ",")
}

// A refusal's words, shared by the controller (the phase message, the
// standard conditions and the PreflightRefused Event carry RefusedSummary)
// and the plugin (which prints each failed check's condition once, then the
// override hint): the full text of a check lives only in its condition.

// notOverridable are the checks spec.override cannot get past: there is
// nothing to run (no kind, no machine, no version to install) or nothing
// else the controller could install (a chart it does not ship).
var notOverridable = []string{CheckKindSupported, CheckMachinesInScope,
	"TalosVersionValid", "KubernetesVersionValid", "IchorVersionValid", "CiliumChartShipped"}

// NotOverridable lists the checks spec.override cannot get past.
func NotOverridable() []string { return slices.Clone(notOverridable) }

// OverrideHelps reports whether spec.override would run an operation these
// failed checks refuse.
func OverrideHelps(checks []string) bool {
	for _, c := range checks {
		if slices.Contains(notOverridable, c) {
			return false
		}
	}
	return len(checks) > 0
}

// OverrideHint is the last words of a refusal spec.override can get past.
const OverrideHint = "to run it anyway, an ichor-admin sets spec.override: true"

// RefusedSummary is the phase message of a refused operation: which checks
// failed, that nothing ran and, last and only where it helps, the override.
// What would pass is in each check's condition, not repeated here.
func RefusedSummary(checks []string) string {
	failed := "check " + andJoin(checks) + " failed (its condition says what would pass)"
	if len(checks) > 1 {
		failed = "checks " + andJoin(checks) + " failed (each one's condition says what would pass)"
	}
	msg := "preflight refused it, nothing ran: " + failed
	if OverrideHelps(checks) {
		msg += "; " + OverrideHint
	}
	return msg
}

// andJoin joins names as "a, b and c".
func andJoin(items []string) string {
	if len(items) <= 1 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " and " + items[len(items)-1]
}
