package view

import (
	"fmt"
	"strings"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Icons, argo-rollouts style, with one-character ASCII stand-ins so columns
// stay aligned when the terminal cannot show them.
type icon struct{ unicode, ascii string }

var (
	iconOK       = icon{"✔", "+"}
	iconProgress = icon{"◌", "~"}
	iconWaiting  = icon{"◷", "."}
	iconPaused   = icon{"॥", "="}
	iconBad      = icon{"✖", "x"}
	iconSkipped  = icon{"•", "-"}
)

func (i icon) String(ascii bool) string {
	if ascii {
		return i.ascii
	}
	return i.unicode
}

// Legend explains the icons; `watch --help` prints it.
func Legend() string {
	return fmt.Sprintf("  %s succeeded  %s in progress  %s pending or waiting  %s paused  %s failed or refused  %s skipped or cancelled\n"+
		"  (with --ascii: %s %s %s %s %s %s)",
		iconOK.unicode, iconProgress.unicode, iconWaiting.unicode, iconPaused.unicode, iconBad.unicode, iconSkipped.unicode,
		iconOK.ascii, iconProgress.ascii, iconWaiting.ascii, iconPaused.ascii, iconBad.ascii, iconSkipped.ascii)
}

// opState is how an operation looks at a glance: an icon, a colour and a
// phase word.
func opState(op *ichorv1.TalosOperation) (icon, style, string) {
	switch {
	case op.Succeeded():
		return iconOK, green, string(ichorv1.PhaseSucceeded)
	case op.Refused():
		return iconBad, red, string(ichorv1.PhaseRefused)
	case op.Cancelled():
		return iconSkipped, faint, string(ichorv1.PhaseCancelled)
	case op.StepFailed() && !op.RetryPending():
		// Paused by a failed step: the phase, with the reason StepFailed beside it.
		return iconBad, red, string(ichorv1.PhasePaused)
	case op.PausedByOperator() || op.Status.Reason == ichorv1.ReasonPausedByOperator:
		return iconPaused, yellow, string(ichorv1.PhasePaused)
	case op.Status.Phase == ichorv1.PhasePaused:
		return iconWaiting, blue, string(ichorv1.PhasePaused)
	case op.Status.Phase == ichorv1.PhaseRunning:
		return iconProgress, yellow, string(ichorv1.PhaseRunning)
	}
	return iconWaiting, faint, string(ichorv1.PhasePending)
}

func machineState(p ichorv1.MachinePhase) (icon, style) {
	switch p {
	case ichorv1.MachineSucceeded:
		return iconOK, green
	case ichorv1.MachineInProgress:
		return iconProgress, yellow
	case ichorv1.MachineFailed:
		return iconBad, red
	case ichorv1.MachineSkipped:
		return iconSkipped, faint
	}
	return iconWaiting, faint
}

// Target says in a few words what the operation moves to: status.target when
// the controller has written it, otherwise it is read from the spec.
func Target(op *ichorv1.TalosOperation) string {
	if op.Status.Target != "" {
		return Clean(op.Status.Target)
	}
	s := op.Spec
	on := func(b *bool) bool { return b == nil || *b }
	which := func(parts ...string) string { return strings.Join(parts, "+") }
	switch s.Kind {
	case ichorv1.KindTalos:
		if s.Talos != nil {
			return "talos " + Clean(s.Talos.Version)
		}
	case ichorv1.KindKubernetes:
		if s.Kubernetes != nil {
			return "kubernetes " + Clean(s.Kubernetes.Version)
		}
	case ichorv1.KindIchor:
		if s.Ichor != nil {
			return "ichor " + Clean(s.Ichor.Version)
		}
	case ichorv1.KindCNI:
		t := "cni"
		if s.CNI != nil && s.CNI.ChartVersion != "" {
			t += " " + Clean(s.CNI.ChartVersion)
		}
		if s.CNI != nil && s.CNI.KubeProxyReplacement != nil {
			t += fmt.Sprintf(" kube-proxy-replacement=%t", *s.CNI.KubeProxyReplacement)
		}
		return t
	case ichorv1.KindConfig:
		if s.Config != nil {
			return Clean(s.Config.Summary())
		}
	case ichorv1.KindNode:
		if s.Node != nil {
			return fmt.Sprintf("node %s %s", s.Node.Action, Clean(s.Node.Machine))
		}
	case ichorv1.KindCARotation:
		var parts []string
		if s.CARotation == nil || on(s.CARotation.Talos) {
			parts = append(parts, "talos")
		}
		if s.CARotation == nil || on(s.CARotation.Kubernetes) {
			parts = append(parts, "kubernetes")
		}
		return "rotate ca " + which(parts...)
	case ichorv1.KindKeyRotation:
		var parts []string
		if s.KeyRotation == nil || on(s.KeyRotation.ServiceAccount) {
			parts = append(parts, "service-account")
		}
		if s.KeyRotation == nil || on(s.KeyRotation.Secretbox) {
			parts = append(parts, "secretbox")
		}
		return "rotate keys " + which(parts...)
	case ichorv1.KindEtcdRestore:
		if s.EtcdRestore != nil {
			return "restore etcd from " + Clean(s.EtcdRestore.Snapshot)
		}
	}
	return Clean(string(s.Kind))
}
