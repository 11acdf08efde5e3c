package view

import (
	"fmt"
	"strings"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// Changes is the append-only log for output that is not a terminal: one
// timestamped line when the operation's state changes, and one per machine
// whose phase, step or message changed, like
//
//	2026-08-22T10:03:11Z upgrade-talos-7fk2q phase=Running progress=3/7 lock=Held
//	2026-08-22T10:03:11Z upgrade-talos-7fk2q machine=cp-2 Pending->InProgress step=upgrade "installing v1.13.7"
//
// prev is nil for the first observation. Machines first seen Pending are not
// listed: an operation over thousands of machines would log each one.
func Changes(prev, cur *ichorv1.TalosOperation, now time.Time) []string {
	ts := now.UTC().Format(time.RFC3339)
	name := Clean(cur.Name)
	var out []string
	if s := summary(cur); prev == nil || s != summary(prev) {
		out = append(out, fmt.Sprintf("%s %s %s", ts, name, s))
	}
	before := map[string]*ichorv1.MachineStatus{}
	if prev != nil {
		for i := range prev.Status.Machines {
			before[prev.Status.Machines[i].Name] = &prev.Status.Machines[i]
		}
	}
	for i := range cur.Status.Machines {
		m := &cur.Status.Machines[i]
		old, seen := before[m.Name]
		switch {
		case !seen && (m.Phase == ichorv1.MachinePending || m.Phase == ""):
			continue // a machine still to do is news only once it starts
		case seen && old.Phase == m.Phase && old.Step == m.Step && old.Message == m.Message && old.Attempts == m.Attempts:
			continue
		}
		transition := string(m.Phase)
		if seen && old.Phase != m.Phase {
			transition = string(old.Phase) + "->" + string(m.Phase)
		}
		l := fmt.Sprintf("%s %s machine=%s %s", ts, name, Clean(m.Name), transition)
		if m.Step != "" {
			l += " step=" + Clean(m.Step)
		}
		if m.Attempts > 1 {
			l += fmt.Sprintf(" attempt=%d", m.Attempts)
		}
		if m.Message != "" {
			l += " " + quote(m.Message)
		}
		out = append(out, l)
	}
	return out
}

// summary is the operation's state as key=value pairs; a line is logged
// whenever it changes.
func summary(op *ichorv1.TalosOperation) string {
	st := op.Status
	phase := string(st.Phase)
	if phase == "" {
		phase = "Pending"
	}
	kv := []string{"phase=" + Clean(phase)}
	add := func(k, v string) {
		if v != "" {
			kv = append(kv, k+"="+quote(v))
		}
	}
	add("reason", st.Reason)
	add("stage", st.Stage)
	add("progress", st.Progress)
	add("current", st.Current)
	add("lock", string(st.Lock))
	if op.WaitingForLock() {
		add("holder", st.LockHolder)
	}
	if op.PausedByOperator() {
		kv = append(kv, "paused=true")
	}
	if op.RetryPending() {
		kv = append(kv, "retry=pending")
	}
	if st.RetryCount > 0 {
		kv = append(kv, fmt.Sprintf("retries=%d", st.RetryCount))
	}
	add("failure", st.FailureReason)
	add("message", st.Message)
	return strings.Join(kv, " ")
}

// quote leaves simple words alone and quotes the rest, escaping anything a
// terminal would act on.
func quote(s string) string {
	if s != "" && !strings.ContainsAny(s, " \t\n\r\"'=\\\x1b") && Clean(s) == s {
		return s
	}
	return fmt.Sprintf("%q", s)
}
