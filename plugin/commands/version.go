package commands

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/version"
	"maesh.dev/ichor/plugin/view"
)

// VersionInfo is what `version -o json` prints.
type VersionInfo struct {
	Client     string `json:"clientVersion"`
	Controller string `json:"controllerVersion,omitempty"`
	// Unknown says why the controller version is not known.
	Unknown string `json:"controllerVersionUnknown,omitempty"`
}

func newVersionCmd(e *Env) *cobra.Command {
	var clientOnly bool
	var output string
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the plugin's and ichor-controller's versions",
		Long: fmt.Sprintf(`Print the plugin's version and the version of the leading ichor-controller
(the %[2]s annotation on the Lease %[3]s in the controller's namespace). A
plugin and controller of different minor versions get a warning.`, e.Name, ichorv1.VersionAnnotation, ichorv1.LeaderLeaseName),
		Example: fmt.Sprintf("  %[1]s version\n  %[1]s version --client -o json", e.Name),
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "" && output != "json" && output != "yaml" {
				return usageErrorf("unsupported --output %q: use json or yaml", output)
			}
			info := VersionInfo{Client: version.Version}
			if !clientOnly {
				info.Controller, info.Unknown = e.controllerVersion(cmd.Context())
			}
			return printStructured(e.Streams.Out, output, info, func(w io.Writer) {
				fmt.Fprintf(w, "Client Version: %s\n", info.Client)
				if clientOnly {
					return
				}
				if info.Controller == "" {
					fmt.Fprintf(w, "Controller Version: unknown (%s)\n", info.Unknown)
					return
				}
				fmt.Fprintf(w, "Controller Version: %s\n", info.Controller)
				if skewed(info.Client, info.Controller) {
					fmt.Fprintf(e.Streams.ErrOut, "WARNING: plugin %s and ichor-controller %s differ in minor version; use the plugin of the controller's release\n", info.Client, info.Controller)
				}
			})
		},
	}
	cmd.Flags().BoolVar(&clientOnly, "client", false, "Print only the plugin's version; do not contact the cluster")
	cmd.Flags().StringVarP(&output, "output", "o", "", "Output format: json or yaml")
	return cmd
}

// controllerVersion reads the leader's version, or says why it cannot.
func (e *Env) controllerVersion(ctx context.Context) (string, string) {
	c, err := e.NewClient()
	if err != nil {
		return "", err.Error()
	}
	info, unknown := readController(ctx, c, e.ControllerNamespace)
	if unknown == "" && info.Version == "" {
		unknown = fmt.Sprintf("the Lease %s/%s has no %s annotation", e.ControllerNamespace, ichorv1.LeaderLeaseName, ichorv1.VersionAnnotation)
	}
	return info.Version, unknown
}

// controllerInfo is what the leading controller publishes on its leader Lease.
type controllerInfo struct {
	Version string
	// Kinds are the kinds it carries out; nil when it does not say (an
	// older controller).
	Kinds []ichorv1.OperationKind
}

// carriesOut reports whether the controller carries the kind out, as far
// as it says.
func (i controllerInfo) carriesOut(k ichorv1.OperationKind) bool {
	return i.Kinds == nil || slices.Contains(i.Kinds, k)
}

// readController reads the leader Lease, or says why it cannot (no leader:
// no controller runs).
func readController(ctx context.Context, c client.Reader, ns string) (controllerInfo, string) {
	lease := &coordinationv1.Lease{}
	err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: ichorv1.LeaderLeaseName}, lease)
	switch {
	case apierrors.IsNotFound(err):
		return controllerInfo{}, fmt.Sprintf("no leader Lease %s/%s: is ichor-controller running? (see --controller-namespace)", ns, ichorv1.LeaderLeaseName)
	case apierrors.IsForbidden(err):
		return controllerInfo{}, fmt.Sprintf("not allowed to read the Lease %s/%s", ns, ichorv1.LeaderLeaseName)
	case err != nil:
		return controllerInfo{}, view.Clean(err.Error())
	}
	info := controllerInfo{Version: view.Clean(lease.Annotations[ichorv1.VersionAnnotation])}
	if kinds, ok := lease.Annotations[ichorv1.KindsAnnotation]; ok {
		info.Kinds = append([]ichorv1.OperationKind{}, ichorv1.ParseKinds(kinds)...)
	}
	return info, ""
}

// skewed reports whether two versions differ in major or minor.
func skewed(a, b string) bool {
	mm := func(v string) string {
		parts := strings.SplitN(strings.TrimPrefix(v, "v"), ".", 3)
		if len(parts) < 2 {
			return v
		}
		return parts[0] + "." + parts[1]
	}
	return mm(a) != mm(b)
}
