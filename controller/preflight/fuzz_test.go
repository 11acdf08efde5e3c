package preflight

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

// FuzzCheck: for any target and any versions the machines report, Check
// never panics, reports each failure once under a known name in the order of
// Checks with a message, answers the same twice, and refuses what the
// rules say it must refuse. The seed corpus runs in every `go test`;
// `go test -fuzz FuzzCheck ./controller/preflight` explores.
func FuzzCheck(f *testing.F) {
	tab := table(f)
	seeds := []struct {
		kube                                        bool
		target, talos, otherTalos, kubelet, cp, cil string
	}{
		{false, "v1.13.7", "v1.12.4", "v1.12.4", "v1.35.2", "v1.35.2", "v1.19.3"},
		{false, "v1.13.0-beta.1", "v1.12.4", "v1.11.2", "v1.34.0", "v1.34.0", ""},
		{false, "v1.14.0", "v1.10.3", "v1.13.7", "v1.30.1", "v1.29.0", "v1.16.0"},
		{false, "v1.12.0", "v1.13.7", "v1.12.4", "v1.36.2", "v1.36.2", "none"},
		{false, "v1.13.18446744073709551615", "v1.0.0", "v0.0.1", "v1.0.0", "v1.0.0", "bad"},
		{false, "v2.0.0", "v1.13.7", "", "", "", ""},
		{true, "v1.35.2", "v1.12.4", "v1.11.5", "v1.34.3", "v1.34.3", "v1.19.3"},
		{true, "v1.36.0-rc.1+x", "v1.13.7", "v1.13.7", "v1.31.0", "v1.34.3", ""},
		{true, "v1.37.0", "v1.13.7", "v1.9.0", "v1.38.0", "v1.36.0", "v1.20.0"},
		{true, "v1.2.0", "v1.13.7", "v1.13.7", "v0.1.0", "v1.0.0", ""},
		{true, "v2.1.0", "v1.13.7", "v1.13.7", "v1.36.0", "v1.36.0", ""},
		{true, "1.35", "x", "y", "z", "w", "v"},
	}
	for _, s := range seeds {
		f.Add(s.kube, s.target, s.talos, s.otherTalos, s.kubelet, s.cp, s.cil)
	}
	f.Fuzz(func(t *testing.T, kube bool, target, talos, otherTalos, kubelet, cp, cilium string) {
		spec := talosOp(target)
		if kube {
			spec = kubeOp(target)
		}
		c := Cluster{
			Machines: []Machine{
				{Name: "cp-1", Role: v1alpha1.RoleControlPlane, Talos: talos, Kubelet: kubelet},
				{Name: "w-1", Role: v1alpha1.RoleWorker, Talos: otherTalos, Kubelet: cp},
			},
			Others:       []Machine{{Name: "w-9", Role: v1alpha1.RoleWorker, Talos: otherTalos, Kubelet: kubelet}},
			ControlPlane: cp, Cilium: cilium,
		}
		got := Check(spec, c, tab)
		if again := Check(spec, c, tab); !reflect.DeepEqual(got, again) {
			t.Fatalf("Check answered %v, then %v", got, again)
		}
		last := -1
		for _, fl := range got {
			i := slices.Index(Checks, fl.Check)
			if i <= last || fl.Message == "" {
				t.Fatalf("failure %q out of order, repeated, unknown or without a message: %v", fl.Check, got)
			}
			last = i
		}
		failed := func(check string) bool {
			return slices.ContainsFunc(got, func(f Failure) bool { return f.Check == check })
		}

		v, err := compat.ParseVersion(target)
		valid, final, newer, skip := TalosVersionValid, TalosVersionFinal, TalosVersionNewer, TalosMinorSkip
		if kube {
			valid, final, newer, skip = KubernetesVersionValid, KubernetesVersionFinal, KubernetesVersionNewer, KubernetesMinorSkip
		}
		if err != nil {
			if len(got) != 1 || !failed(valid) {
				t.Fatalf("target %q does not parse, yet failures are %v", target, got)
			}
			return
		}
		if !v.Final() && !failed(final) {
			t.Fatalf("pre-release target %s passed %s", v, final)
		}
		if len(got) == 0 && !strings.HasPrefix(v.String(), "v1.") {
			t.Fatalf("target %s passed every check: nothing this Ichor knows", v)
		}
		// The version the target must be newer than, and not more than a
		// minor ahead of: the lowest Talos in scope, or the control plane's.
		var lowest *compat.Version
		candidates := []string{talos, otherTalos}
		if kube {
			candidates = []string{cp}
		}
		for _, s := range candidates {
			if r, err := compat.ParseVersion(s); err == nil && (lowest == nil || r.Compare(*lowest) < 0) {
				lowest = &r
			}
		}
		if lowest != nil {
			if v.Compare(*lowest) <= 0 && !failed(newer) {
				t.Fatalf("target %s is not newer than %s, yet %s passed: %v", v, lowest, newer, got)
			}
			if n, ok := v.MajorMinor().Ahead(lowest.MajorMinor()); ok && n > 1 && !failed(skip) {
				t.Fatalf("target %s is %d minors ahead of %s, yet %s passed: %v", v, n, lowest, skip, got)
			}
		}
	})
}
