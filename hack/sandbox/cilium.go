package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/kube"
	"k8s.io/cli-runtime/pkg/genericclioptions"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/internal/testchart"
)

// userCilium is the Cilium the sandbox's user installed with Helm: Ichor's
// test chart (shaped like Cilium's) a minor behind the one Ichor ships, so
// that `kubectl ichor upgrade cni` has a minor to move it.
const userCilium = "1.18.11"

// writeCharts packs the test chart at userCilium and at the version this
// Ichor pins into the charts directory, which the controller reads as its
// image's (--chart-dir, --chart-digest: the test chart is not the archive
// the release pins).
func (s *Sandbox) writeCharts() error {
	table, err := compat.Default()
	if err != nil {
		return err
	}
	if s.userChart, err = testchart.Write(s.Path(dirCharts), userCilium); err != nil {
		return fmt.Errorf("the user's Cilium chart: %w", err)
	}
	if s.shippedChart, err = testchart.Write(s.Path(dirCharts), table.CiliumChart.Version); err != nil {
		return fmt.Errorf("the shipped Cilium chart: %w", err)
	}
	return nil
}

// installCilium installs the user's Cilium with Helm (release
// kube-system/cilium, as `helm install` would) and waits until its agents
// are ready.
func (s *Sandbox) installCilium(ctx context.Context) error {
	ch, err := cilium.LoadChart(s.Path(dirCharts), s.userChart)
	if err != nil {
		return err
	}
	flags := genericclioptions.NewConfigFlags(false)
	kubeconfig := s.Path(fileKubeconfig)
	flags.KubeConfig = &kubeconfig
	cfg := action.NewConfiguration(action.ConfigurationSetLogger(slog.NewTextHandler(s.simLog, nil)))
	if err := cfg.Init(flags, cilium.Namespace, "secret"); err != nil {
		return fmt.Errorf("helm: %w", err)
	}
	in := action.NewInstall(cfg)
	in.ReleaseName, in.Namespace, in.WaitStrategy, in.Timeout = cilium.Release, cilium.Namespace, kube.StatusWatcherStrategy, 2*time.Minute
	if _, err := in.RunWithContext(ctx, ch, map[string]any{"ipam": map[string]any{"mode": "kubernetes"}}); err != nil {
		return fmt.Errorf("install Cilium %s with Helm: %w", userCilium, err)
	}
	return nil
}
