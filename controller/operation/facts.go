package operation

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/preflight"
)

// facts gathers what preflight reads: the versions of the machines in scope
// and of the others, the control plane's Kubernetes version, and Cilium's.
func (t *turn) facts(ctx context.Context) (preflight.Cluster, error) {
	var c preflight.Cluster
	inScope := map[string]bool{}
	for _, m := range t.op.Status.Machines {
		inScope[m.Name] = true
	}
	for i := range t.nodes {
		n := &t.nodes[i]
		pm := preflight.Machine{Name: n.Name, Role: machine.Role(n), Talos: machine.TalosVersion(n), Kubelet: machine.KubeletVersion(n)}
		if inScope[n.Name] {
			c.Machines = append(c.Machines, pm)
		} else {
			c.Others = append(c.Others, pm)
		}
	}
	cp, err := t.controlPlaneVersion(ctx)
	if err != nil {
		return c, err
	}
	c.ControlPlane = cp
	switch t.op.Spec.Kind {
	case ichorv1.KindCNI:
		agents, err := cilium.ReadAgents(ctx, t.r.live())
		if err != nil {
			return c, err
		}
		if agents != nil {
			c.Cilium = agents.Version.String()
		}
		c.CiliumChart = t.r.Controller.Chart.Version
	case ichorv1.KindIchor:
		c.Ichor = t.r.Controller.Version
	}
	return c, nil
}

// controlPlaneVersion is the lowest version of the kube-apiserver static
// pods (as `talosctl upgrade-k8s` detects it), or of the control-plane
// kubelets when the API server runs no such pods.
func (t *turn) controlPlaneVersion(ctx context.Context) (string, error) {
	var pods corev1.PodList
	if err := t.r.Client.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-apiserver"}); err != nil {
		return "", fmt.Errorf("list kube-apiserver pods: %w", err)
	}
	var versions []string
	for _, p := range pods.Items {
		for _, c := range p.Spec.Containers {
			if c.Name == "kube-apiserver" {
				if i := strings.LastIndex(c.Image, ":"); i >= 0 {
					versions = append(versions, c.Image[i+1:])
				}
			}
		}
	}
	if len(versions) == 0 {
		for i := range t.nodes {
			if machine.Role(&t.nodes[i]) == ichorv1.RoleControlPlane {
				versions = append(versions, machine.KubeletVersion(&t.nodes[i]))
			}
		}
	}
	return lowest(versions), nil
}

func lowest(versions []string) string {
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
