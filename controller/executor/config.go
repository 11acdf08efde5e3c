package executor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/talos"
)

// Steps of the config kind (with inspect, the etcd check, cordon, drain and
// wait-rebooted).
const (
	StepApply  = "apply"
	StepVerify = "verify"
)

// Messages a config rollout leaves on a machine.
const (
	msgAlreadyApplied = "already applied"
	msgAppliedLive    = "applied live"
	msgRebooted       = "applied, rebooted"
	planNoChange      = "plan: no change"
	planLive          = "plan: changes, applies live"
	planReboot        = "plan: changes, needs a reboot"
	msgRebooting      = "applied; rebooting to take it"
)

// ConfigRollout rolls machine-configuration patches out, a machine at a
// time in the shared order: inspect (the patches applied to the active
// configuration; a machine that already carries them is done untouched;
// Talos's dry run validates the result and says whether it applies live),
// the etcd check on control planes, cordon and drain only when a reboot
// follows, apply, wait for the reboot when there is one, verify that the
// machine runs the patched configuration and uncordon it. The fingerprint
// of the patched configuration is the machine's to: an apply is sent only
// while the patches, applied to what the machine runs, still give it and
// the machine neither runs it nor has it persisted, so a controller killed
// between the apply and its status write applies nothing twice. In mode
// auto the machines that need no reboot are applied live.
type ConfigRollout struct {
	// plans caches the preflight's verdict per machine: preflight runs on
	// every turn of an operation that waits, and each verdict costs two Talos
	// calls per machine.
	plans *planCache
}

// NewConfigRollout returns the config kind's executor.
func NewConfigRollout() *ConfigRollout {
	return &ConfigRollout{plans: &planCache{ttl: time.Minute, m: map[string]planEntry{}}}
}

// Target implements Executor.
func (*ConfigRollout) Target(op *ichorv1.TalosOperation) (string, string) {
	if op.Spec.Config == nil {
		return "", ""
	}
	return op.Spec.Config.Summary(), ""
}

// Scope implements Executor: every selected machine.
func (*ConfigRollout) Scope(_ *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	return nodes, nil
}

// HonourHold implements Executor.
func (*ConfigRollout) HonourHold() bool { return true }

// MachineBound implements MachineBound: a step reads its own machine only.
func (*ConfigRollout) MachineBound() bool { return true }

// Check implements Executor with the refusals of Plan, each naming the machine.
func (c *ConfigRollout) Check(ctx context.Context, e *Env) []string {
	_, refusals := c.Plan(ctx, e)
	out := make([]string, len(refusals))
	for i, r := range refusals {
		out[i] = e.Machine.Name + ": " + r
	}
	return out
}

// Plan implements Planner: the patches are applied to the machine's active
// configuration and Talos checks the result in a dry run (Validate and
// RuntimeValidate, and whether it applies live). A patch that does not
// apply, or a result Talos does not accept, refuses the operation, naming
// the machine and quoting Talos.
func (c *ConfigRollout) Plan(ctx context.Context, e *Env) (string, []string) {
	patches, err := machineconfig.ParsePatches(e.Op.Spec.Config.Patches)
	if err != nil {
		return "", []string{fmt.Sprintf("spec.config.patches: %v", err)}
	}
	key := fmt.Sprintf("%s/%d/%s", e.Op.UID, e.Op.Generation, e.Machine.Name)
	if p, ok := c.plans.get(key); ok {
		return p.plan, p.refusals
	}
	var p planEntry
	ch, reboot, err := planChange(ctx, e, patches)
	switch {
	case err != nil && talos.Unreachable(err):
		p.refusals = []string{fmt.Sprintf("does not answer the Talos API, so its configuration cannot be checked: bring it back, or leave it out with spec.machines (%v)", err)}
	case err != nil:
		p.refusals = []string{err.Error()}
	case ch.Applied():
		p.plan = planNoChange
	case reboot:
		p.plan = planReboot
	default:
		p.plan = planLive
	}
	c.plans.put(key, p)
	return p.plan, p.refusals
}

// planChange applies the operation's patches to the machine's active
// configuration and, when they change it, asks Talos whether it accepts the
// result and whether taking it needs a reboot.
func planChange(ctx context.Context, e *Env, patches []machineconfig.Patch) (machineconfig.Change, bool, error) {
	m := configMachine(e)
	ch, err := m.Plan(ctx, patches)
	if err != nil || ch.Applied() {
		return ch, false, err
	}
	res, err := m.DryRun(ctx, ch.Config, configMode(e.Op))
	return ch, res.Reboot, err
}

func configMachine(e *Env) machineconfig.Machine {
	return machineconfig.Machine{Talos: e.Talos, Node: e.Address}
}

func configMode(op *ichorv1.TalosOperation) machineconfig.Mode {
	if op.Spec.Config.Mode == ichorv1.ConfigModeAuto {
		return machineconfig.Auto
	}
	return machineconfig.Reboot
}

// Steps implements Executor. A reboot is planned when inspect recorded the
// machine's boot ID: only then is it cordoned and drained, and its apply is
// an irreversible call (call.make) waited for by wait-rebooted. Otherwise
// the apply is live (NO_REBOOT), which Talos refuses for a change that
// needs a reboot.
func (*ConfigRollout) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	reboot := m.BootID != ""
	drain := reboot && (op.Spec.Drain == nil || !op.Spec.Drain.Disabled)
	steps := []Step{configInspectStep()}
	if m.Role == ichorv1.RoleControlPlane {
		steps = append(steps, etcdHealthStep())
	}
	if drain {
		steps = append(steps, cordonDrainStep(op))
	}
	if reboot {
		steps = append(steps, callStep(StepApply, 5*time.Minute, configApply()), rebootedStep(nil, StepInspect))
	} else {
		steps = append(steps, configLiveStep())
	}
	return append(steps, configVerifyStep(drain))
}

// cordonDrainStep cordons the machine and drains it in one step, as
// kubectl drain does: nothing happens between the two that status needs
// to record (the cordon is the operation's own, marked with its identity,
// and both are done again on a rerun without harm), so a machine that
// reboots reaches its apply one status write sooner.
func cordonDrainStep(op *ichorv1.TalosOperation) Step {
	cordon, step := cordonStep(), drainStep(op)
	drain := step.Run
	step.Timeout += cordon.Timeout
	step.Run = func(ctx context.Context, e *Env) (Outcome, error) {
		if _, err := cordon.Run(ctx, e); err != nil {
			return Outcome{}, &StepError{Reason: Reason(StepCordon, err), Err: err}
		}
		return drain(ctx, e)
	}
	return step
}

// configInspectStep plans the change on the configuration the machine runs
// now and records its fingerprints (and, when a reboot will follow, the
// boot ID). A machine that already carries the patches is done untouched.
// A read, it is Chained: it starts beside the status write that starts the
// machine.
func configInspectStep() Step {
	return Step{Name: StepInspect, Timeout: 2 * time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		patches, err := configPatches(e)
		if err != nil {
			return Outcome{}, err
		}
		// The boot ID is read beside the plan, not after it: it is recorded
		// only when a reboot follows, and a read costs less than a round trip
		// on the way to every reboot.
		var ch machineconfig.Change
		var reboot bool
		var boot string
		var g errgroup.Group
		g.Go(func() error {
			return untilAnswers(ctx, func() (err error) {
				ch, reboot, err = planChange(ctx, e, patches)
				return err
			})
		})
		g.Go(func() error {
			return untilAnswers(ctx, func() (err error) {
				boot, err = talos.BootID(ctx, e.Talos, e.Address)
				return err
			})
		})
		if err := g.Wait(); err != nil {
			return Outcome{}, configFail(err)
		}
		if ch.Applied() {
			// A retry after a failed verify can find the change there (an
			// operator put it back): the cordon this operation made goes.
			if _, err := uncordonStep().Run(ctx, e); err != nil {
				return Outcome{}, err
			}
			return Outcome{Done: true, To: ch.To, Message: msgAlreadyApplied}, nil
		}
		out := Outcome{To: ch.To, Message: "applies live"}
		if reboot {
			out.BootID, out.Message = boot, "needs a reboot"
		}
		return out, nil
	}}
}

func configPatches(e *Env) ([]machineconfig.Patch, error) {
	patches, err := machineconfig.ParsePatches(e.Op.Spec.Config.Patches)
	if err != nil {
		return nil, Fail(machineconfig.ReasonPatchFailed, "spec.config.patches: %w", err)
	}
	return patches, nil
}

// configApply is the apply that reboots (mode reboot, or auto where Talos
// must reboot): an irreversible call, made at most once per step. Whether
// it was made, the machine's configurations say (configMade), never its
// silence. What is sent is the change that configMade has just found not
// applied, planned on what the machine runs: nothing is read twice.
func configApply() call {
	var planned machineconfig.Change
	return call{what: "apply", reason: "ConfigApplyFailed",
		made: func(ctx context.Context, e *Env, boot string) (bool, Outcome, error) {
			made, out, ch, err := configMade(ctx, e, boot)
			planned = ch
			return made, out, err
		},
		send: func(ctx context.Context, e *Env) (Outcome, error) {
			return sendConfig(ctx, e, planned, configMode(e.Op))
		}}
}

// configLiveStep applies the change live (NO_REBOOT), once: before sending
// it reads where the change stands on the machine, so that a rerun after a
// crash, or after an apply whose answer was lost, sends nothing again. A
// machine that does not answer is asked again until the step's timeout.
func configLiveStep() Step {
	return Step{Name: StepApply, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		for {
			var made bool
			var out Outcome
			var ch machineconfig.Change
			if err := untilAnswers(ctx, func() (err error) {
				made, out, ch, err = configMade(ctx, e, "")
				return err
			}); err != nil || made {
				return out, err
			}
			out, err := sendConfig(ctx, e, ch, machineconfig.NoReboot)
			if talos.Unreachable(err) && ctx.Err() == nil {
				// The answer was lost: whether it was applied, the machine says.
				e.Log.Info("apply did not answer; reading where the change stands", "err", err)
				continue
			}
			if machineconfig.Reason(err) == machineconfig.ReasonNeedsReboot {
				return Outcome{}, &StepError{Reason: machineconfig.ReasonNeedsReboot, RetryFrom: StepInspect, Err: fmt.Errorf(
					"%w (inspect found that it applies live: the machine's configuration changed since; a retry inspects it again)", err)}
			}
			return out, err
		}
	}}
}

// configMade reads where the change stands on the machine (boot is its
// boot ID now, "" when unknown): made when the machine runs the patched
// configuration, or has it persisted to take at the reboot the apply
// started; not made while the patches, applied to what it runs, still give
// the planned configuration, which it returns to be sent; a failed step
// when they give another (someone else changed it).
func configMade(ctx context.Context, e *Env, boot string) (bool, Outcome, machineconfig.Change, error) {
	patches, err := configPatches(e)
	if err != nil {
		return false, Outcome{}, machineconfig.Change{}, err
	}
	state, ch, err := configMachine(e).StateOf(ctx, patches, e.Machine.To)
	if err != nil {
		return false, Outcome{}, ch, configFail(err)
	}
	reboot := e.Machine.BootID != ""
	switch state {
	case machineconfig.Applied:
		if reboot && boot != "" && boot != e.Machine.BootID {
			return true, Outcome{Message: "applied; rebooted"}, ch, nil
		}
		return true, Outcome{Next: StepVerify, Message: msgAppliedLive}, ch, nil
	case machineconfig.AwaitingReboot:
		if !reboot {
			return false, Outcome{}, ch, Fail(machineconfig.ReasonRebootPending, "the patched configuration is persisted but not active, and no reboot was planned for this machine: reboot it (`kubectl ichor node reboot %s`), then retry", e.Machine.Name)
		}
		return true, Outcome{Message: msgRebooting}, ch, nil
	case machineconfig.Diverged:
		return false, Outcome{}, ch, &StepError{Reason: machineconfig.ReasonDiverged, RetryFrom: StepInspect, Err: fmt.Errorf(
			"the machine's configuration changed since it was inspected: the patches give configuration %s now, not %s; someone else applied one; a retry inspects the machine again", ch.To, e.Machine.To)}
	}
	return false, Outcome{}, ch, nil
}

// sendConfig sends ch, the change configMade has just found not applied
// (the patches, applied to what the machine runs, give the planned
// configuration), in mode. Talos's answer says whether the machine reboots
// to take it.
func sendConfig(ctx context.Context, e *Env, ch machineconfig.Change, mode machineconfig.Mode) (Outcome, error) {
	if ch.Config == nil || ch.To != e.Machine.To {
		// Never sent unplanned: configMade found it not applied just before.
		return Outcome{}, &StepError{Reason: machineconfig.ReasonDiverged, RetryFrom: StepInspect, Err: fmt.Errorf(
			"the machine's configuration changed while the change was being applied; a retry inspects it again")}
	}
	res, err := configMachine(e).Apply(ctx, ch.Config, mode)
	if err != nil {
		return Outcome{}, configFail(err)
	}
	if !res.Reboot {
		return Outcome{Next: StepVerify, Message: msgAppliedLive}, nil
	}
	return Outcome{Message: msgRebooting}, nil
}

// configVerifyStep checks through COSI that the machine runs the patched
// configuration (after a reboot: that it came back with it), says how it
// got there and, when it was drained, uncordons it: one step, so that a
// rebooted machine is back in service one status write sooner. It follows
// a live apply in the same run.
func configVerifyStep(uncordon bool) Step {
	return Step{Name: StepVerify, Timeout: 2 * time.Minute, Chained: true, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		// The configuration and the boot ID at once: one look at the machine.
		m := configMachine(e)
		var boot string
		err := untilAnswers(ctx, func() error {
			var g errgroup.Group
			g.Go(func() error { return m.Verify(ctx, e.Machine.To) })
			g.Go(func() (err error) { boot, err = talos.BootID(ctx, e.Talos, e.Address); return err })
			return g.Wait()
		})
		if machineconfig.Reason(err) == machineconfig.ReasonNotActive {
			return Outcome{}, &StepError{Reason: machineconfig.ReasonNotActive, RetryFrom: StepInspect, Err: fmt.Errorf("%w (a retry inspects the machine again)", err)}
		}
		if err != nil {
			return Outcome{}, configFail(err)
		}
		out := Outcome{Message: msgAppliedLive}
		if e.Machine.BootID != "" && boot != e.Machine.BootID {
			out.Message = msgRebooted
		}
		if uncordon {
			if _, err := uncordonStep().Run(ctx, e); err != nil {
				return Outcome{}, err
			}
		}
		return out, nil
	}}
}

// configFail is a step error for a configuration change: the failure reason
// of machineconfig's errors, Talos's words and what to do.
func configFail(err error) error {
	var se *StepError
	if errors.As(err, &se) {
		return err
	}
	if reason := machineconfig.Reason(err); reason != "" {
		return &StepError{Reason: reason, Err: err}
	}
	return err
}

// untilAnswers runs call until the machine answers it (a machine that does
// not answer is rebooting, or down for a while) or ctx ends: "no answer" is
// never taken for an answer.
func untilAnswers(ctx context.Context, call func() error) error {
	for {
		err := call()
		if !talos.Unreachable(err) || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(time.Second):
		}
	}
}

// planCache keeps each machine's preflight verdict for a while.
type planCache struct {
	ttl   time.Duration
	mu    sync.Mutex
	m     map[string]planEntry
	swept time.Time
}

type planEntry struct {
	plan     string
	refusals []string
	at       time.Time
}

func (c *planCache) get(key string) (planEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok := c.m[key]
	return p, ok && time.Since(p.at) < c.ttl
}

func (c *planCache) put(key string, p planEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if now.Sub(c.swept) >= c.ttl {
		for k, old := range c.m {
			if now.Sub(old.at) >= c.ttl {
				delete(c.m, k)
			}
		}
		c.swept = now
	}
	p.at = now
	c.m[key] = p
}
