package executor

import (
	"context"
	"fmt"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
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
	StepPull    = "pull"
	StepInstall = "install"
	StepReboot  = "reboot"
)

// TalosUpgrade upgrades Talos (and the installer schematic) one machine at a
// time: inspect (version, boot ID, schematic), pull the installer (before
// anything disrupts the machine, so a version the registry does not have
// fails on a machine still in service), etcd health (control planes),
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
func (TalosUpgrade) Scope(_ *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	return nodes, nil
}

// HonourHold implements Executor.
func (TalosUpgrade) HonourHold() bool { return true }

// MachineBound implements MachineBound: a step reads its own machine only.
func (TalosUpgrade) MachineBound() bool { return true }

// Check implements Executor; the version checks are the preflight package's.
func (TalosUpgrade) Check(context.Context, *Env) []string { return nil }

// Steps implements Executor.
func (TalosUpgrade) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	steps := []Step{inspectStep(), pullStep()}
	if m.Role == ichorv1.RoleControlPlane {
		steps = append(steps, etcdHealthStep())
	}
	drainOff := op.Spec.Drain != nil && op.Spec.Drain.Disabled
	if !drainOff {
		steps = append(steps, cordonStep(), drainStep(op))
	}
	legacy := m.From != "" && !talos.HasLifecycleAPI(m.From)
	if legacy {
		steps = append(steps, callStep(StepInstall, 20*time.Minute, legacyUpgrade))
	} else {
		steps = append(steps, installStep(), callStep(StepReboot, 2*time.Minute, upgradeReboot))
	}
	steps = append(steps, rebootedStep(func(e *Env) string { return e.Op.Spec.Talos.Version }, StepInspect))
	if !drainOff {
		steps = append(steps, uncordonStep())
	}
	return steps
}

// inspectStep reads what the machine runs and records its version and boot
// ID before anything disruptive happens. A machine already on the target
// (version and schematic) is done without being touched. A read, it is
// Chained: it starts beside the status write that starts the machine.
func inspectStep() Step {
	return Step{Name: StepInspect, Timeout: time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
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

// pullStep pulls the installer onto the machine before it is cordoned or
// drained: ImageService.Pull, or the deprecated MachineService.ImagePull
// on hosts that do not have ImageService (below 1.13). A pull that fails
// (a version the registry does not have, a registry out of reach) is a
// failed step on a machine still in service. The install pulls again,
// from the machine's cache. It follows inspect in the same run: pulling
// again is harmless.
func pullStep() Step {
	return Step{Name: StepPull, Timeout: 10 * time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		image, err := installerImage(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		err = talos.Pull(ctx, e.Talos, e.Address, image)
		if status.Code(err) == codes.Unimplemented {
			err = talos.PullLegacy(ctx, e.Talos, e.Address, common.ContainerdNamespace_NS_SYSTEM, image)
		}
		if err != nil {
			return Outcome{}, Fail("PullFailed", "the machine was not disturbed: %w", err)
		}
		return Outcome{Message: "pulled " + image}, nil
	}}
}

// installStep installs the target into the inactive boot slot through
// ImageService.Pull and LifecycleService.Upgrade (Talos 1.13.0-beta.0 and
// later: talos.HasLifecycleAPI); it does not reboot. An older machine takes
// the legacy call instead, which reboots by itself: that is a step of its
// own, whose runs status counts before each (Irreversible), never a
// fallback from here, where a run after a crash could not tell that an
// earlier one had made it and would upgrade and reboot the machine again.
func installStep() Step {
	return Step{Name: StepInstall, Timeout: 20 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		image, err := installerImage(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		err = talos.Pull(ctx, e.Talos, e.Address, image)
		if err == nil {
			err = talos.Install(ctx, e.Talos, e.Address, image)
		}
		if status.Code(err) == codes.Unimplemented {
			return Outcome{}, Fail("InstallFailed", "%s runs Talos %s but does not have the image-based upgrade services: %w",
				e.Machine.Name, e.Machine.From, err)
		}
		if err != nil {
			return Outcome{}, Fail("InstallFailed", "%w", err)
		}
		return Outcome{Message: "installed " + image}, nil
	}}
}

// installerImage is the installer for the machine: its platform, secure
// boot and schematic (or the operation's). A machine without an address
// has none.
func installerImage(ctx context.Context, e *Env) (string, error) {
	if err := e.requireAddress(); err != nil {
		return "", err
	}
	f, err := talos.ReadFacts(ctx, e.Talos, e.Address)
	if err != nil {
		return "", err
	}
	t := e.Op.Spec.Talos
	return talos.InstallerImage(t.ImageRepository, f, t.Schematic, t.Version), nil
}

func powercycle(e *Env) bool { return e.Op.Spec.Talos.RebootMode == ichorv1.RebootModePowercycle }

var (
	// legacyUpgrade is MachineService.Upgrade (hosts below 1.13.0-beta.0), which
	// installs and reboots by itself: the stage is upgrading until the
	// kexec, rebooting after it.
	legacyUpgrade = call{what: "upgrade", reason: "InstallFailed",
		stages: []runtime.MachineStage{runtime.MachineStageUpgrading, runtime.MachineStageRebooting},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			image, err := installerImage(ctx, e)
			if err != nil {
				return Outcome{}, err
			}
			return Outcome{}, talos.UpgradeLegacy(ctx, e.Talos, e.Address, image, powercycle(e))
		}}
	upgradeReboot = call{what: "reboot", reason: "RebootFailed",
		stages: []runtime.MachineStage{runtime.MachineStageRebooting},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return Outcome{}, talos.Reboot(ctx, e.Talos, e.Address, powercycle(e))
		}}
)
