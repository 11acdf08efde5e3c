package machineconfig

import (
	"errors"
	"fmt"
	"strings"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"
)

// Failure reasons of an *Error, each a status.failureReason.
const (
	// ReasonPatchFailed: a patch does not apply to the machine's configuration.
	ReasonPatchFailed = "ConfigPatchFailed"
	// ReasonInvalid: Talos does not accept the patched configuration.
	ReasonInvalid = "ConfigInvalid"
	// ReasonNeedsReboot: the change cannot apply live, and the mode forbids a reboot.
	ReasonNeedsReboot = "ConfigNeedsReboot"
	// ReasonApplyInProgress: another apply runs on the machine.
	ReasonApplyInProgress = "ConfigApplyInProgress"
	// ReasonRebootPending: the machine is rebooting to take an earlier apply.
	ReasonRebootPending = "ConfigRebootPending"
	// ReasonNotPermitted: the talosconfig's role may not apply configurations.
	ReasonNotPermitted = "ConfigNotPermitted"
	// ReasonDiverged: the machine's configuration changed since the change was planned.
	ReasonDiverged = "ConfigChanged"
	// ReasonNotActive: after the apply the machine does not run the changed configuration.
	ReasonNotActive = "ConfigNotActive"
)

// maxQuote bounds how much of Talos's message an error quotes: a refusal of
// a live apply carries the whole diff, and errors end up in status.
const maxQuote = 600

// Error is a configuration change that Talos refused or that cannot be
// made, with Talos's words and what to do.
type Error struct {
	// Reason is a failureReason (the Reason* constants).
	Reason string
	// What says what went wrong.
	What string
	// Talos is Talos's own message, when Talos refused.
	Talos string
	// Do says what to do about it.
	Do  string
	err error
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.What)
	if e.Talos != "" {
		fmt.Fprintf(&b, ": Talos says %q", quote(e.Talos))
	}
	if e.Do != "" {
		b.WriteString("; " + e.Do)
	}
	return b.String()
}

func (e *Error) Unwrap() error { return e.err }

// Reason is the failureReason of an error from this package ("" for other
// errors, such as a machine that does not answer).
func Reason(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

func quote(s string) string {
	s = strings.TrimSpace(s)
	if len(s) <= maxQuote {
		return s
	}
	return s[:maxQuote] + "…"
}

// talosError turns Talos's refusal of what into an *Error that says what
// to do. Errors that say nothing about the configuration (the machine does
// not answer, the call timed out) are only wrapped, so that callers can
// tell "no answer" from "refused".
func talosError(what string, err error) error {
	st := talosclient.Status(err)
	if st == nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	msg := st.Message()
	e := &Error{What: what, Talos: msg, err: err}
	switch code := st.Code(); {
	case code == codes.InvalidArgument && strings.Contains(msg, "can't be applied in immediate mode"):
		e.Reason, e.What = ReasonNeedsReboot, "the change cannot be applied without a reboot"
		e.Do = "use mode reboot, or auto to let Talos reboot where it must"
	case code == codes.InvalidArgument:
		e.Reason, e.What = ReasonInvalid, "Talos does not accept the patched configuration"
		e.Do = "fix the patches so that the configuration validates on this machine (`talosctl validate` checks a file), then create a new operation"
	case code == codes.FailedPrecondition && strings.Contains(msg, "already in progress"):
		e.Reason = ReasonApplyInProgress
		e.Do = "another client (talosctl, Omni) is applying a configuration to this machine; wait until it is done, then retry"
	case code == codes.FailedPrecondition && strings.Contains(msg, "rebooting"):
		e.Reason = ReasonRebootPending
		e.Do = "the machine reboots to take a configuration applied earlier; wait until it is back, then retry"
	case code == codes.PermissionDenied:
		e.Reason = ReasonNotPermitted
		e.Do = "the talosconfig in Secret ichor-talosconfig needs the os:admin role (`talosctl config new --roles os:admin`)"
	default:
		return fmt.Errorf("%s: %w", what, err)
	}
	return e
}
