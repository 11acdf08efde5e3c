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
