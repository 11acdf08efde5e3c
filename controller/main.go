// Command ichor-controller carries out TalosOperations. Run without a
// subcommand it is the controller; `ichor-controller lock` takes or releases
// the cluster lock from a Job's init container, and `ichor-controller cilium
// upgrade` is the cni kind's Helm Job and `ichor-controller install` the
// ichor kind's installer Job.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/ciliumcmd"
	"maesh.dev/ichor/controller/install"
	"maesh.dev/ichor/controller/lockcmd"
	"maesh.dev/ichor/internal/version"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRoot().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func newRoot() *cobra.Command {
	o := app.Options{Version: version.Version}
	zo := zap.Options{}
	var chartDigest string
	cmd := &cobra.Command{
		Use:           "ichor-controller",
		Short:         "Carries out TalosOperations on a Talos Linux cluster",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := zap.New(zap.UseFlagOptions(&zo))
			ctrl.SetLogger(log)
			klog.SetLogger(log)
			o.Log = log
			log.Info("starting ichor-controller", "version", version.Version, "namespace", o.Namespace)
			cfg, err := ctrl.GetConfig()
			if err != nil {
				return fmt.Errorf("kubeconfig: %w", err)
			}
			if o.Image == "" {
				if o.Image, err = app.OwnImage(cmd.Context(), cfg); err != nil {
					return err
				}
			}
			o.Pod = app.OwnPod()
			o.Node = os.Getenv("NODE_NAME")
			if chartDigest != "" {
				if o.CiliumChart, err = chartWithDigest(chartDigest); err != nil {
					return err
				}
			}
			return app.Run(cmd.Context(), cfg, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Namespace, "namespace", ichorv1.DefaultNamespace, "namespace of the cluster lock, the leader Lease and Secret "+ichorv1.TalosconfigSecret)
	f.StringVar(&o.MetricsAddr, "metrics-bind-address", envOr(app.MetricsAddrEnv, ":8080"),
		`address of the Prometheus metrics endpoint ("0" disables it; default $`+app.MetricsAddrEnv+`, else :8080)`)
	f.StringVar(&o.ProbeAddr, "health-probe-bind-address", envOr(app.ProbeAddrEnv, ":8081"),
		"address of the /healthz and /readyz endpoints (default $"+app.ProbeAddrEnv+", else :8081)")
	f.StringVar(&o.PprofAddr, "pprof-bind-address", "0", `address of net/http/pprof's profiles ("0" disables it)`)
	f.BoolVar(&o.LeaderElection, "leader-elect", true, "elect a leader among replicas (Lease "+ichorv1.LeaderLeaseName+")")
	f.DurationVar(&o.StepTimeout, "step-timeout", 15*time.Minute, "time limit of steps that set none of their own")
	f.StringVar(&o.Image, "image", "", "the controller's own image, which the cni kind's Job runs (default: read from the controller's pod, $POD_NAMESPACE/$POD_NAME)")
	f.StringVar(&o.ChartDir, "chart-dir", "", "directory of the Cilium chart this image ships (default "+cilium.ChartDir+")")
	f.StringVar(&chartDigest, "chart-digest", "", "sha256:<hex> of the chart archive in --chart-dir, when it is not the one this release pins (the sandbox's test chart); default the pin's")
	gf := flag.NewFlagSet("zap", flag.ContinueOnError)
	zo.BindFlags(gf)
	f.AddGoFlagSet(gf)

	cmd.AddCommand(lockcmd.New(), ciliumcmd.New(), install.New(), &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version.Version) },
	})
	return cmd
}

// chartWithDigest is the pinned Cilium chart's version at another archive's digest.
func chartWithDigest(digest string) (*compat.ChartPin, error) {
	table, err := compat.Default()
	if err != nil {
		return nil, err
	}
	pin, err := table.CiliumChart.WithDigest(digest)
	if err != nil {
		return nil, fmt.Errorf("--chart-digest: %w", err)
	}
	return &pin, nil
}

// envOr is the variable's value, or def when it is unset or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
