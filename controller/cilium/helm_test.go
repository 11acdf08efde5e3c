package cilium_test

import (
	"context"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/kube"
	rcommon "helm.sh/helm/v4/pkg/release/common"
	releasev1 "helm.sh/helm/v4/pkg/release/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/internal/testchart"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) {
	// The DaemonSet controller makes the agents' DaemonSet ready for Helm's wait.
	os.Exit(testenv.Main(m, &env, testenv.With(testenv.Components{ControllerManager: true})))
}

func getter() genericclioptions.RESTClientGetter {
	f := genericclioptions.NewConfigFlags(false)
	f.KubeConfig = &env.Kubeconfig
	return f
}

func helmConfig(t *testing.T) *action.Configuration {
	cfg := action.NewConfiguration()
	if err := cfg.Init(getter(), cilium.Namespace, "secret"); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// charts packs the test chart at each version into a directory, as the image carries Cilium's.
func charts(t *testing.T, versions ...string) (string, map[string]compat.ChartPin) {
	dir := t.TempDir()
	pins := map[string]compat.ChartPin{}
	for _, v := range versions {
		pin, err := testchart.Write(dir, v)
		if err != nil {
			t.Fatal(err)
		}
		pins[v] = pin
	}
	return dir, pins
}

// userInstall installs Cilium as its user did, with Helm and values of their own.
func userInstall(t *testing.T, dir string, pin compat.ChartPin, vals map[string]any) {
	t.Helper()
	ch, err := cilium.LoadChart(dir, pin)
	if err != nil {
		t.Fatal(err)
	}
	in := action.NewInstall(helmConfig(t))
	in.ReleaseName, in.Namespace, in.WaitStrategy, in.Timeout = cilium.Release, cilium.Namespace, kube.StatusWatcherStrategy, time.Minute
	// As the helm CLI does, under its server-side apply field manager.
	kube.ManagedFieldsManager = cilium.FieldManager
	defer func() { kube.ManagedFieldsManager = "" }()
	if _, err := in.RunWithContext(context.Background(), ch, vals); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		un := action.NewUninstall(helmConfig(t))
		un.WaitStrategy = kube.HookOnlyStrategy
		if _, err := un.Run(cilium.Release); err != nil {
			t.Logf("uninstall: %v", err)
		}
	})
}

func upgrade(t *testing.T, dir string, pin compat.ChartPin, kpr bool) cilium.Result {
	t.Helper()
	ch, err := cilium.LoadChart(dir, pin)
	if err != nil {
		t.Fatal(err)
	}
	res, err := cilium.Upgrade(context.Background(), getter(), cilium.Request{Chart: ch, KubeProxyReplacement: kpr, Timeout: time.Minute,
		Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	return res
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func agents(t *testing.T) (*appsv1.DaemonSet, *corev1.ConfigMap) {
	t.Helper()
	ds := &appsv1.DaemonSet{}
	cm := &corev1.ConfigMap{}
	ctx := context.Background()
	if err := env.Client.Get(ctx, client.ObjectKey{Namespace: cilium.Namespace, Name: cilium.DaemonSet}, ds); err != nil {
		t.Fatal(err)
	}
	if err := env.Client.Get(ctx, client.ObjectKey{Namespace: cilium.Namespace, Name: cilium.ConfigMap}, cm); err != nil {
		t.Fatal(err)
	}
	return ds, cm
}

// A user's Cilium 1.18 moves to the shipped 1.19 with their values kept,
// Talos's enforced, and kube-proxy replacement on through KubePrism.
func TestUpgradeKeepsUserValuesAndEnforcesTalos(t *testing.T) {
	dir, pins := charts(t, "1.18.11", "1.19.6")
	userInstall(t, dir, pins["1.18.11"], map[string]any{
		"ipam":        map[string]any{"mode": "kubernetes"},
		"extraConfig": map[string]any{"custom": "kept"},
	})
	res := upgrade(t, dir, pins["1.19.6"], true)
	if res.Revision != 2 || res.Adopted {
		t.Fatalf("result %+v, want revision 2 of the existing release", res)
	}
	ds, cm := agents(t)
	agent := ds.Spec.Template.Spec.Containers[0]
	if agent.Image != "quay.io/cilium/cilium:v1.19.6" {
		t.Errorf("agent image %s", agent.Image)
	}
	if slices.Contains(agent.SecurityContext.Capabilities.Add, "SYS_MODULE") {
		t.Errorf("the agent keeps SYS_MODULE: %v", agent.SecurityContext.Capabilities.Add)
	}
	env := map[string]string{}
	for _, e := range agent.Env {
		env[e.Name] = e.Value
	}
	if env["KUBERNETES_SERVICE_HOST"] != "localhost" || env["KUBERNETES_SERVICE_PORT"] != "7445" {
		t.Errorf("the agent does not reach the API server through KubePrism: %v", env)
	}
	want := map[string]string{"kube-proxy-replacement": "true", "ipam": "kubernetes", "cgroup-root": "/sys/fs/cgroup", "custom": "kept", "upgrade-compatibility": "1.18"}
	for k, v := range want {
		if cm.Data[k] != v {
			t.Errorf("cilium-config %s = %q, want %q", k, cm.Data[k], v)
		}
	}
	if ds.Spec.Template.Annotations["cilium.io/cilium-configmap-checksum"] == "" {
		t.Error("the mode changed, but the agents do not restart (rollOutCiliumPods)")
	}
	for _, c := range ds.Spec.Template.Spec.InitContainers {
		if c.Name == "mount-cgroup" {
			t.Error("Cilium mounts cgroups itself, which Talos provides")
		}
	}
	// The values passed are explicit: the release records them.
	vals, err := action.NewGetValues(helmConfig(t)).Run(cilium.Release)
	if err != nil {
		t.Fatal(err)
	}
	if vals["kubeProxyReplacement"] != true || vals["extraConfig"].(map[string]any)["custom"] != "kept" {
		t.Errorf("release values %v", vals)
	}
}

// A Cilium that Helm does not manage (applied from `helm template`) is
// installed over, its objects taken over; its mode is read from cilium-config.
func TestUpgradeAdoptsUnmanagedCilium(t *testing.T) {
	ctx := context.Background()
	dir, pins := charts(t, "1.19.6")
	cm := &corev1.ConfigMap{}
	cm.Namespace, cm.Name = cilium.Namespace, cilium.ConfigMap
	cm.Data = map[string]string{"ipam": "kubernetes", "kube-proxy-replacement": "true"}
	ds := &appsv1.DaemonSet{}
	ds.Namespace, ds.Name = cilium.Namespace, cilium.DaemonSet
	ds.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"k8s-app": "cilium"}}
	ds.Spec.Template.Labels = map[string]string{"k8s-app": "cilium"}
	ds.Spec.Template.Spec.Containers = []corev1.Container{{Name: cilium.AgentContainer, Image: "quay.io/cilium/cilium:v1.18.11"}}
	for _, o := range []client.Object{cm, ds} {
		if err := env.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		un := action.NewUninstall(helmConfig(t))
		un.WaitStrategy = kube.HookOnlyStrategy
		_, _ = un.Run(cilium.Release)
	})
	res := upgrade(t, dir, pins["1.19.6"], true)
	if !res.Adopted || res.Revision != 1 {
		t.Fatalf("result %+v, want the release installed over the objects", res)
	}
	gotDS, gotCM := agents(t)
	if gotDS.Spec.Template.Spec.Containers[0].Image != "quay.io/cilium/cilium:v1.19.6" || gotCM.Data["kube-proxy-replacement"] != "true" {
		t.Fatalf("after adopting: image %s, mode %q", gotDS.Spec.Template.Spec.Containers[0].Image, gotCM.Data["kube-proxy-replacement"])
	}
	if _, ok := gotDS.Spec.Template.Annotations["cilium.io/cilium-configmap-checksum"]; ok {
		t.Error("the mode did not change, yet the agents were made to restart")
	}
}

// A revision left pending by a run that was killed does not block the next run.
func TestUpgradeAfterAKilledRun(t *testing.T) {
	dir, pins := charts(t, "1.19.6")
	userInstall(t, dir, pins["1.19.6"], map[string]any{"ipam": map[string]any{"mode": "kubernetes"}})
	cfg := helmConfig(t)
	last, err := cfg.Releases.Last(cilium.Release)
	if err != nil {
		t.Fatal(err)
	}
	rel := last.(*releasev1.Release)
	rel.Info.Status = rcommon.StatusPendingUpgrade
	if err := cfg.Releases.Update(rel); err != nil {
		t.Fatal(err)
	}
	if res := upgrade(t, dir, pins["1.19.6"], false); res.Revision != 2 {
		t.Fatalf("revision %d, want 2", res.Revision)
	}
}

// The chart is loaded only when it is exactly the pinned archive.
func TestLoadChart(t *testing.T) {
	dir, pins := charts(t, "1.19.6")
	pin := pins["1.19.6"]
	if _, err := cilium.LoadChart(dir, pin); err != nil {
		t.Fatal(err)
	}
	bad := pin
	bad.Digest = "sha256:" + strings.Repeat("0", 64)
	if _, err := cilium.LoadChart(dir, bad); err == nil || !strings.Contains(err.Error(), "not the pinned") {
		t.Fatalf("another digest: %v", err)
	}
	missing := pin
	missing.Version = "1.20.2"
	if _, err := cilium.LoadChart(dir, missing); err == nil || !strings.Contains(err.Error(), "is not in this image") {
		t.Fatalf("another version: %v", err)
	}
	// An archive renamed to the pinned name is not the pinned chart.
	if err := os.Rename(dir+"/cilium-1.19.6.tgz", dir+"/cilium-1.20.2.tgz"); err != nil {
		t.Fatal(err)
	}
	renamed := pin
	renamed.Version = "1.20.2"
	if _, err := cilium.LoadChart(dir, renamed); err == nil || !strings.Contains(err.Error(), "holds chart cilium 1.19.6") {
		t.Fatalf("renamed archive: %v", err)
	}
}
