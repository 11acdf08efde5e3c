// Package ciliumcmd is `ichor-controller cilium upgrade`: the Helm work of
// the cni kind, run by the Job the operation creates in kube-system (after
// its init container took the cluster lock). It loads the chart this image
// ships, reads the user's values from the release, adds what Talos needs and
// the kube-proxy mode asked for, and upgrades with Helm v4, waiting until
// every agent has rolled.
package ciliumcmd

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/cli-runtime/pkg/genericclioptions"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/controller/cilium"
)

// Options of `cilium upgrade`.
type Options struct {
	ChartDir     string
	ChartVersion string
	ChartDigest  string
	// KubeProxyReplacement is "true" or "false": always said, never kept implicitly.
	KubeProxyReplacement string
	Timeout              time.Duration
	Flags                *genericclioptions.ConfigFlags

	kpr  bool
	pin  compat.ChartPin
	out  io.Writer
	opts *slog.HandlerOptions
}

// NewOptions returns the defaults: the chart the embedded compatibility
// table pins, from the image's chart directory.
func NewOptions() *Options {
	o := &Options{ChartDir: cilium.ChartDir, Timeout: 10 * time.Minute, Flags: genericclioptions.NewConfigFlags(false)}
	if t, err := compat.Default(); err == nil {
		o.ChartVersion, o.ChartDigest = t.CiliumChart.Version, t.CiliumChart.Digest
	}
	return o
}

// New returns the `cilium` command.
func New() *cobra.Command {
	o := NewOptions()
	cmd := &cobra.Command{Use: "cilium", Short: "Cilium's Helm release (run by the cni kind's Job)"}
	up := &cobra.Command{
		Use:   "upgrade --kube-proxy-replacement=true|false",
		Short: "Upgrade the cilium release to the chart this image ships, with the values Talos needs",
		Long: `Upgrade the Helm release kube-system/cilium to the Cilium chart this image ships
(checked against its pinned version and digest). The user's values are read from
the release and passed explicitly (never --reuse-values), with what Talos needs
set over them: ipam.mode kubernetes, no cgroup auto-mount (hostRoot
/sys/fs/cgroup), the agent's capabilities without SYS_MODULE, and without
kube-proxy Cilium's API server through KubePrism (localhost:7445). It waits
until every object of the release is ready.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.Complete(cmd); err != nil {
				return err
			}
			if err := o.Validate(); err != nil {
				return err
			}
			return o.Run(cmd.Context())
		},
	}
	f := up.Flags()
	f.StringVar(&o.ChartDir, "chart-dir", o.ChartDir, "directory holding cilium-<version>.tgz")
	f.StringVar(&o.ChartVersion, "chart-version", o.ChartVersion, "the chart's version")
	f.StringVar(&o.ChartDigest, "chart-digest", o.ChartDigest, "the archive's sha256 digest, sha256:<hex>")
	f.StringVar(&o.KubeProxyReplacement, "kube-proxy-replacement", "", "true: Cilium replaces kube-proxy; false: kube-proxy runs")
	f.DurationVar(&o.Timeout, "timeout", o.Timeout, "how long the upgrade and the wait for its objects may take")
	o.Flags.AddFlags(f)
	cmd.AddCommand(up)
	return cmd
}

// Complete reads the flags.
func (o *Options) Complete(cmd *cobra.Command) error {
	o.out = cmd.OutOrStdout()
	o.pin = compat.ChartPin{Repository: "https://helm.cilium.io", Version: o.ChartVersion, Digest: o.ChartDigest}
	if o.KubeProxyReplacement != "" {
		b, err := strconv.ParseBool(o.KubeProxyReplacement)
		if err != nil {
			return fmt.Errorf("--kube-proxy-replacement %q: say true or false", o.KubeProxyReplacement)
		}
		o.kpr = b
	}
	return nil
}

// Validate checks the flags before anything is read.
func (o *Options) Validate() error {
	if o.KubeProxyReplacement == "" {
		return fmt.Errorf("--kube-proxy-replacement is required: true (Cilium replaces kube-proxy) or false (kube-proxy runs)")
	}
	if o.ChartVersion == "" || o.ChartDigest == "" {
		return fmt.Errorf("--chart-version and --chart-digest are required: the chart is checked against them")
	}
	if o.Timeout <= 0 {
		return fmt.Errorf("--timeout must be positive")
	}
	return nil
}

// Run loads the chart and upgrades. Its last line says what it did: the
// watch view shows a Job's last log line.
func (o *Options) Run(ctx context.Context) error {
	log := slog.New(slog.NewTextHandler(o.out, o.opts))
	ch, err := cilium.LoadChart(o.ChartDir, o.pin)
	if err != nil {
		return err
	}
	res, err := cilium.Upgrade(ctx, o.Flags, cilium.Request{Chart: ch, KubeProxyReplacement: o.kpr, Timeout: o.Timeout, Log: log})
	if err != nil {
		return err
	}
	verb := "upgraded"
	if res.Adopted {
		verb = "installed over the running Cilium"
	}
	mode := "kube-proxy runs"
	if o.kpr {
		mode = "Cilium replaces kube-proxy"
	}
	fmt.Fprintf(o.out, "cilium %s: chart %s, revision %d, every agent ready; %s\n", verb, o.pin.Version, res.Revision, mode)
	return nil
}
