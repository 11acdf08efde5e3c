package testcluster

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// StartHostedFleet starts a fleet whose control planes host the cluster's
// API (sim.Spec.Hosted): one kube-apiserver each, rendered from its
// machine configuration, storing in the control planes' own etcd, behind
// the fleet's endpoint, and the components asks for on each control plane
// (their own kube-controller-manager and kube-scheduler, leader-elected,
// through the endpoint too). It returns the fleet and an Env attached to
// that endpoint (start the controller with its Config). Both stop when the
// test ends. The other packages' tests keep their Env's fixed API server.
func StartHostedFleet(t testing.TB, spec sim.Spec, components testenv.Components) (*sim.Fleet, *testenv.Env) {
	t.Helper()
	if spec.Name == "" {
		spec.Name = "h" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	}
	if spec.Logf == nil {
		spec.Logf = Logf(t)
	}
	if components.NodeLifecycle && spec.Kubelet.NodeLease == 0 {
		spec.Kubelet.NodeLease = testenv.NodeLease
	}
	spec.Hosted = &sim.Hosted{Assets: os.Getenv("KUBEBUILDER_ASSETS"), Dir: t.TempDir(), Components: HostedComponents(components)}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	fleet, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatalf("start hosted fleet: %v", err)
	}
	t.Cleanup(fleet.Stop)
	env, err := testenv.Attach(fleet.APIConfig())
	if err != nil {
		t.Fatalf("attach to the fleet's API: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	waitCRDServed(t, fleet)
	return fleet, env
}

// waitCRDServed waits until every control plane's API server serves the
// TalosOperation resource: the CRD was installed through the endpoint,
// which waited for one of them only, and each learns of it from its own
// watch. A controller started before then may find no such resource in
// discovery and stop.
func waitCRDServed(t testing.TB, fleet *sim.Fleet) {
	t.Helper()
	for _, cp := range fleet.ControlPlanes() {
		cfg := fleet.APIConfig()
		cfg.Host = "https://" + cp.APIServer().Address
		dc, err := discovery.NewDiscoveryClientForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, time.Minute, cp.Name()+"'s API server serving talosoperations", func(context.Context) (bool, error) {
			rs, err := dc.ServerResourcesForGroupVersion(ichorv1.GroupVersion.String())
			if err != nil {
				return false, nil //nolint:nilerr // not yet
			}
			return slices.ContainsFunc(rs.APIResources, func(r metav1.APIResource) bool { return r.Name == ichorv1.Resource }), nil
		})
	}
}

// HostedComponents are the components of a test package's world as each
// control plane of a hosted fleet runs them.
func HostedComponents(c testenv.Components) sim.HostedComponents {
	h := sim.HostedComponents{ControllerManager: c.ControllerManager, Scheduler: c.Scheduler}
	if c.NodeLifecycle {
		h.NodeMonitorGracePeriod = testenv.NodeGracePeriod
	}
	return h
}
