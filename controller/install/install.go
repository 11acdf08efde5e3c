// Package install is `ichor-controller install`, the ichor kind's installer
// Job: it applies the manifests embedded in this very binary (the kustomize
// output of manifests/, its version's) with server-side apply, CRD first,
// after checking that its CRD serves every version the cluster stores.
// The Deployment's rollout then replaces the controller's pods; the new
// version finishes the operation.
package install

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/spf13/cobra"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/manifests"
)

// FieldManager is the installer's server-side apply field manager.
const FieldManager = "ichor-installer"

var scheme = runtime.NewScheme()

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(apiextensionsv1.AddToScheme(scheme))
}

// Options of `install`.
type Options struct {
	// Image is the controller image the Deployment gets ("" keeps the release's).
	Image string
	// DryRun checks and prints what would be applied, changing nothing.
	DryRun bool
	// Client is the cluster; nil reads the kubeconfig.
	Client client.Client
	Out    io.Writer
}

// New returns the `install` command.
func New() *cobra.Command {
	o := &Options{}
	cmd := &cobra.Command{
		Use:   "install [--image IMAGE]",
		Short: "Apply this version's manifests (the ichor kind's installer Job)",
		Long: `Apply the manifests this binary carries (the kustomize output of Ichor's
manifests/ at its version) with server-side apply: the CRD first, once it
serves every version of TalosOperation the cluster stores, then the rest.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Out = cmd.OutOrStdout()
			if o.Client == nil {
				cfg, err := ctrl.GetConfig()
				if err != nil {
					return fmt.Errorf("kubeconfig: %w", err)
				}
				if o.Client, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
					return err
				}
			}
			return o.Run(cmd.Context())
		},
	}
	cmd.Flags().StringVar(&o.Image, "image", "", "the controller image of the Deployment (default: the release's)")
	cmd.Flags().BoolVar(&o.DryRun, "dry-run", false, "check and list what would be applied, changing nothing")
	return cmd
}

// Run checks and applies the manifests.
func (o *Options) Run(ctx context.Context) error {
	objs, err := manifests.Objects(o.Image)
	if err != nil {
		return err
	}
	crds, namespaces, rest := split(objs)
	for _, crd := range crds {
		if err := checkCRD(ctx, o.Client, crd); err != nil {
			return err
		}
	}
	if o.DryRun {
		for _, u := range objs {
			fmt.Fprintf(o.Out, "would apply %s %s\n", u.GetKind(), name(u))
		}
		return nil
	}
	for _, group := range [][]*unstructured.Unstructured{crds, namespaces} {
		if err := o.apply(ctx, group); err != nil {
			return err
		}
	}
	for _, crd := range crds {
		if err := established(ctx, o.Client, crd.GetName()); err != nil {
			return err
		}
	}
	if err := o.apply(ctx, rest); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "applied %d objects; the Deployment %s rolls out the new controller\n", len(objs), manifests.Deployment)
	return nil
}

// split orders the objects: CRDs, then Namespaces, then the rest.
func split(objs []*unstructured.Unstructured) (crds, namespaces, rest []*unstructured.Unstructured) {
	for _, u := range objs {
		switch u.GetKind() {
		case "CustomResourceDefinition":
			crds = append(crds, u)
		case "Namespace":
			namespaces = append(namespaces, u)
		default:
			rest = append(rest, u)
		}
	}
	return crds, namespaces, rest
}

func name(u *unstructured.Unstructured) string {
	if u.GetNamespace() != "" {
		return u.GetNamespace() + "/" + u.GetName()
	}
	return u.GetName()
}

func (o *Options) apply(ctx context.Context, objs []*unstructured.Unstructured) error {
	for _, u := range objs {
		u = u.DeepCopy()
		if err := o.Client.Patch(ctx, u, client.Apply, client.FieldOwner(FieldManager), client.ForceOwnership); err != nil { //nolint:staticcheck // Apply of unstructured objects
			return fmt.Errorf("apply %s %s: %w", u.GetKind(), name(u), err)
		}
		fmt.Fprintf(o.Out, "applied %s %s\n", u.GetKind(), name(u))
	}
	return nil
}

// checkCRD refuses a CRD that would stop serving a version the cluster
// stores TalosOperations in: the API server would refuse the update, or the
// stored objects could no longer be read.
func checkCRD(ctx context.Context, c client.Client, u *unstructured.Unstructured) error {
	var next apiextensionsv1.CustomResourceDefinition
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &next); err != nil {
		return err
	}
	var cur apiextensionsv1.CustomResourceDefinition
	err := c.Get(ctx, client.ObjectKey{Name: next.Name}, &cur)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read CRD %s: %w", next.Name, err)
	}
	var served []string
	for _, v := range next.Spec.Versions {
		if v.Served {
			served = append(served, v.Name)
		}
	}
	for _, stored := range cur.Status.StoredVersions {
		if !slices.Contains(served, stored) {
			return fmt.Errorf("refusing to install: this version's CRD %s serves %v, but the cluster stores objects as %s, which it would drop; "+
				"upgrade through a release that still serves %s and migrate the stored objects first (nothing was changed)", next.Name, served, stored, stored)
		}
	}
	return nil
}

// established waits until the API server serves the CRD's new schema.
func established(ctx context.Context, c client.Client, name string) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var crd apiextensionsv1.CustomResourceDefinition
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &crd); err != nil {
			return false, err
		}
		for _, cond := range crd.Status.Conditions {
			if cond.Type == apiextensionsv1.Established && cond.Status == apiextensionsv1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
}
