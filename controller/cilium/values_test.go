package cilium

import (
	"reflect"
	"strings"
	"testing"
)

func TestPlanValues(t *testing.T) {
	user := map[string]any{
		"ipam":        map[string]any{"mode": "kubernetes"},
		"bpf":         map[string]any{"masquerade": true},
		"extraConfig": map[string]any{"custom": "kept"},
		"cgroup":      map[string]any{"autoMount": map[string]any{"enabled": true}},
	}
	tests := []struct {
		name    string
		cur     Current
		kpr     bool
		want    map[string]any // dotted key -> value, checked in Values
		changes []string
		err     string
	}{
		{
			name: "keeps the user's values, enforces Talos's, keeps kube-proxy",
			cur:  Current{User: user, IPAM: "kubernetes", FirstVersion: "1.17.4"},
			want: map[string]any{"bpf.masquerade": true, "extraConfig.custom": "kept", "ipam.mode": "kubernetes",
				"cgroup.autoMount.enabled": false, "cgroup.hostRoot": "/sys/fs/cgroup", "kubeProxyReplacement": false,
				"upgradeCompatibility": "1.17"},
			changes: []string{"cgroup.autoMount.enabled: true -> false", "cgroup.hostRoot: /sys/fs/cgroup", "kubeProxyReplacement: false",
				"securityContext.capabilities.ciliumAgent: [CHOWN KILL NET_ADMIN NET_RAW IPC_LOCK SYS_ADMIN SYS_RESOURCE DAC_OVERRIDE FOWNER SETGID SETUID]",
				"securityContext.capabilities.cleanCiliumState: [NET_ADMIN SYS_ADMIN SYS_RESOURCE]", "upgradeCompatibility: 1.17"},
		},
		{
			name: "switching to kube-proxy replacement goes through KubePrism and restarts the agents",
			cur:  Current{User: map[string]any{"upgradeCompatibility": "1.16"}, IPAM: "kubernetes", FirstVersion: "1.18.0"},
			kpr:  true,
			want: map[string]any{"kubeProxyReplacement": true, "k8sServiceHost": "localhost", "k8sServicePort": 7445,
				"rollOutCiliumPods": true, "operator.rollOutPods": true, "upgradeCompatibility": "1.16"},
		},
		{
			name: "the mode kept restarts nothing",
			cur:  Current{KubeProxyReplacement: true},
			kpr:  true,
			want: map[string]any{"kubeProxyReplacement": true, "k8sServicePort": 7445},
		},
		{
			name: "another IPAM mode is refused",
			cur:  Current{IPAM: "cluster-pool"},
			err:  "cilium runs with ipam.mode cluster-pool, and Talos needs ipam.mode kubernetes",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := PlanValues(tt.cur, tt.kpr)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for key, want := range tt.want {
				if got, ok := lookup(p.Values, key); !ok || !reflect.DeepEqual(got, want) {
					t.Errorf("%s = %v (set %v), want %v", key, got, ok, want)
				}
			}
			caps, _ := lookup(p.Values, "securityContext.capabilities.ciliumAgent")
			for _, c := range caps.([]any) {
				if c == "SYS_MODULE" {
					t.Error("the agent keeps SYS_MODULE, which Talos forbids")
				}
			}
			if _, ok := lookup(p.Values, "rollOutCiliumPods"); ok != (tt.cur.KubeProxyReplacement != tt.kpr) {
				t.Errorf("rollOutCiliumPods set = %v, want it exactly when the mode changes", ok)
			}
			if tt.changes != nil && !reflect.DeepEqual(p.Changes, tt.changes) {
				t.Errorf("changes:\n%s\nwant:\n%s", strings.Join(p.Changes, "\n"), strings.Join(tt.changes, "\n"))
			}
			if v, _ := lookup(tt.cur.User, "cgroup.autoMount.enabled"); tt.cur.User != nil && v != nil && v != true {
				t.Error("PlanValues changed the user's values in place")
			}
		})
	}
}

func TestImageTag(t *testing.T) {
	for image, want := range map[string]string{
		"quay.io/cilium/cilium:v1.19.6@sha256:abcd": "v1.19.6",
		"registry.local:5000/cilium/cilium:v1.18.1": "v1.18.1",
		"registry.local:5000/cilium/cilium":         "",
		"cilium:v1.17.0":                            "v1.17.0",
	} {
		if got := ImageTag(image); got != want {
			t.Errorf("ImageTag(%s) = %q, want %q", image, got, want)
		}
	}
}
