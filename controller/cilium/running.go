package cilium

import (
	"context"
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
)

// Where Cilium lives, as its chart installs it.
const (
	Namespace = "kube-system"
	Release   = "cilium"
	// FieldManager is the helm CLI's server-side apply field manager.
	FieldManager   = "helm"
	DaemonSet      = "cilium"
	ConfigMap      = "cilium-config"
	AgentContainer = "cilium-agent"
	// ConfigKubeProxyReplacement and ConfigIPAM are cilium-config's keys.
	ConfigKubeProxyReplacement = "kube-proxy-replacement"
	ConfigIPAM                 = "ipam"
)

// Agents is the Cilium that runs: its DaemonSet and its configuration.
type Agents struct {
	// Version is the agents' version from their image tag, like v1.19.6.
	Version compat.Version
	// Image is the agent container's image.
	Image string
	// KubeProxyReplacement and IPAM are from cilium-config.
	KubeProxyReplacement bool
	IPAM                 string
	// DaemonSet is the agents' DaemonSet as read.
	DaemonSet *appsv1.DaemonSet
}

// ReadAgents reads the running Cilium; nil (and no error) when there is no
// Cilium DaemonSet.
func ReadAgents(ctx context.Context, c client.Reader) (*Agents, error) {
	ds := &appsv1.DaemonSet{}
	err := c.Get(ctx, client.ObjectKey{Namespace: Namespace, Name: DaemonSet}, ds)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read DaemonSet %s/%s: %w", Namespace, DaemonSet, err)
	}
	a := &Agents{DaemonSet: ds}
	for _, ctr := range ds.Spec.Template.Spec.Containers {
		if ctr.Name == AgentContainer {
			a.Image = ctr.Image
		}
	}
	if a.Image == "" {
		return nil, fmt.Errorf("DaemonSet %s/%s has no %s container: it is not Cilium's", Namespace, DaemonSet, AgentContainer)
	}
	if a.Version, err = compat.ParseVersion(ImageTag(a.Image)); err != nil {
		return nil, fmt.Errorf("the Cilium agent image %s carries no version tag: %w", a.Image, err)
	}
	cm := &corev1.ConfigMap{}
	err = c.Get(ctx, client.ObjectKey{Namespace: Namespace, Name: ConfigMap}, cm)
	if err != nil && !apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("read ConfigMap %s/%s: %w", Namespace, ConfigMap, err)
	}
	a.KubeProxyReplacement = Bool(cm.Data[ConfigKubeProxyReplacement])
	a.IPAM = cm.Data[ConfigIPAM]
	return a, nil
}

// ImageTag is an image reference's tag: "v1.19.6" of
// "quay.io/cilium/cilium:v1.19.6@sha256:...", "" when it has none.
func ImageTag(image string) string {
	image, _, _ = strings.Cut(image, "@")
	name := image[strings.LastIndex(image, "/")+1:]
	if i := strings.LastIndex(name, ":"); i >= 0 {
		return name[i+1:]
	}
	return ""
}

// RolledOut reports whether every agent runs the DaemonSet's current
// template and is available, and says what is missing when not.
func RolledOut(ds *appsv1.DaemonSet) (bool, string) {
	st := ds.Status
	switch {
	case st.ObservedGeneration < ds.Generation:
		return false, "the DaemonSet controller has not seen the new template yet"
	case st.UpdatedNumberScheduled < st.DesiredNumberScheduled:
		return false, fmt.Sprintf("%d of %d agents updated", st.UpdatedNumberScheduled, st.DesiredNumberScheduled)
	case st.NumberAvailable < st.DesiredNumberScheduled || st.NumberUnavailable > 0:
		return false, fmt.Sprintf("%d of %d agents available", st.NumberAvailable, st.DesiredNumberScheduled)
	}
	return true, fmt.Sprintf("%d agents updated and available", st.DesiredNumberScheduled)
}
