package cilium

import (
	"fmt"
	"reflect"
	"slices"
	"strings"

	"helm.sh/helm/v4/pkg/chart/v2/loader"

	"maesh.dev/ichor/api/compat"
)

// KubePrism is Talos's local load balancer for the API server on every
// machine (machine.features.kubePrism, on by default). Without kube-proxy,
// Cilium must reach the API server through it: the kubernetes Service's
// ClusterIP needs the very service proxy Cilium is replacing.
const (
	KubePrismHost = "localhost"
	KubePrismPort = 7445
)

// Capabilities Talos lets Cilium's containers have: Cilium's defaults
// without SYS_MODULE (Talos forbids workloads to load kernel modules) and
// without SYSLOG.
var (
	AgentCapabilities = []string{"CHOWN", "KILL", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "SYS_ADMIN",
		"SYS_RESOURCE", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID"}
	CleanStateCapabilities = []string{"NET_ADMIN", "SYS_ADMIN", "SYS_RESOURCE"}
)

// Plan is what an upgrade passes to Helm and why.
type Plan struct {
	// Values are passed explicitly, over the new chart's defaults (never
	// --reuse-values, whose old-chart defaults would shadow renamed keys).
	Values map[string]any
	// Changes says, one line each, where Values differ from what the user
	// had set: the values Talos requires, the kube-proxy mode, the restarts.
	Changes []string
}

// Current is what the running Cilium has, as read from its release (or, for
// a Cilium Helm does not manage, from cilium-config).
type Current struct {
	// User are the values the user set (`helm get values`), nil when Helm
	// does not manage this Cilium.
	User map[string]any
	// IPAM is the IPAM mode in effect.
	IPAM string
	// KubeProxyReplacement is the kube-proxy mode in effect.
	KubeProxyReplacement bool
	// FirstVersion is the oldest chart version in the release's history,
	// "" when unknown.
	FirstVersion string
}

// PlanValues computes the values of an upgrade: the user's own, then what
// Talos requires (ipam, cgroup, capabilities, KubePrism without kube-proxy),
// the kube-proxy mode asked for, upgradeCompatibility when the user did not
// set it, and agent restarts when the mode changes (agents read
// cilium-config only at start). It refuses what it cannot change in place.
func PlanValues(cur Current, kubeProxyReplacement bool) (Plan, error) {
	if cur.IPAM != "" && cur.IPAM != "kubernetes" {
		return Plan{}, fmt.Errorf("cilium runs with ipam.mode %s, and Talos needs ipam.mode kubernetes; Cilium cannot change its IPAM mode on a running cluster, "+
			"so Ichor does not: migrate the cluster's IPAM by Cilium's own procedure first, or keep managing this Cilium yourself", cur.IPAM)
	}
	want := map[string]any{
		"ipam":   map[string]any{"mode": "kubernetes"},
		"cgroup": map[string]any{"autoMount": map[string]any{"enabled": false}, "hostRoot": "/sys/fs/cgroup"},
		"securityContext": map[string]any{"capabilities": map[string]any{
			"ciliumAgent":      toAny(AgentCapabilities),
			"cleanCiliumState": toAny(CleanStateCapabilities),
		}},
		"kubeProxyReplacement": kubeProxyReplacement,
	}
	if kubeProxyReplacement {
		want["k8sServiceHost"], want["k8sServicePort"] = KubePrismHost, KubePrismPort
	}
	if _, set := cur.User["upgradeCompatibility"]; !set && cur.FirstVersion != "" {
		if v, err := compat.ParseVersion(cur.FirstVersion); err == nil {
			want["upgradeCompatibility"] = v.MajorMinor().String()
		}
	}
	if cur.KubeProxyReplacement != kubeProxyReplacement {
		want["rollOutCiliumPods"] = true
		want["operator"] = map[string]any{"rollOutPods": true}
	}
	vals := loader.MergeMaps(copyValues(cur.User), want)
	var changes []string
	for _, key := range flatten("", want) {
		before, had := lookup(cur.User, key)
		after, _ := lookup(vals, key)
		if had && reflect.DeepEqual(before, after) {
			continue
		}
		if had {
			changes = append(changes, fmt.Sprintf("%s: %v -> %v", key, before, after))
		} else {
			changes = append(changes, fmt.Sprintf("%s: %v", key, after))
		}
	}
	return Plan{Values: vals, Changes: changes}, nil
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// copyValues is a deep copy of a values tree, so the user's stay as read.
func copyValues(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok {
			v = copyValues(sub)
		}
		out[k] = v
	}
	return out
}

// flatten lists the dotted keys of a values tree's leaves, sorted.
func flatten(prefix string, m map[string]any) []string {
	var out []string
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok {
			out = append(out, flatten(prefix+k+".", sub)...)
			continue
		}
		out = append(out, prefix+k)
	}
	slices.Sort(out)
	return out
}

// lookup finds a dotted key in a values tree.
func lookup(m map[string]any, key string) (any, bool) {
	parts := strings.Split(key, ".")
	var cur any = m
	for _, p := range parts {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = mm[p]; !ok {
			return nil, false
		}
	}
	return cur, true
}

// Bool reads a kube-proxy-replacement setting as Cilium does: true, "true"
// (and the old "strict") mean on; anything else off.
func Bool(v any) bool {
	switch b := v.(type) {
	case bool:
		return b
	case string:
		return b == "true" || b == "strict"
	}
	return false
}
