package preflight

import (
	_ "embed"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/siderolabs/talos/pkg/machinery/config"
	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/api/compat"
)

//go:embed removed.yaml
var removedYAML []byte

// Removal is what one Kubernetes minor upgrade removes (removed.yaml).
type Removal struct {
	From compat.Minor `json:"from"`
	To   compat.Minor `json:"to"`
	// FeatureGates no longer exist: a component given one fails to start.
	FeatureGates []string `json:"featureGates,omitempty"`
	// Flags are, per component, the flags the new version rejects.
	Flags map[string][]string `json:"flags,omitempty"`
	// APIs are the API resources no longer served, "resource.version.group".
	APIs []string `json:"apis,omitempty"`
}

var removals = sync.OnceValues(func() ([]Removal, error) {
	var out []Removal
	if err := yaml.UnmarshalStrict(removedYAML, &out); err != nil {
		return nil, fmt.Errorf("removed.yaml: %w", err)
	}
	return out, nil
})

// RemovedBetween is what upgrading Kubernetes from one minor to the next
// removes; nothing for a patch within a minor or a path the table does not
// list.
func RemovedBetween(from, to compat.Minor) Removal {
	list, err := removals()
	if err != nil {
		// The embedded table is checked by its tests; this is a broken build.
		panic(err)
	}
	for _, r := range list {
		if r.From == from && r.To == to {
			return r
		}
	}
	return Removal{From: from, To: to}
}

// Empty reports whether the upgrade removes nothing Ichor checks.
func (r Removal) Empty() bool {
	return len(r.FeatureGates) == 0 && len(r.Flags) == 0 && len(r.APIs) == 0
}

// Configured is what one field of one machine's configuration gives one
// component: the flags it sets and the feature gates it names.
type Configured struct {
	Machine string
	// Component is kube-apiserver, kube-controller-manager, kube-scheduler
	// or kubelet.
	Component string
	// Field is where in the machine configuration, like
	// cluster.apiServer.extraArgs.
	Field string
	// Flags are the flags set, without their dashes.
	Flags []string
	// FeatureGates are the gates named (on or off).
	FeatureGates []string
}

// ConfiguredIn reads from a machine's configuration what the removed-items
// checks look at: the extraArgs of the control-plane components (on a
// control plane) and of the kubelet, the gates in their --feature-gates,
// and the kubelet's extraConfig featureGates. Fields that set nothing are
// left out, so 5,000 machines cost little.
func ConfiguredIn(machine string, cfg config.Provider) []Configured {
	var out []Configured
	add := func(component, field string, args map[string][]string) {
		c := Configured{Machine: machine, Component: component, Field: field}
		for flag, values := range args {
			c.Flags = append(c.Flags, flag)
			if flag == "feature-gates" {
				for _, v := range values {
					c.FeatureGates = append(c.FeatureGates, gateNames(v)...)
				}
			}
		}
		if len(c.Flags) > 0 {
			sort.Strings(c.Flags)
			out = append(out, c)
		}
	}
	if cfg.Machine() != nil && cfg.Machine().Type().IsControlPlane() && cfg.Cluster() != nil {
		cl := cfg.Cluster()
		add("kube-apiserver", "cluster.apiServer.extraArgs", cl.APIServer().ExtraArgs())
		add("kube-controller-manager", "cluster.controllerManager.extraArgs", cl.ControllerManager().ExtraArgs())
		add("kube-scheduler", "cluster.scheduler.extraArgs", cl.Scheduler().ExtraArgs())
	}
	if cfg.Machine() == nil {
		return out
	}
	kubelet := cfg.Machine().Kubelet()
	add("kubelet", "machine.kubelet.extraArgs", kubelet.ExtraArgs())
	if gates, ok := kubelet.ExtraConfig()["featureGates"].(map[string]any); ok && len(gates) > 0 {
		c := Configured{Machine: machine, Component: "kubelet", Field: "machine.kubelet.extraConfig.featureGates"}
		for g := range gates {
			c.FeatureGates = append(c.FeatureGates, g)
		}
		sort.Strings(c.FeatureGates)
		out = append(out, c)
	}
	return out
}

// gateNames are the gate names of a --feature-gates value, "A=true,B=false".
func gateNames(v string) []string {
	var out []string
	for _, kv := range strings.Split(v, ",") {
		if name, _, _ := strings.Cut(strings.TrimSpace(kv), "="); name != "" {
			out = append(out, name)
		}
	}
	return out
}

// checkRemoved refuses an upgrade that removes what the cluster still
// uses: a feature gate or flag its configurations set, or objects stored in
// an API resource that goes away. Each refusal names the gate, flag or
// resource, where it is set, and what to do.
func checkRemoved(r *report, rm Removal, c Cluster) {
	if rm.Empty() {
		return
	}
	type use struct{ what, field string }
	where := map[use][]string{}
	var order []use
	note := func(u use, machine string) {
		if _, ok := where[u]; !ok {
			order = append(order, u)
		}
		where[u] = append(where[u], machine)
	}
	for _, cf := range c.Configured {
		for _, g := range cf.FeatureGates {
			if slices.Contains(rm.FeatureGates, g) {
				note(use{fmt.Sprintf("feature gate %s (%s)", g, cf.Component), cf.Field}, cf.Machine)
			}
		}
		for _, f := range cf.Flags {
			if slices.Contains(rm.Flags[cf.Component], f) {
				note(use{fmt.Sprintf("flag --%s (%s)", f, cf.Component), cf.Field}, cf.Machine)
			}
		}
	}
	for _, u := range order {
		r.add(KubernetesRemovedItems, fmt.Sprintf("Kubernetes %s removes the %s, which %s sets on %s; remove it from %s on those machines (kubectl ichor config apply -f PATCH) before upgrading",
			rm.To, u.what, u.field, andList(where[u], 3), u.field))
	}
	for _, api := range rm.APIs {
		if n := c.InUse[api]; n > 0 {
			r.add(KubernetesRemovedItems, fmt.Sprintf("Kubernetes %s no longer serves %s, which still stores %d object(s); migrate them to a served version or delete them before upgrading",
				rm.To, api, n))
		}
	}
}
