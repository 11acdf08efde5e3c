package executor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"golang.org/x/sync/errgroup"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
)

// call is an irreversible call to a machine (a reboot, the legacy upgrade
// that reboots by itself, a shutdown, a reset) and what shows that it has
// been made.
type call struct {
	// what names the call in messages: "reboot", "upgrade", "shutdown", "reset".
	what string
	// reason is the failureReason when Talos refuses the call.
	reason string
	// stages are the MachineStatus stages the call puts the machine in.
	stages []runtime.MachineStage
	// made, when set, reads from the machine whether the call was made, in
	// place of its stage and boot ID (boot is the one just read): a
	// configuration apply leaves the configuration it sent, persisted and
	// then active, which says so exactly, where a reboot seen since may be
	// anyone's. Made, out is the step's outcome; an error that is not "no
	// answer" fails the step.
	made func(ctx context.Context, e *Env, boot string) (bool, Outcome, error)
	// send makes the call; its outcome's message, when set, replaces
	// "<what> sent".
	send func(ctx context.Context, e *Env) (Outcome, error)
}

// poll is how often a call looks at the machine again while it waits.
var poll = time.Second

// showTime is how long a rerun gives a call an earlier run may have made
// to show on the machine before it makes the call itself: Talos answers
// the call first and enters the sequence's stage a moment later. (Talos
// would drop a second reset or reboot while the first runs, but the call
// is still made once only.)
var showTime = 3 * time.Second

// probeTimeout bounds one look at the machine.
const probeTimeout = 5 * time.Second

// disruptive are the stages of Talos's disruptive sequences.
var disruptive = []runtime.MachineStage{
	runtime.MachineStageRebooting, runtime.MachineStageUpgrading,
	runtime.MachineStageShuttingDown, runtime.MachineStageResetting,
}

// make makes the call at most once per step and attempt, deciding from
// what the machine shows, never from silence:
//   - after an earlier run of this attempt may have made the call (or this
//     run's got no answer), in one of the call's stages, or booted again
//     since status recorded its boot ID (a boot before that is someone
//     else's: another operation's reboot between a failed attempt and its
//     retry), or, for a call that says it (made), showing what the call
//     leaves: the call was made, by this run or an earlier one; it is not
//     made again;
//   - answering in a disruptive stage otherwise (the call's own on a first
//     run is someone else's sequence: a reboot shows the stage a legacy
//     upgrade ends in): another sequence runs; wait for it to end;
//   - answering otherwise: make the call, on a control plane right after
//     the etcd health check (when an earlier run, or this run's call that
//     got no answer, may have made it: only once showTime has passed since
//     without the machine showing it);
//   - not answering: if an earlier run may have made the call (status
//     counts the runs, MachineStatus.Calls) or this one's call got no
//     answer (not one refused on its way, talos.NotSent, which the machine
//     never saw), the machine is going down from it; otherwise it was not
//     disrupted by us, so look again until the step's time is nearly up,
//     then fail: a machine that does not answer is never "done".
func (c call) make(ctx context.Context, e *Env) (Outcome, error) {
	if err := e.requireAddress(); err != nil {
		return Outcome{}, err
	}
	maybeMade := e.Machine.Calls > 1
	// since is when the call may last have been made: for an earlier
	// run's, this run's start; for this run's, the moment it got no answer
	// (a send can take longer than showTime: a legacy upgrade pulls first).
	since := time.Now()
	var last error
	for {
		boot, stage, err := observe(ctx, e)
		made, out := false, Outcome{}
		if err == nil && c.made != nil {
			made, out, err = c.made(ctx, e, boot)
		}
		var se *StepError
		switch {
		case made:
			return out, nil
		case err == nil && c.made == nil && maybeMade && slices.Contains(c.stages, stage):
			return Outcome{Message: fmt.Sprintf("%s under way (stage %s)", c.what, stage)}, nil
		case err == nil && c.made == nil && e.Machine.BootID != "" && boot != e.Machine.BootID && maybeMade:
			return Outcome{Message: c.what + " done: the machine has booted again since"}, nil
		case err == nil && slices.Contains(disruptive, stage):
			last = fmt.Errorf("the machine is %s: another sequence runs on it", stage)
		case err == nil && c.made == nil && maybeMade && time.Since(since) < showTime:
			last = fmt.Errorf("an earlier run may have made the %s: waiting for the machine to show it", c.what)
		case err == nil:
			out, err := c.sendChecked(ctx, e)
			if err == nil {
				if out.Message == "" {
					out.Message = c.what + " sent"
				}
				return out, nil
			}
			if errors.As(err, &se) || !talos.Unreachable(err) {
				return Outcome{}, err
			}
			last = err
			if !talos.NotSent(err) {
				// The call got no answer: it may have reached the machine.
				maybeMade, since = true, time.Now()
			}
		case talos.Unreachable(err):
			if maybeMade {
				return Outcome{Message: fmt.Sprintf("%s: the machine no longer answers since the call was made", c.what)}, nil
			}
			last = err
		case errors.As(err, &se):
			return Outcome{}, err
		default:
			return Outcome{}, fmt.Errorf("read the machine's state before the %s: %w", c.what, err)
		}
		if !c.again(ctx) {
			return Outcome{}, c.giveUp(e, last, maybeMade)
		}
	}
}

// observe reads the machine's boot ID and stage, both at once: they are
// one look at the machine, right before the call.
func observe(ctx context.Context, e *Env) (string, runtime.MachineStage, error) {
	return observeAt(ctx, e, e.Address)
}

// observeAt is observe of the machine at addr (another of the call's).
func observeAt(ctx context.Context, e *Env, addr string) (string, runtime.MachineStage, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var boot string
	var stage runtime.MachineStage
	var g errgroup.Group
	g.Go(func() (err error) { boot, err = talos.BootID(ctx, e.Talos, addr); return err })
	g.Go(func() (err error) { stage, err = talos.Stage(ctx, e.Talos, addr); return err })
	if err := g.Wait(); err != nil {
		return "", 0, err
	}
	return boot, stage, nil
}

// sendChecked makes the call; on a control plane the etcd health check
// comes right before it, so nothing slow lies between the two. A refusal
// fails the step with the call's reason, unless send gave its own.
func (c call) sendChecked(ctx context.Context, e *Env) (Outcome, error) {
	if e.Machine.Role == ichorv1.RoleControlPlane {
		if err := checkEtcd(ctx, e); err != nil {
			return Outcome{}, err
		}
	}
	out, err := c.send(ctx, e)
	var se *StepError
	if err != nil && !talos.Unreachable(err) && !errors.As(err, &se) {
		return Outcome{}, Fail(c.reason, "%w", err)
	}
	return out, err
}

// again waits before the next look, unless the step's time would run out
// first: it then returns false, so the step fails with its own reason
// rather than with the runner's timeout.
func (c call) again(ctx context.Context) bool {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < poll+probeTimeout {
		return false
	}
	t := time.NewTimer(poll)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// giveUp is the step's failure when its time runs out. When the call may
// have been made (an earlier run's, or this run's that got no answer), it
// says so: a retry is a new attempt, which makes the call again.
func (c call) giveUp(e *Env, last error, maybeMade bool) error {
	reason := c.reason
	if talos.Unreachable(last) {
		reason = "Unreachable"
	}
	if maybeMade {
		return Fail(reason, "the %s of %s may have been made, but the machine does not show it (%v): look at the machine (talosctl -n %s dmesg) before a retry, which makes the call again",
			c.what, e.Machine.Name, last, e.Address)
	}
	if talos.Unreachable(last) {
		return Fail(reason, "%s does not answer the Talos API at %s (%v), so no %s was made: check that it runs and that the controller reaches it, then retry",
			e.Machine.Name, e.Address, last, c.what)
	}
	return Fail(reason, "no %s was made: %v; retry once it is done", c.what, last)
}
