package v1alpha1

import (
	"fmt"
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
	return fmt.Sprintf("this ichor-controller does not carry out kind %s yet (it carries out %s); nothing ran",
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
