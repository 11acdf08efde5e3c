package sim_test

import (
	"context"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kruntime "k8s.io/apimachinery/pkg/runtime"

	"maesh.dev/ichor/internal/testenv"
)

// staticPod reads a machine's COSI StaticPod as the pod it holds.
func staticPod(t *testing.T, c *client.Client, ctx context.Context, id string) (*corev1.Pod, error) {
	t.Helper()
	sp, err := safe.StateGetByID[*k8s.StaticPod](ctx, c.COSI, id)
	if err != nil {
		return nil, err
	}
	var pod corev1.Pod
	if err := kruntime.DefaultUnstructuredConverter.FromUnstructured(sp.TypedSpec().Pod, &pod); err != nil {
		t.Fatal(err)
	}
	return &pod, nil
}

// TestRenderedResources: as Talos's controllers, a control plane serves
// through COSI the StaticPods of its three components (labelled as Talos's,
// annotated with their configuration resource's version, the command with
// the configuration's extraArgs merged in), the bootstrap Manifests Talos
// renders (10-kube-proxy with cluster.proxy.image, 11-core-dns,
// 11-core-dns-svc) and its KubeletSpec; a worker has the KubeletSpec only.
// A live configuration change (NO_REBOOT) renders them anew: a new
// configuration version in the pod, the new proxy image in the DaemonSet,
// the kubelet's new flag.
func TestRenderedResources(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	cp, w := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	cpCtx, wCtx := client.WithNode(context.Background(), cp.Address()), client.WithNode(context.Background(), w.Address())

	for _, id := range components {
		pod, err := staticPod(t, c, cpCtx, id)
		if err != nil {
			t.Fatalf("StaticPod %s: %v", id, err)
		}
		if pod.Name != id || pod.Labels["k8s-app"] != id || len(pod.Spec.Containers) != 1 || pod.Spec.Containers[0].Command[0] != "/usr/local/bin/"+id {
			t.Errorf("StaticPod %s: %s labels %v containers %v", id, pod.Name, pod.Labels, pod.Spec.Containers)
		}
	}
	if _, err := staticPod(t, c, wCtx, "kube-apiserver"); err == nil {
		t.Error("a worker has a kube-apiserver StaticPod")
	}
	manifests := func() map[string]*k8s.Manifest {
		list, err := safe.StateListAll[*k8s.Manifest](cpCtx, c.COSI)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]*k8s.Manifest{}
		for m := range list.All() {
			out[m.Metadata().ID()] = m
		}
		return out
	}
	got := manifests()
	if ids := slices.Sorted(func(yield func(string) bool) {
		for id := range got {
			if !yield(id) {
				return
			}
		}
	}); !slices.Equal(ids, []string{"10-kube-proxy", "11-core-dns", "11-core-dns-svc"}) {
		t.Fatalf("manifests %v", ids)
	}
	proxyImage := func(m *k8s.Manifest) string {
		for _, it := range m.TypedSpec().Items {
			if it.Object["kind"] == "DaemonSet" {
				var ds appsv1.DaemonSet
				if err := kruntime.DefaultUnstructuredConverter.FromUnstructured(it.Object, &ds); err != nil {
					t.Fatal(err)
				}
				return ds.Spec.Template.Spec.Containers[0].Image
			}
		}
		return ""
	}
	if img := proxyImage(got["10-kube-proxy"]); img != cp.Config().Cluster().Proxy().Image() {
		t.Errorf("kube-proxy DaemonSet image %q, want %q", img, cp.Config().Cluster().Proxy().Image())
	}
	if _, err := safe.StateGetByID[*k8s.KubeletSpec](wCtx, c.COSI, k8s.KubeletID); err != nil {
		t.Fatalf("worker KubeletSpec: %v", err)
	}

	before, err := staticPod(t, c, cpCtx, "kube-apiserver")
	if err != nil {
		t.Fatal(err)
	}
	const proxy = "registry.k8s.io/kube-proxy:v1.36.0"
	a := newConfigApply(t, f, cp)
	if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.APIServerConfig.ExtraArgsConfig = v1alpha1.Args{"feature-gates": v1alpha1.NewArgValue("HonorPVReclaimPolicy=true", nil)}
		cfg.ClusterConfig.ProxyConfig.ContainerImage = proxy
		cfg.MachineConfig.MachineKubelet.KubeletExtraArgs = v1alpha1.Args{"containerd": v1alpha1.NewArgValue("/run/containerd.sock", nil)}
	}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the API server's StaticPod with the feature gate", func(context.Context) (bool, error) {
		pod, err := staticPod(t, c, cpCtx, "kube-apiserver")
		return err == nil && slices.Contains(pod.Spec.Containers[0].Command, "--feature-gates=HonorPVReclaimPolicy=true"), err
	})
	after, _ := staticPod(t, c, cpCtx, "kube-apiserver")
	apiCfg, err := safe.StateGetByID[*k8s.APIServerConfig](cpCtx, c.COSI, k8s.APIServerConfigID)
	if err != nil {
		t.Fatal(err)
	}
	if v := after.Annotations["talos.dev/config-version"]; v == before.Annotations["talos.dev/config-version"] || v != apiCfg.Metadata().Version().String() {
		t.Errorf("config-version %s (was %s), APIServerConfig version %s", v, before.Annotations["talos.dev/config-version"], apiCfg.Metadata().Version())
	}
	if img := proxyImage(manifests()["10-kube-proxy"]); img != proxy {
		t.Errorf("kube-proxy DaemonSet image %q after the change, want %q", img, proxy)
	}
	ks, err := safe.StateGetByID[*k8s.KubeletSpec](cpCtx, c.COSI, k8s.KubeletID)
	if err != nil || !slices.Contains(ks.TypedSpec().Args, "--containerd=/run/containerd.sock") {
		t.Errorf("KubeletSpec args %v, %v", ks.TypedSpec().Args, err)
	}
}

// TestInlineManifestsRendered: as Talos's ExtraManifestController, each of
// cluster.inlineManifests is a bootstrap Manifest 99-<name> holding its
// documents (comment-only documents skipped, a List unwrapped); one that
// no longer parses keeps what it rendered while the others render on, and
// one removed from the configuration is removed.
func TestInlineManifestsRendered(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 0))
	cp := f.Machines()[0]
	c := talos(t, f)
	ctx := client.WithNode(context.Background(), cp.Address())
	a := newConfigApply(t, f, cp)
	setInline := func(manifests ...v1alpha1.ClusterInlineManifest) {
		t.Helper()
		if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(cfg *v1alpha1.Config) {
			cfg.ClusterConfig.ClusterInlineManifests = manifests
		}); err != nil {
			t.Fatal(err)
		}
	}
	// names reads the objects' names of each rendered 99- manifest.
	names := func() map[string][]string {
		list, err := safe.StateListAll[*k8s.Manifest](ctx, c.COSI)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for m := range list.All() {
			if id := m.Metadata().ID(); strings.HasPrefix(id, "99-") {
				out[id] = []string{}
				for _, it := range m.TypedSpec().Items {
					o := unstructured.Unstructured{Object: it.Object}
					out[id] = append(out[id], o.GetKind()+"/"+o.GetName())
				}
			}
		}
		return out
	}
	waitNames := func(what string, want map[string][]string) {
		t.Helper()
		testenv.Eventually(t, 10*time.Second, what, func(context.Context) (bool, error) {
			return reflect.DeepEqual(names(), want), nil
		})
	}

	extra := v1alpha1.ClusterInlineManifest{InlineManifestName: "extra", InlineManifestContents: `
apiVersion: v1
kind: ConfigMap
metadata: {name: one, namespace: default}
---
# only a comment
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: two, namespace: default}
- apiVersion: v1
  kind: Secret
  metadata: {name: three, namespace: default}
`}
	setInline(extra)
	waitNames("99-extra with its three objects", map[string][]string{"99-extra": {"ConfigMap/one", "ConfigMap/two", "Secret/three"}})

	broken := v1alpha1.ClusterInlineManifest{InlineManifestName: "extra", InlineManifestContents: "kind: [unclosed"}
	more := v1alpha1.ClusterInlineManifest{InlineManifestName: "more", InlineManifestContents: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: four, namespace: default}\n"}
	setInline(broken, more)
	waitNames("99-more beside 99-extra as it was", map[string][]string{
		"99-extra": {"ConfigMap/one", "ConfigMap/two", "Secret/three"}, "99-more": {"ConfigMap/four"}})

	setInline()
	waitNames("no inline manifest", map[string][]string{})
}
