package preflight

import (
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"maesh.dev/ichor/api/compat"
)

// KubernetesApps are the k8s-app labels of the pods in kube-system whose
// image tags say which Kubernetes runs: the control-plane mirror pods and
// kube-proxy's (talosctl's DetectLowestVersion reads the same four).
var KubernetesApps = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy"}

// RunningKubernetes is the Kubernetes version the cluster runs as talosctl
// upgrade-k8s detects it: the lowest image tag among the containers named
// for their app in the pods labelled with one of KubernetesApps, and in
// kube-proxy's DaemonSet (nil if there is none), whose template its pods
// follow. An upgrade that stopped half way is thus seen at the version it
// left behind, not at the API server's. "" when no tag parses.
func RunningKubernetes(pods []corev1.Pod, proxy *appsv1.DaemonSet) string {
	var tags []string
	add := func(app string, containers []corev1.Container) {
		for _, c := range containers {
			if c.Name == app {
				tags = append(tags, imageTag(c.Image))
			}
		}
	}
	for i := range pods {
		if app := pods[i].Labels["k8s-app"]; slices.Contains(KubernetesApps, app) {
			add(app, pods[i].Spec.Containers)
		}
	}
	if proxy != nil {
		add("kube-proxy", proxy.Spec.Template.Spec.Containers)
	}
	return LowestVersion(tags)
}

// imageTag is the tag of an image reference, without a digest:
// "registry.k8s.io/kube-apiserver:v1.35.2@sha256:..." is "v1.35.2".
func imageTag(image string) string {
	image, _, _ = strings.Cut(image, "@")
	i := strings.LastIndexByte(image, ':')
	if i < 0 || strings.LastIndexByte(image, '/') > i {
		return ""
	}
	return image[i+1:]
}

// LowestVersion is the lowest of the versions that parse, as written;
// "" when none does.
func LowestVersion(versions []string) string {
	var best compat.Version
	found := ""
	for _, s := range versions {
		v, err := compat.ParseVersion(s)
		if err != nil {
			continue
		}
		if found == "" || v.Compare(best) < 0 {
			best, found = v, s
		}
	}
	return found
}
