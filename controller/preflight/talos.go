package preflight

import (
	"fmt"
	"slices"
	"strings"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/compatibility"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

func checkTalos(r *report, up *v1alpha1.TalosUpgrade, c Cluster, t *compat.Table) {
	newest := t.Newest().Latest
	if up == nil {
		r.add(TalosVersionValid, "spec.talos is not set; set spec.talos.version to the Talos version to install, like "+newest.String())
		return
	}
	target, err := compat.ParseVersion(up.Version)
	if err != nil {
		r.add(TalosVersionValid, fmt.Sprintf("spec.talos.version %q is not a version like %s", up.Version, newest))
		return
	}
	if len(c.Machines) == 0 {
		r.add(MachinesInScope, "no machine is in scope, so there is nothing to upgrade; make spec.machines select at least one Node")
	}
	f := gather(r, c.Machines, c)

	if !target.Final() {
		such := target.Core()
		if latest, ok := t.Latest(target.MajorMinor()); ok && latest.Compare(such) > 0 {
			such = latest
		}
		r.add(TalosVersionFinal, fmt.Sprintf("Talos %s is not a final release (it has a pre-release or build suffix); pick a final release such as %s", target, such))
	}
	_, known := t.Latest(target.MajorMinor())
	if !known {
		r.add(TalosVersionKnown, talosUnknown(target, t))
	}
	if lowest, ok := lowestOf(f.talos); ok {
		checkTalosNewer(r, target, f.talos, f.machines, t)
		checkTalosSkip(r, target, lowest, f.machines, t)
	}
	// Without the target in the table, machinery and the table can only
	// repeat TalosVersionKnown.
	if !known {
		return
	}
	tv := machineryTalos(target)
	checkUpgradeableFrom(r, target, tv, f.talos, f.machines)
	checkKubernetesWithTalos(r, target, tv, f, t)
	if f.controlPlane != nil && f.ciliumOK {
		if err := t.Supports(target.String(), f.controlPlane.String(), f.cilium); err != nil {
			r.add(CompatibilityTable, err.Error()+" (see kubectl ichor compat)")
		}
	}
}

func talosUnknown(target compat.Version, t *compat.Table) string {
	oldest, newest := t.Oldest(), t.Newest()
	if target.MajorMinor().Compare(newest.Minor) > 0 {
		return fmt.Sprintf("Talos %s is newer than any Talos this Ichor knows (%s to %s), so it cannot check the upgrade; "+
			"pick a Talos %s release or older (the latest %s patch this Ichor lists is %s; newer patches are accepted), or upgrade Ichor first",
			target, oldest.Minor, newest.Minor, newest.Minor, newest.Minor, newest.Latest)
	}
	return fmt.Sprintf("Talos %s is older than any Talos this Ichor knows (%s to %s), so it cannot check the upgrade; "+
		"pick a version of Talos %s to %s", target, oldest.Minor, newest.Minor, oldest.Minor, newest.Minor)
}

func lowestOf(gs groups) (group, bool) {
	if len(gs) == 0 {
		return group{}, false
	}
	return gs[0], true
}

// checkTalosNewer: the target must be newer than the lowest version running
// (or nothing is upgraded) and not older than any (Ichor never downgrades a
// machine; one already on the target is left alone).
func checkTalosNewer(r *report, target compat.Version, running groups, all int, t *compat.Table) {
	lowest, highest := running[0], running[len(running)-1]
	if target.Compare(lowest.v) > 0 && target.Compare(highest.v) >= 0 {
		return
	}
	if lowest.v == highest.v {
		msg := fmt.Sprintf("Talos %s is not newer than %s, the lowest version running (%s); pick a version newer than %s",
			target, lowest.v, on(lowest.who, all), lowest.v)
		if next, ok := nextTalos(lowest.v, t); ok {
			msg += ", such as " + next.String()
		}
		r.add(TalosVersionNewer, msg)
		return
	}
	var newer []string
	count := 0
	for _, g := range running {
		if g.v.Compare(target) > 0 {
			newer = append(newer, fmt.Sprintf("%s %s", g.v, on(g.who, all)))
			count += len(g.who)
		}
	}
	if len(newer) > 3 {
		newer = append(newer[:3], fmt.Sprintf("%d more versions", len(newer)-3))
	}
	r.add(TalosVersionNewer, fmt.Sprintf("Talos %s is older than what %d machine(s) run (%s), and Ichor does not downgrade a machine; "+
		"pick %s or newer, or leave those machines out with spec.machines", target, count, strings.Join(newer, "; "), highest.v))
}

// nextTalos is the release to suggest above v: the latest patch of v's minor,
// or else of the next minor.
func nextTalos(v compat.Version, t *compat.Table) (compat.Version, bool) {
	if latest, ok := t.Latest(v.MajorMinor()); ok && latest.Compare(v) > 0 {
		return latest, true
	}
	return t.Latest(compat.Minor{Major: v.Major, Minor: v.Minor + 1})
}

func checkTalosSkip(r *report, target compat.Version, lowest group, all int, t *compat.Table) {
	n, ok := target.MajorMinor().Ahead(lowest.v.MajorMinor())
	if !ok || n < 2 {
		return
	}
	msg := fmt.Sprintf("Talos %s is %d minors ahead of %s, the lowest version running (%s), and Talos is upgraded one minor at a time; ",
		target, n, lowest.v, on(lowest.who, all))
	if path := t.TalosPath(lowest.v, target); path != nil {
		msg += "go through the latest patch of each minor: " + strings.Join(path, ", then ")
	} else {
		msg += "go through the latest patch of each minor in between"
	}
	r.add(TalosMinorSkip, msg)
}

// machineryTalos is the target as machinery's compatibility package takes it.
// Both parse semantic versions, so a version compat read, machinery reads.
func machineryTalos(v compat.Version) *compatibility.TalosVersion {
	tv, err := compatibility.ParseTalosVersion(&machine.VersionInfo{Tag: v.String()})
	if err != nil {
		panic(fmt.Sprintf("machinery cannot read %s: %v", v, err))
	}
	return tv
}

func machineryKubernetes(v compat.Version) *compatibility.KubernetesVersion {
	kv, err := compatibility.ParseKubernetesVersion(v.String())
	if err != nil {
		panic(fmt.Sprintf("machinery cannot read %s: %v", v, err))
	}
	return kv
}

func checkUpgradeableFrom(r *report, target compat.Version, tv *compatibility.TalosVersion, running groups, all int) {
	var refusals []string
	for _, g := range running {
		if err := tv.UpgradeableFrom(machineryTalos(g.v)); err != nil {
			refusals = append(refusals, fmt.Sprintf("over %s (%s): %v", g.v, on(g.who, all), err))
		}
	}
	if len(refusals) == 0 {
		return
	}
	r.add(TalosUpgradeableFrom, fmt.Sprintf("Talos %s cannot be installed %s; Talos %s installs over %s",
		target, strings.Join(refusals, "; "), target.MajorMinor(), acceptedHosts(tv, target)))
}

// acceptedHosts says which Talos minors a target installs over, asking
// machinery about the .0 of the minors around it (its bounds are .0s).
func acceptedHosts(tv *compatibility.TalosVersion, target compat.Version) string {
	var first, last *compat.Minor
	lo := target.Minor - min(target.Minor, 4)
	for m := lo; m <= target.Minor+2; m++ {
		host := compat.Version{Major: target.Major, Minor: m}
		if tv.UpgradeableFrom(machineryTalos(host)) != nil {
			continue
		}
		minor := host.MajorMinor()
		if first == nil {
			first = &minor
		}
		last = &minor
	}
	if first == nil {
		return "no Talos machinery knows"
	}
	return fmt.Sprintf("Talos %s to %s", first, last)
}

// checkKubernetesWithTalos: the Kubernetes running now (control plane and
// the kubelets in scope) must run with the target, since a Talos upgrade
// does not change it.
func checkKubernetesWithTalos(r *report, target compat.Version, tv *compatibility.TalosVersion, f facts, t *compat.Table) {
	var kube groups
	if f.controlPlane != nil {
		kube.add(*f.controlPlane, "the control plane")
	}
	for _, g := range f.kubelets {
		for _, who := range g.who {
			kube.add(g.v, "kubelet "+who)
		}
	}
	span, _ := t.KubernetesRange(target.MajorMinor())
	var refusals, remedies []string
	for _, g := range kube {
		err := machineryKubernetes(g.v).SupportedWith(tv)
		if err == nil {
			continue
		}
		refusals = append(refusals, fmt.Sprintf("Kubernetes %s (%s): %v", g.v, kubeWho(g.who, f.machines), err))
		remedy := "pick a Talos that runs Kubernetes " + g.v.MajorMinor().String()
		if g.v.MajorMinor().Compare(span.Min.MajorMinor()) < 0 {
			remedy = "upgrade Kubernetes to " + span.Min.String() + " or newer first"
		}
		if !slices.Contains(remedies, remedy) {
			remedies = append(remedies, remedy)
		}
	}
	if len(refusals) == 0 {
		return
	}
	r.add(TalosKubernetesSupported, fmt.Sprintf("Talos %s does not run %s; Talos %s runs Kubernetes %s, so %s",
		target, strings.Join(refusals, "; "), target.MajorMinor(), span, strings.Join(remedies, " and ")))
}

// kubeWho names who runs a Kubernetes version: "the control plane, kubelets
// on w-1 and w-2".
func kubeWho(who []string, all int) string {
	var parts, kubelets []string
	for _, w := range who {
		if name, ok := strings.CutPrefix(w, "kubelet "); ok {
			kubelets = append(kubelets, name)
		} else {
			parts = append(parts, w)
		}
	}
	switch len(kubelets) {
	case 0:
	case 1:
		parts = append(parts, "the kubelet "+on(kubelets, all))
	default:
		parts = append(parts, "kubelets "+on(kubelets, all))
	}
	return strings.Join(parts, ", ")
}
