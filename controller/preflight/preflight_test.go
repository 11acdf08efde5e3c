package preflight

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/api/v1alpha1"
)

func table(t testing.TB) *compat.Table {
	t.Helper()
	tab, err := compat.Default()
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

// fleet is three control planes and two workers, all on one Talos and one Kubernetes.
func fleet(talos, kube, cilium string) Cluster {
	c := Cluster{ControlPlane: kube, Cilium: cilium}
	for _, n := range []string{"cp-1", "cp-2", "cp-3", "w-1", "w-2"} {
		role := v1alpha1.RoleWorker
		if strings.HasPrefix(n, "cp-") {
			role = v1alpha1.RoleControlPlane
		}
		c.Machines = append(c.Machines, Machine{Name: n, Role: role, Talos: talos, Kubelet: kube})
	}
	return c
}

// with changes one machine of the fleet.
func with(c Cluster, name, talos, kubelet string) Cluster {
	c.Machines = append([]Machine(nil), c.Machines...)
	for i := range c.Machines {
		if c.Machines[i].Name == name {
			c.Machines[i].Talos, c.Machines[i].Kubelet = talos, kubelet
		}
	}
	return c
}

func talosOp(version string) v1alpha1.TalosOperationSpec {
	return v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindTalos, Talos: &v1alpha1.TalosUpgrade{Version: version}}
}

func kubeOp(version string) v1alpha1.TalosOperationSpec {
	return v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindKubernetes, Kubernetes: &v1alpha1.KubernetesUpgrade{Version: version}}
}

type checkCase struct {
	name    string
	spec    v1alpha1.TalosOperationSpec
	cluster Cluster
	want    []Failure
}

func runCases(t *testing.T, cases []checkCase) {
	t.Helper()
	tab := table(t)
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			got := Check(tt.spec, tt.cluster, tab)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Check got %d failures:\n%s\nwant %d:\n%s", len(got), dump(got), len(tt.want), dump(tt.want))
			}
		})
	}
}

func dump(fs []Failure) string {
	var b strings.Builder
	for _, f := range fs {
		fmt.Fprintf(&b, "  %s: %s\n", f.Check, f.Message)
	}
	return b.String()
}

// fiveMachines is how a message names every machine of the fleet: not a
// list of most of them.
const fiveMachines = "all 5 machines"

func TestTalosChecks(t *testing.T) {
	on112 := fleet("v1.12.4", "v1.35.2", "v1.19.3")
	on111 := fleet("v1.11.3", "v1.34.1", "v1.19.0")
	runCases(t, []checkCase{
		{name: "one minor up passes", spec: talosOp("v1.13.7"), cluster: on112},
		{name: "a patch up passes", spec: talosOp("v1.12.7"), cluster: on112},
		{name: "a patch newer than the table lists passes", spec: talosOp("v1.13.70"), cluster: on112},
		{name: "without Cilium passes", spec: talosOp("v1.13.7"), cluster: fleet("v1.12.4", "v1.35.2", "")},
		{name: "pre-release", spec: talosOp("v1.13.0-beta.1"), cluster: on112, want: []Failure{
			{TalosVersionFinal, "Talos v1.13.0-beta.1 is not a final release (it has a pre-release or build suffix); pick a final release such as v1.13.7"},
		}},
		{name: "build metadata", spec: talosOp("v1.13.7+dirty"), cluster: on112, want: []Failure{
			{TalosVersionFinal, "Talos v1.13.7+dirty is not a final release (it has a pre-release or build suffix); pick a final release such as v1.13.7"},
		}},
		{name: "downgrade", spec: talosOp("v1.12.2"), cluster: on112, want: []Failure{
			{TalosVersionNewer, "Talos v1.12.2 is not newer than v1.12.4, the lowest version running (on " + fiveMachines + "); pick a version newer than v1.12.4, such as v1.12.7"},
		}},
		{name: "same version", spec: talosOp("v1.12.7"), cluster: fleet("v1.12.7", "v1.35.2", "v1.19.3"), want: []Failure{
			{TalosVersionNewer, "Talos v1.12.7 is not newer than v1.12.7, the lowest version running (on " + fiveMachines + "); pick a version newer than v1.12.7, such as v1.13.7"},
		}},
		{name: "one machine is named, not all 1", spec: talosOp("v1.12.2"), cluster: Cluster{ControlPlane: "v1.35.2",
			Machines: []Machine{{Name: "cp-1", Role: v1alpha1.RoleControlPlane, Talos: "v1.12.4", Kubelet: "v1.35.2"}}}, want: []Failure{
			{TalosVersionNewer, "Talos v1.12.2 is not newer than v1.12.4, the lowest version running (on cp-1); pick a version newer than v1.12.4, such as v1.12.7"},
		}},
		{name: "all but an unreadable machine are not all", spec: talosOp("v1.12.2"), cluster: with(on112, "w-2", "", "v1.35.2"), want: []Failure{
			{VersionsReadable, `Ichor cannot read Talos "" on w-2, so it cannot check them; fix what the Nodes report (status.nodeInfo.osImage and kubeletVersion) or leave those machines out with spec.machines`},
			{TalosVersionNewer, "Talos v1.12.2 is not newer than v1.12.4, the lowest version running (on cp-1, cp-2, cp-3 and 1 more); pick a version newer than v1.12.4, such as v1.12.7"},
		}},
		{name: "newer than the lowest, mixed fleet", spec: talosOp("v1.12.4"),
			cluster: with(on112, "w-2", "v1.12.1", "v1.35.2"), want: nil},
		// One machine ahead of the target would be downgraded, although the others are behind it.
		{name: "older than one machine", spec: talosOp("v1.13.7"),
			cluster: with(fleet("v1.13.2", "v1.35.2", "v1.19.3"), "w-2", "v1.13.9", "v1.35.2"), want: []Failure{
				{TalosVersionNewer, "Talos v1.13.7 is older than what 1 machine(s) run (v1.13.9 on w-2), and Ichor does not downgrade a machine; pick v1.13.9 or newer, or leave those machines out with spec.machines"},
			}},
		{name: "older than machines on two versions", spec: talosOp("v1.13.7"),
			cluster: with(with(fleet("v1.13.2", "v1.35.2", "v1.19.3"), "w-2", "v1.13.9", "v1.35.2"), "w-1", "v1.13.8", "v1.35.2"), want: []Failure{
				{TalosVersionNewer, "Talos v1.13.7 is older than what 2 machine(s) run (v1.13.8 on w-1; v1.13.9 on w-2), and Ichor does not downgrade a machine; pick v1.13.9 or newer, or leave those machines out with spec.machines"},
			}},
		{name: "on the target already, others behind, passes", spec: talosOp("v1.13.7"),
			cluster: with(fleet("v1.13.2", "v1.35.2", "v1.19.3"), "w-2", "v1.13.7", "v1.35.2")},
		{name: "older than all, on two versions", spec: talosOp("v1.13.1"),
			cluster: with(fleet("v1.13.2", "v1.35.2", "v1.19.3"), "w-2", "v1.13.7", "v1.35.2"), want: []Failure{
				{TalosVersionNewer, "Talos v1.13.1 is older than what 5 machine(s) run (v1.13.2 on cp-1, cp-2, cp-3 and 1 more; v1.13.7 on w-2), and Ichor does not downgrade a machine; pick v1.13.7 or newer, or leave those machines out with spec.machines"},
			}},
		{name: "two minors ahead", spec: talosOp("v1.13.7"), cluster: on111, want: []Failure{
			{TalosMinorSkip, "Talos v1.13.7 is 2 minors ahead of v1.11.3, the lowest version running (on " + fiveMachines + "), and Talos is upgraded one minor at a time; go through the latest patch of each minor: v1.12.7, then v1.13.7"},
		}},
		{name: "a host too old for the target", spec: talosOp("v1.13.7"),
			cluster: with(fleet("v1.12.4", "v1.33.4", "v1.19.3"), "w-2", "v1.10.3", "v1.33.4"), want: []Failure{
				{TalosMinorSkip, "Talos v1.13.7 is 3 minors ahead of v1.10.3, the lowest version running (on w-2), and Talos is upgraded one minor at a time; go through the latest patch of each minor: v1.11.6, then v1.12.7, then v1.13.7"},
				{TalosUpgradeableFrom, "Talos v1.13.7 cannot be installed over v1.10.3 (on w-2): host version 1.10.3 is too old to upgrade to Talos 1.13.7; Talos 1.13 installs over Talos 1.11 to 1.14"},
			}},
		{name: "newer than Ichor knows", spec: talosOp("v1.14.0"), cluster: on112, want: []Failure{
			{TalosVersionKnown, "Talos v1.14.0 is newer than any Talos this Ichor knows (1.10 to 1.13), so it cannot check the upgrade; pick a Talos 1.13 release or older (the latest 1.13 patch this Ichor lists is v1.13.7; newer patches are accepted), or upgrade Ichor first"},
			{TalosMinorSkip, "Talos v1.14.0 is 2 minors ahead of v1.12.4, the lowest version running (on " + fiveMachines + "), and Talos is upgraded one minor at a time; go through the latest patch of each minor: v1.13.7, then v1.14.0"},
		}},
		{name: "older than Ichor knows", spec: talosOp("v1.9.6"), cluster: on112, want: []Failure{
			{TalosVersionKnown, "Talos v1.9.6 is older than any Talos this Ichor knows (1.10 to 1.13), so it cannot check the upgrade; pick a version of Talos 1.10 to 1.13"},
			{TalosVersionNewer, "Talos v1.9.6 is not newer than v1.12.4, the lowest version running (on " + fiveMachines + "); pick a version newer than v1.12.4, such as v1.12.7"},
		}},
		{name: "Kubernetes too old for the target", spec: talosOp("v1.12.7"),
			cluster: with(fleet("v1.11.3", "v1.29.8", ""), "w-1", "v1.11.3", "v1.29.2"), want: []Failure{
				{TalosKubernetesSupported, "Talos v1.12.7 does not run Kubernetes v1.29.2 (the kubelet on w-1): version of Kubernetes 1.29.2 is too old to be used with Talos 1.12.7; " +
					"Kubernetes v1.29.8 (the control plane, kubelets on cp-1, cp-2, cp-3 and 1 more): version of Kubernetes 1.29.8 is too old to be used with Talos 1.12.7; " +
					"Talos 1.12 runs Kubernetes 1.30 - 1.35, so upgrade Kubernetes to 1.30 or newer first"},
				{CompatibilityTable, "Kubernetes v1.29.8 with Talos v1.12.7 is not in Ichor's compatibility table, which lists Kubernetes 1.30 - 1.35 with Talos 1.12 (see kubectl ichor compat)"},
			}},
		{name: "Kubernetes too new for a Talos downgrade", spec: talosOp("v1.12.0"),
			cluster: with(fleet("v1.13.7", "v1.36.2", ""), "w-2", "v1.11.6", "v1.36.2"), want: []Failure{
				{TalosVersionNewer, "Talos v1.12.0 is older than what 4 machine(s) run (v1.13.7 on cp-1, cp-2, cp-3 and 1 more), and Ichor does not downgrade a machine; pick v1.13.7 or newer, or leave those machines out with spec.machines"},
				{TalosKubernetesSupported, "Talos v1.12.0 does not run Kubernetes v1.36.2 (the control plane, kubelets on " + fiveMachines + "): version of Kubernetes 1.36.2 is too new to be used with Talos 1.12.0; " +
					"Talos 1.12 runs Kubernetes 1.30 - 1.35, so pick a Talos that runs Kubernetes 1.36"},
				{CompatibilityTable, "Kubernetes v1.36.2 with Talos v1.12.0 is not in Ichor's compatibility table, which lists Kubernetes 1.30 - 1.35 with Talos 1.12 (see kubectl ichor compat)"},
			}},
		{name: "Cilium not in the table", spec: talosOp("v1.13.7"), cluster: fleet("v1.12.4", "v1.35.2", "v1.17.2"), want: []Failure{
			{CompatibilityTable, "Cilium v1.17.2 with Talos v1.13.7 and Kubernetes v1.35.2 is not in Ichor's compatibility table, which lists Cilium 1.19, 1.20 or none with them (see kubectl ichor compat)"},
		}},
		{name: "no machine in scope", spec: talosOp("v1.13.7"), cluster: Cluster{ControlPlane: "v1.35.2"}, want: []Failure{
			{MachinesInScope, "no machine is in scope, so there is nothing to upgrade; make spec.machines select at least one Node"},
		}},
		{name: "unreadable versions", spec: talosOp("v1.13.7"),
			cluster: func() Cluster {
				c := with(on112, "w-1", "", "1.35")
				c.Cilium = "stable"
				return c
			}(), want: []Failure{
				{VersionsReadable, `Ichor cannot read Talos "" on w-1, kubelet "1.35" on w-1 and Cilium "stable", so it cannot check them; fix what the Nodes report (status.nodeInfo.osImage and kubeletVersion) or leave those machines out with spec.machines`},
			}},
		{name: "spec.talos missing", spec: v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindTalos}, cluster: on112, want: []Failure{
			{TalosVersionValid, "spec.talos is not set; set spec.talos.version to the Talos version to install, like v1.13.7"},
		}},
		{name: "not a version", spec: talosOp("latest"), cluster: on112, want: []Failure{
			{TalosVersionValid, `spec.talos.version "latest" is not a version like v1.13.7`},
		}},
	})
}

func TestKubernetesChecks(t *testing.T) {
	on134 := fleet("v1.12.4", "v1.34.3", "v1.19.3")
	runCases(t, []checkCase{
		{name: "one minor up passes", spec: kubeOp("v1.35.2"), cluster: on134},
		{name: "a patch up passes", spec: kubeOp("v1.34.5"), cluster: on134},
		{name: "pre-release", spec: kubeOp("v1.35.0-rc.1"), cluster: on134, want: []Failure{
			{KubernetesVersionFinal, "Kubernetes v1.35.0-rc.1 is not a final release (it has a pre-release or build suffix); pick a final release such as v1.35.0"},
		}},
		{name: "not newer", spec: kubeOp("v1.34.1"), cluster: on134, want: []Failure{
			{KubernetesVersionNewer, "Kubernetes v1.34.1 is not newer than v1.34.3, which the control plane runs; pick a version newer than v1.34.3"},
			// A downgrade would leave every kubelet ahead of the API server.
			{KubeletSkew, "kubelets may not be newer than the API server at v1.34.1: v1.34.3 on " + fiveMachines + "; pick a target at least as new as the newest kubelet"},
		}},
		{name: "two minors ahead", spec: kubeOp("v1.36.0"), cluster: on134, want: []Failure{
			{KubernetesMinorSkip, "Kubernetes v1.36.0 is 2 minors ahead of v1.34.3, which the control plane runs, and Kubernetes is upgraded one minor at a time; upgrade to a 1.35 release first"},
			{KubernetesTalosSupported, "Kubernetes v1.36.0 does not run on Talos v1.12.4 (on " + fiveMachines + "): version of Kubernetes 1.36.0 is too new to be used with Talos 1.12.4; Kubernetes 1.36 runs on Talos 1.13: move Talos on those machines there first"},
			{CompatibilityTable, "Kubernetes v1.36.0 with Talos 1.12 is not in Ichor's compatibility table, which lists Kubernetes 1.30 - 1.35 with Talos 1.12 (see kubectl ichor compat)"},
		}},
		{name: "newer than Ichor knows", spec: kubeOp("v1.37.0"), cluster: fleet("v1.13.7", "v1.36.2", ""), want: []Failure{
			{KubernetesVersionKnown, "Kubernetes v1.37.0 runs on no Talos this Ichor knows (Talos 1.10 to 1.13 run Kubernetes 1.28 to 1.36), so it cannot check the upgrade; pick a version of Kubernetes 1.28 to 1.36, or upgrade Ichor first"},
		}},
		{name: "a machine out of scope on an old Talos", spec: kubeOp("v1.35.2"),
			cluster: func() Cluster {
				c := on134
				c.Others = []Machine{{Name: "w-9", Role: v1alpha1.RoleWorker, Talos: "v1.11.5", Kubelet: "v1.34.3"}}
				return c
			}(), want: []Failure{
				{KubernetesTalosSupported, "Kubernetes v1.35.2 does not run on Talos v1.11.5 (on w-9): version of Kubernetes 1.35.2 is too new to be used with Talos 1.11.5; Kubernetes 1.35 runs on Talos 1.12 or 1.13: move Talos on those machines there first"},
				{CompatibilityTable, "Kubernetes v1.35.2 with Talos 1.11 is not in Ichor's compatibility table, which lists Kubernetes 1.29 - 1.34 with Talos 1.11 (see kubectl ichor compat)"},
			}},
		{name: "kubelet too far behind", spec: kubeOp("v1.35.0"), cluster: with(on134, "w-2", "v1.12.4", "v1.31.4"), want: []Failure{
			{KubeletSkew, "kubelets would be more than 3 minors behind the API server at v1.35.0: v1.31.4 on w-2; upgrade those kubelets to 1.32 or newer first"},
		}},
		{name: "kubelet three behind passes", spec: kubeOp("v1.35.0"), cluster: with(on134, "w-2", "v1.12.4", "v1.32.9")},
		{name: "kubelet newer than the target", spec: kubeOp("v1.35.2"),
			cluster: with(fleet("v1.13.7", "v1.34.3", "v1.19.3"), "w-1", "v1.13.7", "v1.36.0"), want: []Failure{
				{KubeletSkew, "kubelets may not be newer than the API server at v1.35.2: v1.36.0 on w-1; pick a target at least as new as the newest kubelet"},
			}},
		{name: "Cilium not in the table", spec: kubeOp("v1.35.2"), cluster: fleet("v1.12.4", "v1.34.3", "v1.18.5"), want: []Failure{
			{CompatibilityTable, "Cilium v1.18.5 with Talos 1.12 and Kubernetes v1.35.2 is not in Ichor's compatibility table, which lists Cilium 1.19, 1.20 or none with them (see kubectl ichor compat)"},
		}},
		{name: "control plane unreadable", spec: kubeOp("v1.35.2"), cluster: fleet("v1.12.4", "", "v1.19.3"), want: []Failure{
			{VersionsReadable, `Ichor cannot read kubelet "" on cp-1, kubelet "" on cp-2, kubelet "" on cp-3, kubelet "" on w-1, kubelet "" on w-2 and 1 more, so it cannot check them; fix what the Nodes report (status.nodeInfo.osImage and kubeletVersion) or leave those machines out with spec.machines`},
		}},
		{name: "no machine in scope", spec: kubeOp("v1.35.2"), cluster: Cluster{ControlPlane: "v1.34.3"}, want: []Failure{
			{MachinesInScope, "no machine is in scope, so there is nothing to upgrade; make spec.machines select at least one Node"},
		}},
		{name: "spec.kubernetes missing", spec: v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindKubernetes}, cluster: on134, want: []Failure{
			{KubernetesVersionValid, "spec.kubernetes is not set; set spec.kubernetes.version to the Kubernetes version to run, like v1.36.2"},
		}},
		{name: "not a version", spec: kubeOp("v1.35"), cluster: on134, want: []Failure{
			{KubernetesVersionValid, `spec.kubernetes.version "v1.35" is not a version like v1.36.2`},
		}},
	})
}

func cniOp(chart string) v1alpha1.TalosOperationSpec {
	return v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindCNI, CNI: &v1alpha1.CNIChange{ChartVersion: chart}}
}

func shipping(c Cluster, chart string) Cluster {
	c.CiliumChart = chart
	return c
}

func TestCNIChecks(t *testing.T) {
	on135 := fleet("v1.13.7", "v1.35.2", "v1.18.11")
	runCases(t, []checkCase{
		{name: "one minor up passes", spec: cniOp(""), cluster: shipping(on135, "1.19.6")},
		{name: "the chart named is the one shipped", spec: cniOp("1.19.6"), cluster: shipping(on135, "1.19.6")},
		{name: "the same version passes (a mode switch)", spec: cniOp(""), cluster: shipping(fleet("v1.13.7", "v1.35.2", "v1.19.6"), "1.19.6")},
		{name: "another chart than the shipped one", spec: cniOp("1.20.2"), cluster: shipping(on135, "1.19.6"), want: []Failure{
			{CiliumChartShipped, "this Ichor ships the Cilium chart 1.19.6 only, not 1.20.2: leave spec.cni.chartVersion empty, or use the Ichor release that ships 1.20.2"},
		}},
		{name: "two minors ahead", spec: cniOp(""), cluster: shipping(fleet("v1.13.7", "v1.33.4", "v1.17.9"), "1.19.6"), want: []Failure{
			{CiliumMinorSkip, "the chart v1.19.6 is 2 minors ahead of Cilium v1.17.9, which runs, and Cilium is upgraded one minor at a time (its only tested path); move Cilium to the latest 1.18 patch first, with an Ichor release that ships it"},
		}},
		{name: "a downgrade", spec: cniOp(""), cluster: shipping(fleet("v1.13.7", "v1.35.2", "v1.20.1"), "1.19.6"), want: []Failure{
			{CiliumVersionNewer, "the cluster runs Cilium v1.20.1, newer than the chart v1.19.6 this Ichor ships, and Ichor does not downgrade Cilium; upgrade Ichor to a release that ships 1.20 or newer"},
		}},
		{name: "Kubernetes the chart does not run with", spec: cniOp(""), cluster: shipping(fleet("v1.13.7", "v1.36.1", "v1.18.11"), "1.19.6"), want: []Failure{
			{CompatibilityTable, "Cilium v1.19.6 with Talos 1.13 and Kubernetes v1.36.1 is not in Ichor's compatibility table, which lists Cilium 1.20 or none with them (see kubectl ichor compat)"},
		}},
		{name: "the shipped chart by default", spec: v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindCNI}, cluster: on135},
	})
}

func ichorOp(version string) v1alpha1.TalosOperationSpec {
	return v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindIchor, Ichor: &v1alpha1.IchorUpgrade{Version: version}}
}

func TestIchorChecks(t *testing.T) {
	running := Cluster{Ichor: "v0.1.0"}
	runCases(t, []checkCase{
		{name: "newer passes", spec: ichorOp("v0.2.0"), cluster: running},
		{name: "from a development build", spec: ichorOp("v0.2.0"), cluster: Cluster{Ichor: "v0.1.0-3-gabc1234"}},
		{name: "pre-release", spec: ichorOp("v0.2.0-rc.1"), cluster: running, want: []Failure{
			{IchorVersionFinal, "Ichor v0.2.0-rc.1 is not a final release; pick a release such as v0.2.0"},
		}},
		{name: "not newer", spec: ichorOp("v0.1.0"), cluster: running, want: []Failure{
			{IchorVersionNewer, "Ichor v0.1.0 is not newer than v0.1.0, which runs; Ichor does not downgrade itself (its CRD and status may have moved on): pick a release newer than v0.1.0"},
		}},
		{name: "unreadable running version", spec: ichorOp("v0.2.0"), cluster: Cluster{Ichor: "dev"}, want: []Failure{
			{VersionsReadable, `the running controller's version "dev" is not a version, so Ichor cannot tell whether v0.2.0 is newer`},
		}},
		{name: "spec.ichor missing", spec: v1alpha1.TalosOperationSpec{Kind: v1alpha1.KindIchor}, cluster: running, want: []Failure{
			{IchorVersionValid, "spec.ichor is not set; set spec.ichor.version to the Ichor release to install, like v0.2.0"},
		}},
	})
}

func TestOtherKindsHaveNoVersionChecks(t *testing.T) {
	tab := table(t)
	for _, kind := range v1alpha1.Kinds {
		switch kind {
		case v1alpha1.KindTalos, v1alpha1.KindKubernetes, v1alpha1.KindCNI, v1alpha1.KindIchor:
			continue
		}
		if got := Check(v1alpha1.TalosOperationSpec{Kind: kind}, Cluster{}, tab); got != nil {
			t.Errorf("kind %s: %v", kind, got)
		}
	}
}

// A refusal over thousands of machines names a few and counts the rest, so
// the condition message stays short.
func TestMessagesStayShortOnLargeFleets(t *testing.T) {
	c := Cluster{ControlPlane: "v1.35.2", Cilium: "v1.19.3"}
	for i := range 5000 {
		c.Machines = append(c.Machines, Machine{Name: fmt.Sprintf("w-%04d", i), Talos: "v1.10.3", Kubelet: fmt.Sprintf("v1.%d.0", 30+i%6)})
	}
	fs := Check(talosOp("v1.13.7"), c, table(t))
	if len(fs) == 0 {
		t.Fatal("no failure")
	}
	for _, f := range fs {
		if len(f.Message) > 2000 {
			t.Errorf("%s message is %d bytes: %.200s...", f.Check, len(f.Message), f.Message)
		}
		if !strings.Contains(f.Message, "more") && !strings.Contains(f.Message, "all 5000 machines") && f.Check != CompatibilityTable {
			t.Errorf("%s message does not count the rest: %s", f.Check, f.Message)
		}
	}
}

func TestEventHelpers(t *testing.T) {
	fs := []Failure{{TalosMinorSkip, "two minors"}, {CompatibilityTable, "not listed"}}
	if got, want := Names(fs), "TalosMinorSkip, CompatibilityTable"; got != want {
		t.Errorf("Names = %q, want %q", got, want)
	}
	if got, want := OverriddenMessage(fs), "spec.override is true: running although preflight refused it; bypassed checks: TalosMinorSkip, CompatibilityTable"; got != want {
		t.Errorf("OverriddenMessage = %q", got)
	}
	now := metav1.NewTime(time.Unix(1700000000, 0))
	conds := Conditions(fs, 3, now)
	want := metav1.Condition{Type: CompatibilityTable, Status: metav1.ConditionFalse, Reason: ConditionReason, Message: "not listed", ObservedGeneration: 3, LastTransitionTime: now}
	if len(conds) != 2 || conds[1] != want {
		t.Errorf("Conditions = %+v", conds)
	}
}

// TestRefusedMessage: the phase message names each failed check once and
// ends with the override only where it can run the operation.
func TestRefusedMessage(t *testing.T) {
	tests := []struct {
		name     string
		failures []Failure
		want     string
	}{
		{"one check", []Failure{{TalosMinorSkip, "two minors"}},
			"preflight refused it, nothing ran: check TalosMinorSkip failed (its condition says what would pass); to run it anyway, an ichor-admin sets spec.override: true"},
		{"three checks", []Failure{{TalosVersionNewer, "pick v1.12.7"}, {TalosMinorSkip, "go through v1.12.7"}, {CompatibilityTable, "not listed"}},
			"preflight refused it, nothing ran: checks TalosVersionNewer, TalosMinorSkip and CompatibilityTable failed (each one's condition says what would pass); to run it anyway, an ichor-admin sets spec.override: true"},
		{"an unsupported kind", []Failure{{v1alpha1.CheckKindSupported, "kind etcd-restore"}},
			"preflight refused it, nothing ran: check KindSupported failed (its condition says what would pass)"},
		{"a malformed version beside an overridable check", []Failure{{TalosVersionValid, "not a version"}, {CompatibilityTable, "not listed"}},
			"preflight refused it, nothing ran: checks TalosVersionValid and CompatibilityTable failed (each one's condition says what would pass)"},
		{"no machine", []Failure{{MachinesInScope, "none"}},
			"preflight refused it, nothing ran: check MachinesInScope failed (its condition says what would pass)"},
		{"a chart not shipped", []Failure{{CiliumChartShipped, "1.20.2"}},
			"preflight refused it, nothing ran: check CiliumChartShipped failed (its condition says what would pass)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := RefusedMessage(tt.failures); got != tt.want {
				t.Errorf("RefusedMessage =\n%q\nwant\n%q", got, tt.want)
			}
			if got, want := Overridable(tt.failures), strings.Contains(tt.want, "spec.override"); got != want {
				t.Errorf("Overridable = %v, want %v", got, want)
			}
			for _, f := range tt.failures {
				if strings.Contains(RefusedMessage(tt.failures), f.Message) {
					t.Errorf("the phase message repeats %s's message %q, which only its condition carries", f.Check, f.Message)
				}
			}
		})
	}
}

// TestNotOverridableAreChecks: every check the API says override cannot get
// past is one this package or the controller reports.
func TestNotOverridableAreChecks(t *testing.T) {
	for _, c := range v1alpha1.NotOverridable() {
		if c != v1alpha1.CheckKindSupported && !slices.Contains(Checks, c) {
			t.Errorf("%s is not a check", c)
		}
	}
}
