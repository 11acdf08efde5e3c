package v1alpha1

import (
	"fmt"
	"strings"
)

// The functions in this file read an operation's state the same way for the
// plugin (exit codes, hints, completion) and the controller (lock takeover,
// retry handling). They are pure: no clock, no client.

// Succeeded reports whether the operation is done.
func (o *TalosOperation) Succeeded() bool { return o.Status.Phase == PhaseSucceeded }

// Cancelled reports whether the operation was cancelled.
func (o *TalosOperation) Cancelled() bool { return o.Status.Phase == PhaseCancelled }

// CancelRequested reports whether an operator asked to cancel the
// operation, and who: the CancelAnnotation's value ("an operator" when
// empty).
func (o *TalosOperation) CancelRequested() (bool, string) {
	who, ok := o.Annotations[CancelAnnotation]
	if !ok {
		return false, ""
	}
	if who = strings.TrimSpace(who); who == "" {
		who = "an operator"
	}
	return true, who
}

// SkipRequest is a request to skip one machine (SkipAnnotation).
type SkipRequest struct {
	// Machine is the machine to skip.
	Machine string
	// By is who asked: SkipByAnnotation's value, "an operator" when empty.
	By string
	// Uncordon lifts Ichor's cordon on the machine as well.
	Uncordon bool
}

// SkipRequested returns the skip request the operation's annotations
// carry, if any.
func (o *TalosOperation) SkipRequested() (SkipRequest, bool) {
	name, ok := o.Annotations[SkipAnnotation]
	if !ok {
		return SkipRequest{}, false
	}
	by := strings.TrimSpace(o.Annotations[SkipByAnnotation])
	if by == "" {
		by = "an operator"
	}
	return SkipRequest{Machine: strings.TrimSpace(name), By: by, Uncordon: o.Annotations[SkipUncordonAnnotation] == "true"}, true
}

// Machine returns the status entry of the named machine, or nil.
func (s *TalosOperationStatus) Machine(name string) *MachineStatus {
	for i := range s.Machines {
		if s.Machines[i].Name == name {
			return &s.Machines[i]
		}
	}
	return nil
}

// CannotSkip says why the named machine cannot be skipped, or "" when it
// can: only a machine whose step failed, with nothing of it in flight, of
// an operation that has not ended. A machine with a step in flight is
// refused, since an irreversible call (an upgrade, a reboot) may be under
// way on it; a machine that has not started is left out with the hold
// annotation instead. The plugin and the controller both judge by it.
func (o *TalosOperation) CannotSkip(name string) string {
	switch {
	case o.Succeeded():
		return "the operation has succeeded"
	case o.Cancelled():
		return "the operation was cancelled"
	case o.Refused():
		return "the operation was refused and nothing ran"
	}
	m := o.Status.Machine(name)
	if m == nil {
		names := make([]string, 0, len(o.Status.Machines))
		for _, m := range o.Status.Machines {
			names = append(names, m.Name)
		}
		if len(names) == 0 {
			return fmt.Sprintf("it has no machine %q (none are planned yet)", name)
		}
		if len(names) > 10 {
			names = append(names[:10], fmt.Sprintf("and %d more", len(names)-10))
		}
		return fmt.Sprintf("it has no machine %q; its machines: %s", name, strings.Join(names, ", "))
	}
	switch m.Phase {
	case MachineFailed:
		return ""
	case MachineInProgress:
		if m.Stopped {
			return fmt.Sprintf("%s has not failed: it stopped between two steps (next: %s); only a machine whose step failed can be skipped", name, m.Step)
		}
		return fmt.Sprintf("%s has a step in flight (%s), and an irreversible call may be under way on it: wait until the step has ended, then skip it if it failed", name, m.Step)
	case MachineSucceeded:
		return fmt.Sprintf("%s is done already (Succeeded)", name)
	case MachineSkipped:
		return fmt.Sprintf("%s is skipped already (%s)", name, m.Message)
	}
	return fmt.Sprintf("%s has not started: to leave it out, put its Node on hold (kubectl annotate node %s %s=REASON)", name, name, UpgradeHoldAnnotation)
}

// Refused reports whether preflight refused the operation (nothing ran).
func (o *TalosOperation) Refused() bool { return o.Status.Phase == PhaseRefused }

// StepFailed reports whether a failed step holds the operation: failureReason
// is set exactly then, whether or not an operator has paused it as well.
func (o *TalosOperation) StepFailed() bool { return o.Status.FailureReason != "" }

// PausedByOperator reports whether an operator has paused the operation
// (spec.paused), whatever else holds it.
func (o *TalosOperation) PausedByOperator() bool { return o.Spec.Paused }

// RetryPending reports whether a retry request waits for the controller: the
// retry annotation is set to "true" (any other value is ignored).
func (o *TalosOperation) RetryPending() bool {
	return o.Annotations[RetryAnnotation] == RetryRequested
}

// Observed reports whether the status reflects the current spec generation.
func (o *TalosOperation) Observed() bool {
	return o.Status.ObservedGeneration >= o.Generation
}

// WaitingForLock reports whether the operation waits for the cluster lock.
func (o *TalosOperation) WaitingForLock() bool { return o.Status.Lock == LockWaiting }

// Failed reports whether the operation has stopped on a failure and will not
// move again until someone acts: a step failed and no retry is pending, or
// preflight refused it and the controller has seen the current spec (setting
// spec.override on a refused operation makes it run once observed).
func (o *TalosOperation) Failed() bool {
	if o.StepFailed() && !o.RetryPending() {
		return true
	}
	return o.Refused() && (!o.Spec.Override || o.Observed())
}

// Finished reports whether the operation has reached an end that only a
// person can change: it succeeded, it Failed, or it was cancelled.
func (o *TalosOperation) Finished() bool { return o.Succeeded() || o.Failed() || o.Cancelled() }

// InFlight names the machines that have a step in flight, as status
// records it: in progress and not stopped between steps. A restarted
// controller reads the same.
func (s *TalosOperationStatus) InFlight() []string {
	var out []string
	for _, m := range s.Machines {
		if m.Phase == MachineInProgress && !m.Stopped {
			out = append(out, m.Name+": "+m.Step)
		}
	}
	return out
}

// Settled reports whether no step of the operation is in flight.
func (o *TalosOperation) Settled() bool { return len(o.Status.InFlight()) == 0 }

// FailedAndSettled reports whether a failed step holds the operation and
// every step that was in flight when it failed has settled (a reboot under
// way has finished): only then does its holder count as paused on a failed
// step, so another disruption cannot overlap what is still going on.
func (o *TalosOperation) FailedAndSettled() bool { return o.StepFailed() && o.Settled() }

// FailedMachine returns the first machine whose step failed, or nil.
func (s *TalosOperationStatus) FailedMachine() *MachineStatus {
	for i := range s.Machines {
		if s.Machines[i].Phase == MachineFailed {
			return &s.Machines[i]
		}
	}
	return nil
}

// Summary says what a config rollout does, like "config (2 patches, auto)":
// status.target, and the plugin's view before the controller has set it.
func (c *ConfigRollout) Summary() string {
	mode := c.Mode
	if mode == "" {
		mode = ConfigModeReboot
	}
	patches := "1 patch"
	if len(c.Patches) != 1 {
		patches = fmt.Sprintf("%d patches", len(c.Patches))
	}
	return fmt.Sprintf("config (%s, %s)", patches, mode)
}
