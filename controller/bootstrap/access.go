package bootstrap

import (
	"context"
	"fmt"
	"strings"

	authorizationv1 "k8s.io/api/authorization/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	authorizationclient "k8s.io/client-go/kubernetes/typed/authorization/v1"

	"maesh.dev/ichor/controller/inventory"
)

// syncVerbs are what the sync's server-side apply needs on each object, by
// name: it reads the object, patches it, and creates it if it is missing
// (an apply that creates is authorized as a create of that name).
var syncVerbs = []string{"get", "patch", "create"}

// Denied asks the API server, as the caller, whether it may apply each of
// objs as Sync does (SelfSubjectAccessReview, so every authorizer has its
// say), and returns what it may not, one line per object: "ConfigMap
// default/extra (create, patch)". An object whose kind the API server does
// not serve yet (a custom resource whose definition the same sync creates)
// is left to the sync.
func Denied(ctx context.Context, mapper meta.RESTMapper, reviews authorizationclient.SelfSubjectAccessReviewInterface, objs []*unstructured.Unstructured) ([]string, error) {
	var out []string
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if meta.IsNoMatchError(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("map %s to its resource: %w", gvk, err)
		}
		what := describe(inventory.Ref(gvk.Group, gvk.Kind, o.GetNamespace(), o.GetName()))
		var missing []string
		for _, verb := range syncVerbs {
			review := &authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{
				ResourceAttributes: &authorizationv1.ResourceAttributes{
					Verb: verb, Group: mapping.Resource.Group, Version: mapping.Resource.Version,
					Resource: mapping.Resource.Resource, Namespace: o.GetNamespace(), Name: o.GetName(),
				}}}
			got, err := reviews.Create(ctx, review, metav1.CreateOptions{})
			if err != nil {
				return nil, fmt.Errorf("ask whether the controller may %s %s: %w", verb, what, err)
			}
			if !got.Status.Allowed {
				missing = append(missing, verb)
			}
		}
		if len(missing) > 0 {
			out = append(out, fmt.Sprintf("%s (%s)", what, strings.Join(missing, ", ")))
		}
	}
	return out, nil
}
