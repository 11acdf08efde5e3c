package preflight

import (
	"fmt"
	"strings"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

// maxKubeletSkew is how many minors a kubelet may be behind the API server
// (Kubernetes' version skew policy since 1.28).
const maxKubeletSkew = 3

func checkKubernetes(r *report, up *v1alpha1.KubernetesUpgrade, c Cluster, t *compat.Table) {
	if up == nil {
		r.add(KubernetesVersionValid, "spec.kubernetes is not set; set spec.kubernetes.version to the Kubernetes version to run, like v1.36.2")
		return
	}
	target, err := compat.ParseVersion(up.Version)
	if err != nil {
		r.add(KubernetesVersionValid, fmt.Sprintf("spec.kubernetes.version %q is not a version like v1.36.2", up.Version))
		return
	}
	if len(c.Machines) == 0 {
		r.add(MachinesInScope, "no machine is in scope, so there is nothing to upgrade; make spec.machines select at least one Node")
	}
	// Machines out of scope keep their Talos and kubelet, so they count.
	f := gather(r, append(append([]Machine(nil), c.Machines...), c.Others...), c)

	if !target.Final() {
		r.add(KubernetesVersionFinal, fmt.Sprintf("Kubernetes %s is not a final release (it has a pre-release or build suffix); pick a final release such as %s",
			target, target.Core()))
	}
	talosFor := t.TalosFor(target.MajorMinor())
	if len(talosFor) == 0 {
		r.add(KubernetesVersionKnown, kubernetesUnknown(target, t))
	}
	if cp := f.controlPlane; cp != nil {
		if target.Compare(*cp) <= 0 {
			r.add(KubernetesVersionNewer, fmt.Sprintf("Kubernetes %s is not newer than %s, which the control plane runs; pick a version newer than %s",
				target, cp, cp))
		}
		if n, ok := target.MajorMinor().Ahead(cp.MajorMinor()); ok && n > 1 {
			next := compat.Minor{Major: cp.Major, Minor: cp.Minor + 1}
			r.add(KubernetesMinorSkip, fmt.Sprintf("Kubernetes %s is %d minors ahead of %s, which the control plane runs, and Kubernetes is upgraded one minor at a time; upgrade to a %s release first",
				target, n, cp, next))
		}
	}
	checkKubeletSkew(r, target, f.kubelets, f.machines)
	if cp := f.controlPlane; cp != nil {
		checkRemoved(r, RemovedBetween(cp.MajorMinor(), target.MajorMinor()), c)
	}
	if len(talosFor) == 0 {
		return
	}
	checkTalosRunsKubernetes(r, target, talosFor, f.talos, f.machines)
	if f.ciliumOK {
		var errs []string
		seen := map[compat.Minor]bool{}
		for _, g := range f.talos {
			if m := g.v.MajorMinor(); !seen[m] {
				seen[m] = true
				if err := t.Supports(m.String(), target.String(), f.cilium); err != nil {
					errs = append(errs, err.Error())
				}
			}
		}
		if len(errs) > 0 {
			r.add(CompatibilityTable, strings.Join(errs, "; ")+" (see kubectl ichor compat)")
		}
	}
}

func kubernetesUnknown(target compat.Version, t *compat.Table) string {
	lo, _ := t.KubernetesRange(t.Oldest().Minor)
	hi, _ := t.KubernetesRange(t.Newest().Minor)
	return fmt.Sprintf("Kubernetes %s runs on no Talos this Ichor knows (Talos %s to %s run Kubernetes %s to %s), so it cannot check the upgrade; "+
		"pick a version of Kubernetes %s to %s, or upgrade Ichor first", target, t.Oldest().Minor, t.Newest().Minor, lo.Min, hi.Max, lo.Min, hi.Max)
}

// checkTalosRunsKubernetes: every machine's Talos must run the target, in
// machinery's judgement (what talosctl upgrade-k8s checks).
func checkTalosRunsKubernetes(r *report, target compat.Version, talosFor []compat.Minor, running groups, all int) {
	kv := machineryKubernetes(target)
	var refusals []string
	for _, g := range running {
		if err := kv.SupportedWith(machineryTalos(g.v)); err != nil {
			refusals = append(refusals, fmt.Sprintf("Talos %s (%s): %v", g.v, on(g.who, all), err))
		}
	}
	if len(refusals) == 0 {
		return
	}
	minors := make([]string, len(talosFor))
	for i, m := range talosFor {
		minors[i] = m.String()
	}
	r.add(KubernetesTalosSupported, fmt.Sprintf("Kubernetes %s does not run on %s; Kubernetes %s runs on Talos %s: move Talos on those machines there first",
		target, strings.Join(refusals, "; "), target.MajorMinor(), orList(minors)))
}

// checkKubeletSkew: while the control plane moves to the target the kubelets
// keep their version, so none may be more than three minors behind the
// target, nor newer than it.
func checkKubeletSkew(r *report, target compat.Version, kubelets groups, all int) {
	var behind, ahead []string
	for _, g := range kubelets {
		switch {
		case g.v.Core().Compare(target.Core()) > 0:
			ahead = append(ahead, fmt.Sprintf("%s %s", g.v, on(g.who, all)))
		case g.v.Major < target.Major:
			behind = append(behind, fmt.Sprintf("%s %s", g.v, on(g.who, all)))
		case g.v.Major == target.Major && target.Minor-g.v.Minor > maxKubeletSkew: // g.v <= target here
			behind = append(behind, fmt.Sprintf("%s %s", g.v, on(g.who, all)))
		}
	}
	if len(behind) > 0 {
		oldest := compat.Minor{Major: target.Major, Minor: target.Minor - min(target.Minor, maxKubeletSkew)}
		r.add(KubeletSkew, fmt.Sprintf("kubelets would be more than %d minors behind the API server at %s: %s; upgrade those kubelets to %s or newer first",
			maxKubeletSkew, target, strings.Join(behind, ", "), oldest))
	}
	if len(ahead) > 0 {
		r.add(KubeletSkew, fmt.Sprintf("kubelets may not be newer than the API server at %s: %s; pick a target at least as new as the newest kubelet",
			target, strings.Join(ahead, ", ")))
	}
}
