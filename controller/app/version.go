package app

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// versionReporter writes the leader's version, and the kinds it carries
// out, on the leader-election Lease, where the plugin reads them (`kubectl
// ichor version`, and the checks before it creates an operation).
type versionReporter struct {
	client    client.Client
	namespace string
	version   string
	kinds     []ichorv1.OperationKind
	log       logr.Logger
}

// NeedLeaderElection implements manager.LeaderElectionRunnable: only the leader reports.
func (v *versionReporter) NeedLeaderElection() bool { return true }

// Start implements manager.Runnable.
func (v *versionReporter) Start(ctx context.Context) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		ichorv1.VersionAnnotation: v.version,
		ichorv1.KindsAnnotation:   ichorv1.FormatKinds(v.kinds),
	}}})
	if err != nil {
		return err
	}
	lease := &coordinationv1.Lease{}
	lease.Namespace, lease.Name = v.namespace, ichorv1.LeaderLeaseName
	// The Lease exists once leadership is won; the patch races nothing else
	// that writes annotations, so a few tries are enough.
	err = wait.ExponentialBackoffWithContext(ctx, wait.Backoff{Steps: 5, Duration: 100e6, Factor: 2}, func(ctx context.Context) (bool, error) {
		err := v.client.Patch(ctx, lease, client.RawPatch(types.MergePatchType, patch))
		return err == nil, nil
	})
	if err != nil {
		v.log.Error(fmt.Errorf("annotate leader Lease: %w", err), "the plugin will show the controller version as unknown")
	}
	<-ctx.Done()
	return nil
}
