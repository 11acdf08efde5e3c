package preflight

import (
	"reflect"
	"testing"

	"github.com/siderolabs/talos/pkg/machinery/config/generate"
	"github.com/siderolabs/talos/pkg/machinery/config/machine"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/api/compat"
)

// TestRemovedTable: the embedded table parses and holds go-kubernetes'
// entries for the two paths; a patch or an unlisted path removes nothing.
func TestRemovedTable(t *testing.T) {
	m := func(s string) compat.Minor {
		v, err := compat.ParseMinor(s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	tests := []struct {
		from, to       string
		gates, kubelet int
		apis           []string
		wantEmpty      bool
	}{
		{"1.35", "1.36", 4, 0, nil, false},
		{"1.36", "1.37", 5, 18, []string{"workloads.v1alpha2.scheduling.k8s.io", "podgroups.v1alpha2.scheduling.k8s.io"}, false},
		{"1.36", "1.36", 0, 0, nil, true},
		{"1.34", "1.35", 0, 0, nil, true},
	}
	for _, tt := range tests {
		rm := RemovedBetween(m(tt.from), m(tt.to))
		if len(rm.FeatureGates) != tt.gates || len(rm.Flags["kubelet"]) != tt.kubelet || !reflect.DeepEqual(rm.APIs, tt.apis) || rm.Empty() != tt.wantEmpty {
			t.Errorf("%s -> %s: %+v", tt.from, tt.to, rm)
		}
	}
}

// TestConfiguredIn: the control-plane extraArgs on a control plane only,
// the kubelet's extraArgs and extraConfig featureGates everywhere, the
// gates named in --feature-gates; nothing for fields that set nothing.
func TestConfiguredIn(t *testing.T) {
	in, err := generate.NewInput("c", "https://10.0.0.1:6443", "1.35.0")
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		typ  machine.Type
		want []Configured
	}{
		{machine.TypeControlPlane, []Configured{
			{Machine: "m", Component: "kube-apiserver", Field: "cluster.apiServer.extraArgs", Flags: []string{"feature-gates", "v"}, FeatureGates: []string{"HonorPVReclaimPolicy", "Other"}},
			{Machine: "m", Component: "kubelet", Field: "machine.kubelet.extraArgs", Flags: []string{"containerd"}},
			{Machine: "m", Component: "kubelet", Field: "machine.kubelet.extraConfig.featureGates", FeatureGates: []string{"GangScheduling"}},
		}},
		{machine.TypeWorker, []Configured{
			{Machine: "m", Component: "kubelet", Field: "machine.kubelet.extraArgs", Flags: []string{"containerd"}},
			{Machine: "m", Component: "kubelet", Field: "machine.kubelet.extraConfig.featureGates", FeatureGates: []string{"GangScheduling"}},
		}},
	} {
		cfg, err := in.Config(tt.typ)
		if err != nil {
			t.Fatal(err)
		}
		patched, err := cfg.PatchV1Alpha1(func(c *v1alpha1.Config) error {
			if c.ClusterConfig.APIServerConfig == nil {
				c.ClusterConfig.APIServerConfig = &v1alpha1.APIServerConfig{}
			}
			c.ClusterConfig.APIServerConfig.ExtraArgsConfig = v1alpha1.Args{
				"feature-gates": v1alpha1.NewArgValue("HonorPVReclaimPolicy=true,Other=false", nil), "v": v1alpha1.NewArgValue("2", nil)}
			c.MachineConfig.MachineKubelet.KubeletExtraArgs = v1alpha1.Args{"containerd": v1alpha1.NewArgValue("/run/c.sock", nil)}
			c.MachineConfig.MachineKubelet.KubeletExtraConfig = v1alpha1.Unstructured{Object: map[string]any{"featureGates": map[string]any{"GangScheduling": true}}}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := ConfiguredIn("m", patched); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: got %+v\nwant %+v", tt.typ, got, tt.want)
		}
	}
}

// TestRemovedChecks: each gate, flag or API the path removes and the
// cluster uses is refused once, naming it, where it is set, on which
// machines, and what to do; what the path does not remove passes.
func TestRemovedChecks(t *testing.T) {
	on135 := fleet("v1.13.7", "v1.35.2", "")
	gate := func(machine, component, field string, gates ...string) Configured {
		return Configured{Machine: machine, Component: component, Field: field, Flags: []string{"feature-gates"}, FeatureGates: gates}
	}
	withConfigured := func(c Cluster, cf ...Configured) Cluster { c.Configured = cf; return c }
	runCases(t, []checkCase{
		{name: "a removed gate on the API servers", spec: kubeOp("v1.36.2"), cluster: withConfigured(on135,
			gate("cp-1", "kube-apiserver", "cluster.apiServer.extraArgs", "HonorPVReclaimPolicy", "Kept"),
			gate("cp-2", "kube-apiserver", "cluster.apiServer.extraArgs", "HonorPVReclaimPolicy")), want: []Failure{
			{KubernetesRemovedItems, "Kubernetes 1.36 removes the feature gate HonorPVReclaimPolicy (kube-apiserver), which cluster.apiServer.extraArgs sets on cp-1 and cp-2; " +
				"remove it from cluster.apiServer.extraArgs on those machines (kubectl ichor config apply -f PATCH) before upgrading"},
		}},
		{name: "a removed gate in the kubelet's extraConfig", spec: kubeOp("v1.36.0"), cluster: withConfigured(on135,
			Configured{Machine: "w-1", Component: "kubelet", Field: "machine.kubelet.extraConfig.featureGates", FeatureGates: []string{"CSIMigrationPortworx"}}), want: []Failure{
			{KubernetesRemovedItems, "Kubernetes 1.36 removes the feature gate CSIMigrationPortworx (kubelet), which machine.kubelet.extraConfig.featureGates sets on w-1; " +
				"remove it from machine.kubelet.extraConfig.featureGates on those machines (kubectl ichor config apply -f PATCH) before upgrading"},
		}},
		{name: "gates kept by the path pass", spec: kubeOp("v1.36.0"), cluster: withConfigured(on135,
			gate("cp-1", "kube-apiserver", "cluster.apiServer.extraArgs", "AnyVolumeDataSource"))},
		{name: "a patch removes nothing", spec: kubeOp("v1.35.4"), cluster: withConfigured(on135,
			gate("cp-1", "kube-apiserver", "cluster.apiServer.extraArgs", "HonorPVReclaimPolicy"))},
	})
	// 1.37 is beyond the compatibility table, so the path's own refusals
	// come beside KubernetesVersionKnown.
	on136 := withConfigured(fleet("v1.13.7", "v1.36.2", ""),
		Configured{Machine: "w-2", Component: "kubelet", Field: "machine.kubelet.extraArgs", Flags: []string{"containerd", "v"}})
	on136.InUse = map[string]int{"podgroups.v1alpha2.scheduling.k8s.io": 3}
	got := Check(kubeOp("v1.37.0"), on136, table(t))
	want := []Failure{
		{KubernetesVersionKnown, got[0].Message},
		{KubernetesRemovedItems, "Kubernetes 1.37 removes the flag --containerd (kubelet), which machine.kubelet.extraArgs sets on w-2; " +
			"remove it from machine.kubelet.extraArgs on those machines (kubectl ichor config apply -f PATCH) before upgrading; " +
			"Kubernetes 1.37 no longer serves podgroups.v1alpha2.scheduling.k8s.io, which still stores 3 object(s); migrate them to a served version or delete them before upgrading"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("1.36 -> 1.37 got:\n%s\nwant:\n%s", dump(got), dump(want))
	}
	unreadable := on135
	unreadable.Unreadable = []string{"the configuration of cp-2 (connection refused)"}
	if got := Check(kubeOp("v1.36.0"), unreadable, table(t)); len(got) != 1 || got[0].Check != VersionsReadable {
		t.Errorf("an unreadable configuration: %s", dump(got))
	}
}

// TestRunningKubernetes: the lowest tag among the four apps' containers
// (named for the app) and kube-proxy's DaemonSet, digests and registry
// ports handled; other pods and containers do not count.
func TestRunningKubernetes(t *testing.T) {
	pod := func(app, container, image string) corev1.Pod {
		return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"k8s-app": app}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: container, Image: image}}}}
	}
	ds := func(image string) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{}
		d.Spec.Template.Spec.Containers = []corev1.Container{{Name: "kube-proxy", Image: image}}
		return d
	}
	cp := []corev1.Pod{
		pod("kube-apiserver", "kube-apiserver", "registry.k8s.io/kube-apiserver:v1.36.1"),
		pod("kube-controller-manager", "kube-controller-manager", "mirror:5000/kube-controller-manager:v1.36.0@sha256:abc"),
		pod("kube-scheduler", "kube-scheduler", "registry.k8s.io/kube-scheduler:v1.36.1"),
	}
	tests := []struct {
		name  string
		pods  []corev1.Pod
		proxy *appsv1.DaemonSet
		want  string
	}{
		{"the lowest mirror pod", cp, nil, "v1.36.0"},
		{"kube-proxy's DaemonSet behind", cp, ds("registry.k8s.io/kube-proxy:v1.35.3"), "v1.35.3"},
		{"a kube-proxy pod behind its DaemonSet", append(cp, pod("kube-proxy", "kube-proxy", "registry.k8s.io/kube-proxy:v1.35.1")), ds("registry.k8s.io/kube-proxy:v1.36.1"), "v1.35.1"},
		{"other apps and sidecars do not count", append(cp, pod("coredns", "coredns", "coredns:v1.1.0"), pod("kube-apiserver", "sidecar", "x:v1.0.0")), nil, "v1.36.0"},
		{"nothing parses", []corev1.Pod{pod("kube-apiserver", "kube-apiserver", "registry.k8s.io/kube-apiserver:latest")}, nil, ""},
	}
	for _, tt := range tests {
		if got := RunningKubernetes(tt.pods, tt.proxy); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}
