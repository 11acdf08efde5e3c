package testcluster_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// TestHostedClusterThroughTheEndpoint: with the control planes hosting the
// API, the controller manager and the scheduler run the cluster through
// the fleet's endpoint, and go on while one control plane of three reboots
// (its API server down, its etcd member out: two keep quorum); the
// controller leads through it.
func TestHostedClusterThroughTheEndpoint(t *testing.T) {
	spec := sim.Cluster("hosted", 3, 1)
	fleet, henv := testcluster.StartHostedFleet(t, spec, testenv.Components{ControllerManager: true, Scheduler: true, NodeLifecycle: true})
	ctx := context.Background()
	labels := map[string]string{"app": "web"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "registry.k8s.io/pause:3.10"}}},
			},
		},
	}
	if err := henv.Client.Create(ctx, dep); err != nil {
		t.Fatal(err)
	}
	ready := func(n int32) func(context.Context) (bool, error) {
		return func(ctx context.Context) (bool, error) {
			var d appsv1.Deployment
			if err := henv.Client.Get(ctx, ctrlclient.ObjectKeyFromObject(dep), &d); err != nil {
				return false, nil // the endpoint may be between API servers
			}
			return d.Status.ReadyReplicas == n, nil
		}
	}
	testenv.Eventually(t, 2*time.Minute, "2 web pods ready", ready(2))

	cp := fleet.ControlPlanes()[0]
	tc, err := client.New(ctx, client.WithConfig(fleet.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	if err := tc.Reboot(client.WithNode(ctx, fleet.ControlPlanes()[1].Address())); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "the API server of "+fleet.ControlPlanes()[1].Name()+" down", func(context.Context) (bool, error) {
		return !fleet.ControlPlanes()[1].APIServer().Ready, nil
	})
	if err := henv.Client.Patch(ctx, dep, ctrlclient.RawPatch("application/merge-patch+json", []byte(`{"spec":{"replicas":3}}`))); err != nil {
		t.Fatalf("scale through %s's API server: %v", cp.Name(), err)
	}
	testenv.Eventually(t, 2*time.Minute, "3 web pods ready", ready(3))

	ctl := testcluster.StartController(t, henv.Config, app.Options{Namespace: "default", LeaderElection: true})
	select {
	case <-ctl.Elected():
	case <-time.After(time.Minute):
		t.Fatal("the controller did not lead through the fleet's endpoint")
	}
}
