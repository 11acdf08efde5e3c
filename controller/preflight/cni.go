package preflight

import (
	"fmt"
	"strings"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

// checkCNI: the chart is the one this Ichor ships, not older than the
// running Cilium and at most one minor ahead of it (Cilium's only tested
// path), and the Talos x Kubernetes x Cilium combination it makes is in the
// table.
func checkCNI(r *report, spec *v1alpha1.CNIChange, c Cluster, t *compat.Table) {
	shipped := c.CiliumChart
	if shipped == "" {
		shipped = t.CiliumChart.Version
	}
	if spec != nil && spec.ChartVersion != "" && strings.TrimPrefix(spec.ChartVersion, "v") != shipped {
		r.add(CiliumChartShipped, fmt.Sprintf("this Ichor ships the Cilium chart %s only, not %s: leave spec.cni.chartVersion empty, or use the Ichor release that ships %s",
			shipped, spec.ChartVersion, spec.ChartVersion))
	}
	target, err := compat.ParseVersion(shipped)
	if err != nil {
		r.add(VersionsReadable, fmt.Sprintf("the shipped chart's version %q is not a version", shipped))
		return
	}
	f := gather(r, append(append([]Machine(nil), c.Machines...), c.Others...), c)
	if !f.ciliumOK || f.cilium == "" {
		return // the kind's own check says no Cilium runs
	}
	running := compat.MustParseVersion(f.cilium)
	if target.Core().Compare(running.Core()) < 0 {
		r.add(CiliumVersionNewer, fmt.Sprintf("the cluster runs Cilium %s, newer than the chart %s this Ichor ships, and Ichor does not downgrade Cilium; upgrade Ichor to a release that ships %s or newer",
			running, target, running.MajorMinor()))
	}
	if n, ok := target.MajorMinor().Ahead(running.MajorMinor()); ok && n > 1 {
		next := compat.Minor{Major: running.Major, Minor: running.Minor + 1}
		r.add(CiliumMinorSkip, fmt.Sprintf("the chart %s is %d minors ahead of Cilium %s, which runs, and Cilium is upgraded one minor at a time (its only tested path); "+
			"move Cilium to the latest %s patch first, with an Ichor release that ships it", target, n, running, next))
	}
	if f.controlPlane == nil {
		return
	}
	var errs []string
	seen := map[compat.Minor]bool{}
	for _, g := range f.talos {
		if m := g.v.MajorMinor(); !seen[m] {
			seen[m] = true
			if err := t.Supports(m.String(), f.controlPlane.String(), target.String()); err != nil {
				errs = append(errs, err.Error())
			}
		}
	}
	if len(errs) > 0 {
		r.add(CompatibilityTable, strings.Join(errs, "; ")+" (see kubectl ichor compat)")
	}
}

// checkIchor: the target is a final release newer than the controller
// that runs.
func checkIchor(r *report, up *v1alpha1.IchorUpgrade, c Cluster) {
	if up == nil {
		r.add(IchorVersionValid, "spec.ichor is not set; set spec.ichor.version to the Ichor release to install, like v0.2.0")
		return
	}
	target, err := compat.ParseVersion(up.Version)
	if err != nil {
		r.add(IchorVersionValid, fmt.Sprintf("spec.ichor.version %q is not a version like v0.2.0", up.Version))
		return
	}
	if !target.Final() {
		r.add(IchorVersionFinal, fmt.Sprintf("Ichor %s is not a final release; pick a release such as %s", target, target.Core()))
	}
	running, err := compat.ParseVersion(c.Ichor)
	if err != nil {
		r.add(VersionsReadable, fmt.Sprintf("the running controller's version %q is not a version, so Ichor cannot tell whether %s is newer", c.Ichor, target))
		return
	}
	if target.Compare(running) <= 0 {
		r.add(IchorVersionNewer, fmt.Sprintf("Ichor %s is not newer than %s, which runs; Ichor does not downgrade itself (its CRD and status may have moved on): pick a release newer than %s",
			target, running, running))
	}
}
