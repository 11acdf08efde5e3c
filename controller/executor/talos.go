package executor

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
)

var (
	metav1GetOptions = metav1.GetOptions{}
	patchOptions     = metav1.PatchOptions{FieldManager: "ichor-controller"}
)

// Steps of the talos kind.
const (
	StepInspect = "inspect"
	StepInstall = "install"
	StepReboot  = "reboot"
)

// TalosUpgrade upgrades Talos (and the installer schematic) one machine at a
// time: inspect (version, boot ID, schematic), etcd health (control planes),
// cordon, drain, install, reboot, wait until it is back on the target with a
// new boot ID, uncordon. Machines below 1.13 install and reboot in one legacy
// MachineService.Upgrade call; 1.13 and later pull the installer, run
// LifecycleService.Upgrade and then reboot.
type TalosUpgrade struct{}

// Target implements Executor.
func (TalosUpgrade) Target(op *ichorv1.TalosOperation) (string, string) {
	t := op.Spec.Talos
	if t == nil {
		return "", ""
	}
	if t.Schematic != "" {
		return fmt.Sprintf("talos %s (schematic %.8s)", t.Version, t.Schematic), t.Version
	}
	return "talos " + t.Version, t.Version
}

// Scope implements Executor: every selected machine.
func (TalosUpgrade) Scope(_ *ichorv1.TalosOperation, nodes []corev1.Node) ([]corev1.Node, error) {
	return nodes, nil
}

// HonourHold implements Executor.
func (TalosUpgrade) HonourHold() bool { return true }

// Check implements Executor; the version checks are the preflight package's.
func (TalosUpgrade) Check(context.Context, *Env) []string { return nil }

// Steps implements Executor.
func (TalosUpgrade) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	steps := []Step{inspectStep()}
	if m.Role == ichorv1.RoleControlPlane {
		steps = append(steps, etcdHealthStep())
	}
	drainOff := op.Spec.Drain != nil && op.Spec.Drain.Disabled
	if !drainOff {
		steps = append(steps, cordonStep(), drainStep())
	}
	legacy := m.From != "" && !talos.HasLifecycleAPI(m.From)
	steps = append(steps, installStep(legacy))
	if !legacy {
		steps = append(steps, rebootStep())
	}
	steps = append(steps, rebootedStep(func(e *Env) string { return e.Op.Spec.Talos.Version }, StepInspect))
	if !drainOff {
		steps = append(steps, uncordonStep())
	}
	return steps
}

// inspectStep reads what the machine runs and records its version and boot
// ID before anything disruptive happens. A machine already on the target
// (version and schematic) is done without being touched.
func inspectStep() Step {
	return Step{Name: StepInspect, Timeout: time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		f, err := talos.ReadFacts(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, err
		}
		t := e.Op.Spec.Talos
		if f.Version == t.Version && (t.Schematic == "" || t.Schematic == f.Schematic) {
			return Outcome{Done: true, From: f.Version, Message: "already on " + t.Version}, nil
		}
		from := e.Machine.From
		if from == "" {
			from = f.Version
		}
		return Outcome{From: from, BootID: f.BootID}, nil
	}}
}

func installStep(legacy bool) Step {
	return Step{Name: StepInstall, Timeout: 20 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		f, err := talos.ReadFacts(ctx, e.Talos, e.Address)
		if err != nil {
			return Outcome{}, err
		}
		t := e.Op.Spec.Talos
		image := talos.InstallerImage(t.ImageRepository, f, t.Schematic, t.Version)
		powercycle := t.RebootMode == ichorv1.RebootModePowercycle
		if legacy {
			// The legacy call reboots by itself: never send it twice.
			if rebooting(ctx, e) {
				return Outcome{Message: "rebooting"}, nil
			}
			if err := talos.UpgradeLegacy(ctx, e.Talos, e.Address, image, powercycle); err != nil {
				return Outcome{}, Fail("InstallFailed", "%w", err)
			}
			return Outcome{Message: "installed " + image + "; rebooting"}, nil
		}
		err = talos.Pull(ctx, e.Talos, e.Address, image)
		if err == nil {
			err = talos.Install(ctx, e.Talos, e.Address, image)
		}
		if status.Code(err) == codes.Unimplemented {
			// An early 1.13 pre-release without LifecycleService: the
			// legacy call installs and reboots by itself.
			if err := talos.UpgradeLegacy(ctx, e.Talos, e.Address, image, powercycle); err != nil {
				return Outcome{}, Fail("InstallFailed", "%w", err)
			}
			return Outcome{Message: "installed " + image + " (legacy API); rebooting", Next: StepRebooted}, nil
		}
		if err != nil {
			return Outcome{}, Fail("InstallFailed", "%w", err)
		}
		return Outcome{Message: "installed " + image}, nil
	}}
}

func rebootStep() Step {
	return Step{Name: StepReboot, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if rebooting(ctx, e) {
			return Outcome{}, nil
		}
		powercycle := e.Op.Spec.Talos.RebootMode == ichorv1.RebootModePowercycle
		if err := talos.Reboot(ctx, e.Talos, e.Address, powercycle); err != nil {
			return Outcome{}, Fail("RebootFailed", "%w", err)
		}
		return Outcome{Message: "rebooting"}, nil
	}}
}

// rebooting reports whether the reboot recorded in status has already begun:
// the machine does not answer, or answers with another boot ID. A step rerun
// after a controller restart uses it so that a machine never reboots twice.
func rebooting(ctx context.Context, e *Env) bool {
	boot, err := talos.BootID(ctx, e.Talos, e.Address)
	if err != nil {
		return talos.Unreachable(err)
	}
	if boot != e.Machine.BootID {
		return true
	}
	// Talos answers for a while after it has started going down.
	going, err := talos.GoingDown(ctx, e.Talos, e.Address)
	return err == nil && going
}
