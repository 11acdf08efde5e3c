package operation_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/role"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestKubernetesPreflight, through the real API server and simulated
// machines: the running version is the lowest among the mirror pods and
// kube-proxy (a control plane whose three components are on v1.36.0 while
// kube-proxy is on 1.35 makes v1.36.0 an upgrade from 1.35, not "not
// newer"), and that
// path's removed-items check refuses a removed feature gate in the API
// server's extraArgs, naming it; a Talos 1.12 machine refuses 1.36
// (machinery's compatibility). Nothing disruptive is called.
func TestKubernetesPreflight(t *testing.T) {
	tests := []struct {
		name, talos string
		// patch changes the control plane's configuration first.
		patch       func(*v1alpha1.Config)
		check, want string
		absent      string
	}{
		{name: "removed gate, version from kube-proxy", talos: "v1.13.0", patch: func(c *v1alpha1.Config) {
			c.ClusterConfig.APIServerConfig.ContainerImage = "registry.k8s.io/kube-apiserver:v1.36.0"
			c.ClusterConfig.ControllerManagerConfig.ContainerImage = "registry.k8s.io/kube-controller-manager:v1.36.0"
			c.ClusterConfig.SchedulerConfig.ContainerImage = "registry.k8s.io/kube-scheduler:v1.36.0"
			c.ClusterConfig.APIServerConfig.ExtraArgsConfig = v1alpha1.Args{"feature-gates": v1alpha1.NewArgValue("HonorPVReclaimPolicy=true", nil)}
		}, check: "KubernetesRemovedItems", want: "Kubernetes 1.36 removes the feature gate HonorPVReclaimPolicy (kube-apiserver), which cluster.apiServer.extraArgs sets on %s",
			absent: "KubernetesVersionNewer"},
		{name: "Talos 1.12", talos: "v1.12.4", check: "KubernetesTalosSupported", want: "too new to be used with Talos 1.12.4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 1, 1)
			spec.KubeProxy = true
			for i := range spec.Machines {
				spec.Machines[i].Talos, spec.Machines[i].Kubernetes = tt.talos, "1.35.0"
			}
			c := newCluster(t, spec)
			t.Cleanup(func() { removeKubeProxy(t) })
			cp := c.fleet.ControlPlanes()[0]
			if tt.patch != nil {
				applyNoReboot(t, c.fleet, cp, tt.patch)
			}
			c.start()
			c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.36.0"}})
			op := c.waitFor("k8s", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
			cond := meta.FindStatusCondition(op.Status.Conditions, tt.check)
			want := strings.ReplaceAll(tt.want, "%s", cp.Name())
			if cond == nil || cond.Status != metav1.ConditionFalse || !strings.Contains(cond.Message, want) {
				t.Errorf("condition %s = %+v, want a message with %q; all: %+v", tt.check, cond, want, op.Status.Conditions)
			}
			if tt.absent != "" && meta.FindStatusCondition(op.Status.Conditions, tt.absent) != nil {
				t.Errorf("refused with %s too: %+v", tt.absent, op.Status.Conditions)
			}
			rec := c.fleet.Recorder()
			for _, call := range []string{"ApplyConfiguration", "Reboot", "Upgrade", "ImagePull"} {
				if n := rec.Calls("", call); n > 1 || (n == 1 && call != "ApplyConfiguration") {
					t.Errorf("a refused operation called %s %d times", call, n)
				}
			}
		})
	}
}

// applyNoReboot changes a machine's configuration live through the Talos
// API, as an operator's talosctl would, and waits until it is active.
func applyNoReboot(t *testing.T, f *sim.Fleet, m *sim.Machine, fn func(*v1alpha1.Config)) {
	t.Helper()
	tc := adminTalos(t, f)
	ctx, cancel := context.WithTimeout(talosclient.WithNode(context.Background(), m.Address()), 30*time.Second)
	defer cancel()
	mc, err := safe.StateGetByID[*configres.MachineConfig](ctx, tc.COSI, configres.ActiveID)
	if err != nil {
		t.Fatal(err)
	}
	p, err := mc.Provider().PatchV1Alpha1(func(c *v1alpha1.Config) error { fn(c); return nil })
	if err != nil {
		t.Fatal(err)
	}
	data, err := p.EncodeBytes()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tc.ApplyConfiguration(ctx, &machine.ApplyConfigurationRequest{Data: data, Mode: machine.ApplyConfigurationRequest_NO_REBOOT}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the mirror pods of the new configuration", func(ctx context.Context) (bool, error) {
		var pods corev1.PodList
		if err := env.Client.List(ctx, &pods); err != nil {
			return false, err
		}
		want := map[string]string{"kube-apiserver": p.Cluster().APIServer().Image(),
			"kube-controller-manager": p.Cluster().ControllerManager().Image(), "kube-scheduler": p.Cluster().Scheduler().Image()}
		for _, pod := range pods.Items {
			for c, image := range want {
				if pod.Name == c+"-"+m.Name() && pod.Spec.Containers[0].Image == image {
					delete(want, c)
				}
			}
		}
		return len(want) == 0, nil
	})
}

// adminTalos is a Talos client of the fleet with the os:admin role, as an
// operator's talosctl; it is closed when the test ends.
func adminTalos(t *testing.T, f *sim.Fleet) *talosclient.Client {
	t.Helper()
	cfg, err := f.ClientConfig(role.Admin)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(cfg))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tc.Close() })
	return tc
}
