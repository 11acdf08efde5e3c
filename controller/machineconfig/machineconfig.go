// Package machineconfig is the one way Ichor changes a machine's
// configuration (the config kind, and the kubernetes, ca-rotation and
// key-rotation kinds): read it through COSI (MachineConfig, the active
// v1alpha1 one and the persistent one), patch it with machinery's
// configpatcher or a typed change, send it with ApplyConfiguration in a mode
// that is always named (the API's zero value is REBOOT), and tell from the
// machine's own configurations, by fingerprint, whether a change is already
// there, waiting for a reboot, or not applied, so that a rerun after a crash
// applies nothing twice. Talos's refusals become *Error values that quote
// Talos and say what to do.
package machineconfig

import (
	"context"
	"errors"
	"fmt"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"golang.org/x/sync/errgroup"

	"maesh.dev/ichor/controller/talos"
)

// Mode is how a configuration is applied. There is no default: every apply
// names its mode.
type Mode string

// Modes.
const (
	// Auto applies live where Talos can and reboots where it must (Talos decides).
	Auto Mode = "auto"
	// Reboot persists the configuration and reboots the machine to take it.
	Reboot Mode = "reboot"
	// NoReboot applies live; Talos refuses a change that needs a reboot.
	NoReboot Mode = "no-reboot"
)

func (m Mode) talos() (machine.ApplyConfigurationRequest_Mode, error) {
	switch m {
	case Auto:
		return machine.ApplyConfigurationRequest_AUTO, nil
	case Reboot:
		return machine.ApplyConfigurationRequest_REBOOT, nil
	case NoReboot:
		return machine.ApplyConfigurationRequest_NO_REBOOT, nil
	}
	return 0, fmt.Errorf("apply mode %q is not one of auto, reboot, no-reboot (Talos's zero value is REBOOT, so the mode is always named)", string(m))
}

// Machine is one machine's configuration, reached through the Talos API.
type Machine struct {
	Talos *talosclient.Client
	// Node is the machine's Talos node address.
	Node string
}

func (m Machine) ctx(ctx context.Context) context.Context {
	return talosclient.WithNode(ctx, m.Node)
}

// Active reads the configuration the machine runs (MachineConfig v1alpha1).
func (m Machine) Active(ctx context.Context) (config.Provider, error) {
	return m.read(ctx, configres.ActiveID)
}

// Persistent reads the configuration the machine boots with (MachineConfig
// persistent): ahead of the active one after an apply in reboot mode, until
// the reboot.
func (m Machine) Persistent(ctx context.Context) (config.Provider, error) {
	return m.read(ctx, configres.PersistentID)
}

func (m Machine) read(ctx context.Context, id resource.ID) (config.Provider, error) {
	mc, err := safe.StateGetByID[*configres.MachineConfig](m.ctx(ctx), m.Talos.COSI, id)
	if err != nil {
		return nil, talosError(fmt.Sprintf("read the %s machine configuration", id), err)
	}
	if mc.Provider() == nil {
		return nil, fmt.Errorf("the %s machine configuration is empty", id)
	}
	return mc.Provider(), nil
}

// Change is patches planned against a machine's active configuration.
type Change struct {
	// From is the Fingerprint of the active configuration the patches were applied to.
	From string
	// To is the Fingerprint of the patched configuration.
	To string
	// Active is the configuration the patches were applied to.
	Active config.Provider
	// Config is the patched configuration.
	Config config.Provider
}

// Applied reports whether the machine already carries the patches.
func (c Change) Applied() bool { return c.From == c.To }

// Diff is what the patches change, as Talos prints it ("" when the machine
// already carries them).
func (c Change) Diff() (string, error) { return Diff(c.Active, c.Config) }

// Plan applies patches to the machine's active configuration.
func (m Machine) Plan(ctx context.Context, patches []Patch) (Change, error) {
	active, err := m.Active(ctx)
	if err != nil {
		return Change{}, err
	}
	return PlanOn(active, patches)
}

// PlanOn applies patches to a configuration already read.
func PlanOn(active config.Provider, patches []Patch) (Change, error) {
	patched, err := ApplyPatches(active, patches)
	if err != nil {
		return Change{}, &Error{Reason: ReasonPatchFailed, What: err.Error(),
			Do: "fix the patch for this machine's configuration (read it with `talosctl get machineconfig -o yaml`)", err: err}
	}
	var ch Change
	if ch.From, err = Fingerprint(active); err != nil {
		return Change{}, err
	}
	if ch.To, err = Fingerprint(patched); err != nil {
		return Change{}, err
	}
	ch.Active, ch.Config = active, patched
	return ch, nil
}

// State is where a planned change stands on a machine.
type State int

// States of a change.
const (
	// NotApplied: the patches, applied to what the machine runs, still give
	// the planned configuration, and the machine does not run it.
	NotApplied State = iota
	// Applied: the machine runs the planned configuration.
	Applied
	// AwaitingReboot: the planned configuration is persisted and becomes
	// active at the next boot (an apply in reboot mode was accepted).
	AwaitingReboot
	// Diverged: the patches no longer give the planned configuration:
	// something else changed the machine's configuration since.
	Diverged
)

func (s State) String() string {
	switch s {
	case NotApplied:
		return "not applied"
	case Applied:
		return "applied"
	case AwaitingReboot:
		return "applied, active at the next boot"
	}
	return "changed by someone else"
}

// StateOf tells where the change that patches make, planned to give the
// configuration fingerprinted to, stands on the machine, from its active
// and persistent configurations. It is what makes an apply safe to rerun,
// even for a patch that appends to a list: only a NotApplied change may be
// sent, and StateOf returns it, planned again on what the machine runs.
//
// Both configurations are read at once: one round trip, not two in a row,
// on the path of every apply.
func (m Machine) StateOf(ctx context.Context, patches []Patch, to string) (State, Change, error) {
	var active, persistent config.Provider
	var g errgroup.Group
	g.Go(func() (err error) { active, err = m.Active(ctx); return err })
	g.Go(func() (err error) { persistent, err = m.Persistent(ctx); return err })
	if err := g.Wait(); err != nil {
		return 0, Change{}, err
	}
	ch, err := PlanOn(active, patches)
	if err != nil {
		return 0, Change{}, err
	}
	if ch.From == to {
		return Applied, ch, nil
	}
	pf, err := Fingerprint(persistent)
	switch {
	case err != nil:
		return 0, Change{}, err
	case pf == to:
		return AwaitingReboot, ch, nil
	case ch.To == to:
		return NotApplied, ch, nil
	}
	return Diverged, ch, nil
}

// Verify checks through COSI that the machine runs the configuration
// fingerprinted to.
func (m Machine) Verify(ctx context.Context, to string) error {
	active, err := m.Active(ctx)
	if err != nil {
		return err
	}
	fp, err := Fingerprint(active)
	if err != nil {
		return err
	}
	if fp != to {
		return &Error{Reason: ReasonNotActive,
			What: fmt.Sprintf("the machine runs configuration %s, not the applied %s", fp, to),
			Do:   "something changed it again, or Talos reverted it; read it with `talosctl get machineconfig -o yaml` and retry"}
	}
	return nil
}

// Result is Talos's answer to an apply.
type Result struct {
	// Reboot says the machine reboots to take the configuration (reboot
	// mode, or auto's choice).
	Reboot bool
	// Details is Talos's account of what it did (ModeDetails).
	Details string
	// Warnings are Talos's validation warnings.
	Warnings []string
}

// DryRun asks Talos whether it accepts cfg (Validate and RuntimeValidate on
// the machine) and how it would apply it in mode. Nothing changes.
func (m Machine) DryRun(ctx context.Context, cfg config.Provider, mode Mode) (Result, error) {
	return m.apply(ctx, cfg, mode, true)
}

// Apply sends cfg in mode. It is the irreversible call: run it only for a
// change whose StateOf is NotApplied, after recording the intent. With
// Reboot (or Auto choosing it) Talos answers before the machine goes down.
func (m Machine) Apply(ctx context.Context, cfg config.Provider, mode Mode) (Result, error) {
	return m.apply(ctx, cfg, mode, false)
}

func (m Machine) apply(ctx context.Context, cfg config.Provider, mode Mode, dryRun bool) (Result, error) {
	tm, err := mode.talos()
	if err != nil {
		return Result{}, err
	}
	data, err := Encode(cfg)
	if err != nil {
		return Result{}, err
	}
	what := "apply the machine configuration"
	if dryRun {
		what = "check the machine configuration (dry run)"
	}
	resp, err := m.Talos.ApplyConfiguration(m.ctx(ctx), &machine.ApplyConfigurationRequest{Data: data, Mode: tm, DryRun: dryRun})
	if err != nil {
		return Result{}, talosError(what, err)
	}
	if len(resp.GetMessages()) == 0 {
		return Result{}, errors.New(what + ": Talos sent an empty answer")
	}
	msg := resp.GetMessages()[0]
	return Result{
		Reboot:   msg.GetMode() == machine.ApplyConfigurationRequest_REBOOT,
		Details:  msg.GetModeDetails(),
		Warnings: msg.GetWarnings(),
	}, nil
}

// ApplyRestarting applies cfg live (NoReboot) and waits until the restart
// of service that the change brings (the kubelet's, for a change of
// machine.kubelet) is over and the service is healthy again, as talosctl's
// PatchNodeConfigWithKubeletRestart does. Use it only for changes that
// restart the service: it waits for the restart until ctx ends.
func (m Machine) ApplyRestarting(ctx context.Context, cfg config.Provider, service string) (Result, error) {
	var res Result
	err := talos.AcrossRestart(ctx, m.Talos, m.Node, service, func(ctx context.Context) error {
		var err error
		res, err = m.Apply(ctx, cfg, NoReboot)
		return err
	})
	return res, err
}
