// Package machine reads what Ichor needs to know of a machine from its
// Kubernetes Node: role, Talos node address, readiness, versions.
package machine

import (
	corev1 "k8s.io/api/core/v1"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Role is controlplane for Nodes with the control-plane role label, worker otherwise.
func Role(n *corev1.Node) ichorv1.MachineRole {
	if _, ok := n.Labels[ichorv1.ControlPlaneLabel]; ok {
		return ichorv1.RoleControlPlane
	}
	return ichorv1.RoleWorker
}

// Address is the Node's InternalIP, which is its Talos node address.
func Address(n *corev1.Node) string {
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			return a.Address
		}
	}
	return ""
}

// Ready reports whether the Node's Ready condition is True.
func Ready(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// TalosVersion is the version in the Node's OS image, "Talos (v1.12.4)", or
// "" when the Node does not run Talos.
func TalosVersion(n *corev1.Node) string {
	v, err := compat.ParseOSImage(n.Status.NodeInfo.OSImage)
	if err != nil {
		return ""
	}
	return v.String()
}

// KubeletVersion is the kubelet version the Node reports.
func KubeletVersion(n *corev1.Node) string { return n.Status.NodeInfo.KubeletVersion }
