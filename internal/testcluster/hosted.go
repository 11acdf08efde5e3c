package testcluster

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// StartHostedFleet starts a fleet whose control planes host the cluster's
// API (sim.Spec.Hosted): one kube-apiserver each, rendered from its
// machine configuration, storing in the control planes' own etcd, behind
// the fleet's endpoint. It returns the fleet and an Env
// attached to that endpoint, running components (the controller manager
// and scheduler reach the API through the endpoint too; start the
// controller with its Config). Both stop when the test ends. The other
// packages' tests keep their Env's fixed API server.
func StartHostedFleet(t testing.TB, spec sim.Spec, components testenv.Components) (*sim.Fleet, *testenv.Env) {
	t.Helper()
	if spec.Name == "" {
		spec.Name = "h" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	}
	if spec.Logf == nil {
		spec.Logf = t.Logf
	}
	if components.NodeLifecycle && spec.Kubelet.NodeLease == 0 {
		spec.Kubelet.NodeLease = testenv.NodeLease
	}
	spec.Hosted = &sim.Hosted{Assets: os.Getenv("KUBEBUILDER_ASSETS"), Dir: t.TempDir()}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	fleet, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatalf("start hosted fleet: %v", err)
	}
	t.Cleanup(fleet.Stop)
	key := fleet.ControlPlanes()[0].Config().Cluster().ServiceAccount().Key
	env, err := testenv.Attach(fleet.APIConfig(), key)
	if err != nil {
		t.Fatalf("attach to the fleet's API: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	if err := env.StartComponents(components); err != nil {
		t.Fatalf("start components on the fleet's API: %v", err)
	}
	return fleet, env
}
