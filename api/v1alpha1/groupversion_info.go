// Package v1alpha1 holds the TalosOperation API: the contract between the
// kubectl-ichor plugin, the ichor-controller and anything else (GitOps,
// kubectl) that starts operations.
//
// +kubebuilder:object:generate=true
// +groupName=ichor.maesh.dev
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the API group and version of TalosOperation.
	GroupVersion = schema.GroupVersion{Group: "ichor.maesh.dev", Version: "v1alpha1"}

	// SchemeBuilder registers the types of this package with a scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds the types of this package to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Resource is the plural resource name, as RBAC rules and the API paths spell it.
const Resource = "talosoperations"

func init() {
	SchemeBuilder.Register(&TalosOperation{}, &TalosOperationList{})
}
