package commands

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	authenticationv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/types"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/printers"
	cmdutil "k8s.io/kubectl/pkg/cmd/util"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

// plan is what pause, resume or retry does to one operation: a merge patch
// (nil when there is nothing to change), the word printed after the name,
// and an optional hint.
type plan struct {
	patch []byte
	verb  string
	note  string
	// retry is set when the patch asks for a retry, so --wait knows to
	// ignore the failure the retry is meant to clear.
	retry bool
}

// Merge patches: intent goes in spec and annotations only; status belongs to
// the controller.
var (
	patchPause       = []byte(`{"spec":{"paused":true}}`)
	patchResume      = []byte(`{"spec":{"paused":false}}`)
	patchRetry       = mustJSON(map[string]any{"metadata": map[string]any{"annotations": map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}}})
	patchResumeRetry = mustJSON(map[string]any{"metadata": map[string]any{"annotations": map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}}, "spec": map[string]any{"paused": false}})
)

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// finished refuses to steer an operation that has ended.
func finished(op *ichorv1.TalosOperation, verb string) error {
	switch {
	case op.Succeeded():
		return fmt.Errorf("talosoperation %q is Succeeded; nothing to %s", op.Name, verb)
	case op.Cancelled():
		return fmt.Errorf("talosoperation %q is Cancelled; nothing to %s: create a new operation", op.Name, verb)
	case op.Refused() && op.Failed():
		return fmt.Errorf("talosoperation %q is Refused (preflight said no and nothing ran); nothing to %s: fix what was refused and create a new operation", op.Name, verb)
	}
	return nil
}

// planPause sets spec.paused. The operation stops between two steps and
// keeps the cluster lock.
func planPause(op *ichorv1.TalosOperation, _ string) (plan, error) {
	if err := finished(op, "pause"); err != nil {
		return plan{}, err
	}
	if op.PausedByOperator() {
		return plan{verb: "already paused"}, nil
	}
	return plan{patch: patchPause, verb: "paused"}, nil
}

// planResume lifts whatever holds the operation that a person can lift: it
// clears spec.paused when an operator paused it, and asks for a retry when a
// failed step holds it; both when both.
func planResume(op *ichorv1.TalosOperation, command string) (plan, error) {
	if err := finished(op, "resume"); err != nil {
		return plan{}, err
	}
	failed := op.StepFailed() && !op.RetryPending()
	switch {
	case op.PausedByOperator() && failed:
		return plan{patch: patchResumeRetry, verb: "resumed (retrying the failed step)", retry: true}, nil
	case op.PausedByOperator() && op.StepFailed():
		return plan{patch: patchResume, verb: "resumed (the pending retry runs now)", retry: true}, nil
	case op.PausedByOperator():
		return plan{patch: patchResume, verb: "resumed"}, nil
	case failed:
		return plan{patch: patchRetry, verb: "resumed (retrying the failed step)", retry: true}, nil
	case op.StepFailed():
		return plan{verb: "already resumed (retry pending)"}, nil
	case op.WaitingForLock() || op.Status.Reason == ichorv1.ReasonClusterLockHeld:
		holder := view.Clean(op.Status.LockHolder)
		if holder == "" {
			holder = "another holder"
		}
		return plan{verb: "already resumed", note: fmt.Sprintf("%s is not paused by an operator: it waits for the cluster lock, held by %s, and starts when that finishes (see: %s lock)", ref(op.Name), holder, command)}, nil
	}
	return plan{verb: "already resumed"}, nil
}

// planRetry sets the retry annotation on an operation held by a failed step.
func planRetry(op *ichorv1.TalosOperation, command string) (plan, error) {
	if err := finished(op, "retry"); err != nil {
		return plan{}, err
	}
	var note string
	if op.PausedByOperator() {
		note = fmt.Sprintf("%s is paused by an operator: the retry runs once you resume it (%s operation resume %s)", ref(op.Name), command, op.Name)
	}
	switch {
	case !op.StepFailed():
		phase := phaseWords(op)
		return plan{verb: "has nothing to retry", note: fmt.Sprintf("%s has no failed step (%s); retry runs a failed step again", ref(op.Name), phase)}, nil
	case op.RetryPending():
		return plan{verb: "retry already requested (pending)", note: note}, nil
	}
	return plan{patch: patchRetry, verb: "retry requested", note: note, retry: true}, nil
}

// controlOptions drive pause, resume and retry.
type controlOptions struct {
	e          *Env
	action     string
	plan       func(*ichorv1.TalosOperation, string) (plan, error)
	printFlags *genericclioptions.PrintFlags
	follow     followFlags
	canFollow  bool
	// approves says the command runs an operation whose plan changed since
	// it was approved, once the new plan is shown and approved (resume).
	approves bool
	yes      bool

	names     []string
	namespace string
	dryRun    cmdutil.DryRunStrategy
}

func newControlCmd(e *Env, o *controlOptions, cmd *cobra.Command) *cobra.Command {
	o.e = e
	o.printFlags = genericclioptions.NewPrintFlags("").WithTypeSetter(Scheme)
	cmd.RunE = runE(o)
	cmd.Args = cobra.MinimumNArgs(1)
	cmdutil.AddDryRunFlag(cmd)
	o.printFlags.AddFlags(cmd)
	if o.canFollow {
		o.follow.addFlags(cmd, true)
	}
	return cmd
}

func (o *controlOptions) Complete(cmd *cobra.Command, args []string) error {
	var err error
	if o.names, err = operationNames(args); err != nil {
		return err
	}
	if o.namespace, err = o.e.Namespace(); err != nil {
		return err
	}
	if o.dryRun, err = cmdutil.GetDryRunStrategy(cmd); err != nil {
		return err
	}
	o.follow.complete(cmd)
	return nil
}

func (o *controlOptions) Validate() error {
	if o.follow.following() && len(o.names) != 1 {
		return usageErrorf("--watch and --wait follow one operation; %d given", len(o.names))
	}
	if o.follow.following() && o.dryRun != cmdutil.DryRunNone {
		return usageErrorf("--watch and --wait cannot be used with --dry-run")
	}
	return o.follow.validate()
}

func (o *controlOptions) printer(verb string) (printers.ResourcePrinter, error) {
	o.printFlags.NamePrintFlags.Operation = verb
	return cmdutil.PrintFlagsWithDryRunStrategy(o.printFlags, o.dryRun).ToPrinter()
}

func (o *controlOptions) Run(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c, err := o.e.NewClient()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range o.names {
		op, p, err := o.apply(ctx, c, name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if o.follow.following() {
			baseline := int32(-1)
			if p.retry {
				baseline = op.Status.RetryCount
			}
			view := o.e.Streams.Out
			if o.printFlags.OutputFormat != nil && *o.printFlags.OutputFormat != "" {
				view = o.e.Streams.ErrOut
			}
			return o.e.follow(ctx, c, o.namespace, name, o.follow, view, baseline)
		}
	}
	return utilerrors.NewAggregate(errs)
}

// apply plans and sends the change to one operation and prints the result.
func (o *controlOptions) apply(ctx context.Context, c client.Client, name string) (*ichorv1.TalosOperation, plan, error) {
	op, err := getOperation(ctx, c, o.namespace, name)
	if err != nil {
		return nil, plan{}, err
	}
	if o.approves && op.PlanChanged() {
		return op, plan{}, o.approveChanged(ctx, c, op)
	}
	p, err := o.plan(op, o.e.Name)
	if err != nil {
		return nil, plan{}, err
	}
	before := op.DeepCopy()
	if p.patch != nil {
		opts := []client.PatchOption{client.FieldOwner(FieldManager)}
		if o.dryRun == cmdutil.DryRunServer {
			opts = append(opts, client.DryRunAll)
		}
		if o.dryRun != cmdutil.DryRunClient {
			if err := c.Patch(ctx, op, client.RawPatch(types.MergePatchType, p.patch), opts...); err != nil {
				return nil, plan{}, err
			}
		}
	}
	printer, err := o.printer(p.verb)
	if err != nil {
		return nil, plan{}, err
	}
	if err := printer.PrintObj(op, o.e.Streams.Out); err != nil {
		return nil, plan{}, err
	}
	if p.note != "" {
		fmt.Fprintln(o.e.Streams.ErrOut, p.note)
	}
	return before, p, nil
}

// planCancel sets the cancel annotation, naming who asked. who is looked up
// only when there is something to cancel.
func planCancel(who func() string) func(*ichorv1.TalosOperation, string) (plan, error) {
	return func(op *ichorv1.TalosOperation, _ string) (plan, error) {
		if err := finished(op, "cancel"); err != nil {
			return plan{}, err
		}
		if asked, by := op.CancelRequested(); asked {
			return plan{verb: "already cancelled (by " + view.Clean(by) + ")"}, nil
		}
		patch := mustJSON(map[string]any{"metadata": map[string]any{"annotations": map[string]string{ichorv1.CancelAnnotation: who()}}})
		return plan{patch: patch, verb: "cancelled"}, nil
	}
}

// requester is the user the API server knows the caller as (a
// SelfSubjectReview), or "" when it cannot say.
func requester(ctx context.Context, c client.Client) string {
	r := &authenticationv1.SelfSubjectReview{}
	if err := c.Create(ctx, r); err != nil {
		return ""
	}
	return r.Status.UserInfo.Username
}

// requester is the user the API server knows the caller as, or "".
func (o *controlOptions) requester() string {
	c, err := o.e.NewClient()
	if err != nil {
		return ""
	}
	return requester(context.Background(), c)
}

func newCancelCmd(e *Env) *cobra.Command {
	o := &controlOptions{action: "cancel"}
	o.plan = planCancel(o.requester)
	return newControlCmd(e, o, &cobra.Command{
		Use:   "cancel NAME...",
		Short: "Stop operations for good, keeping their record",
		Long: fmt.Sprintf(`Cancel operations: each stops for good, and unlike delete its record stays.
The steps in flight settle first (a machine mid-reboot comes back), then the
cordons the operation made are lifted and the cluster lock goes to the next
waiter. The phase becomes Cancelled, and the message says by whom and which
machines were done. This sets the annotation %[2]s=<your user name>,
as

  kubectl annotate talosoperation NAME %[2]s=alice

does. Nothing done is rolled back; a cancelled operation cannot be resumed:
create a new one.`, e.Name, ichorv1.CancelAnnotation),
		Example:           fmt.Sprintf("  %[1]s operation cancel upgrade-talos-7fk2q", e.Name),
		ValidArgsFunction: e.completeOperations(cancellable),
	})
}

func newPauseCmd(e *Env) *cobra.Command {
	o := &controlOptions{action: "pause", plan: planPause}
	return newControlCmd(e, o, &cobra.Command{
		Use:   "pause NAME...",
		Short: "Pause operations between two steps; they keep the cluster lock",
		Long: `Pause operations: each stops advancing between two steps (never inside one)
and keeps the cluster lock, so nothing else disruptive starts in the middle of
it. This sets spec.paused; resume lifts it.`,
		Example:           fmt.Sprintf("  %[1]s operation pause upgrade-talos-7fk2q", e.Name),
		ValidArgsFunction: e.completeOperations(pausable),
	})
}

// approveChanged shows the new plan of an operation held because its plan
// changed since it was approved, and runs it once approved: --yes, or the
// person at the terminal. Without either it refuses, and nothing changes.
func (o *controlOptions) approveChanged(ctx context.Context, c client.Client, op *ichorv1.TalosOperation) error {
	out := o.e.Streams.Out
	fmt.Fprintf(out, "The plan of %s changed since it was approved (the cluster changed before it started); the new plan:\n", ref(op.Name))
	if o.dryRun != cmdutil.DryRunNone {
		text, err := planText(op)
		fmt.Fprint(out, text)
		return err
	}
	answer := func() (bool, error) {
		switch {
		case o.yes:
			return true, nil
		case !o.e.IsTerminal(o.e.Streams.In):
			return false, fmt.Errorf("%s waits for its new plan to be approved, and there is no terminal to ask on: read the plan above, then run it with %s operation resume %s --yes (or delete the operation)", ref(op.Name), o.e.Name, op.Name)
		}
		run, err := o.e.ask("Run this plan?")
		if err == nil && !run {
			fmt.Fprintf(o.e.Streams.ErrOut, "%s stays held; nothing ran\n", ref(op.Name))
		}
		return run, err
	}
	_, err := approvePlan(ctx, c, op, out, o.e.Name, answer)
	return err
}

func newResumeCmd(e *Env) *cobra.Command {
	o := &controlOptions{action: "resume", plan: planResume, canFollow: true, approves: true}
	cmd := newControlCmd(e, o, &cobra.Command{
		Use:   "resume NAME...",
		Short: "Resume paused operations; on a failed step, run it again",
		Long: fmt.Sprintf(`Resume operations. On an operation an operator paused it clears spec.paused;
on one held by a failed step it asks ichor-controller to run that step again
(the %[2]s=%[3]s annotation, like retry); on one that is both, both.

Fix the cause of a failure before resuming: a failed step is never retried by
itself, and nothing is rolled back.

An operation whose plan was approved (--plan) and changed before it started,
as the cluster changed, is held (PlanChanged): resume prints the new plan and
asks whether to run it (--yes answers yes).`, e.Name, ichorv1.RetryAnnotation, ichorv1.RetryRequested),
		Example: fmt.Sprintf(`  # Resume and follow live until it succeeds or fails
  %[1]s operation resume upgrade-talos-7fk2q --watch`, e.Name),
		ValidArgsFunction: e.completeOperations(resumable),
	})
	cmd.Flags().BoolVarP(&o.yes, "yes", "y", false, "Run a changed plan without asking (see above)")
	return cmd
}

func newRetryCmd(e *Env) *cobra.Command {
	o := &controlOptions{action: "retry", plan: planRetry, canFollow: true}
	return newControlCmd(e, o, &cobra.Command{
		Use:   "retry NAME...",
		Short: "Run the failed step of operations again",
		Long: fmt.Sprintf(`Ask ichor-controller to run the failed step of an operation again. This sets
the annotation %[2]s=%[3]s, exactly as

  kubectl annotate talosoperation NAME %[2]s=%[3]s

does. The controller acts on it once: it records status.lastRetry, counts
status.retryCount, clears the failure, runs the step again and removes the
annotation. Machines that completed stay completed.

Fix the cause first. An operation an operator also paused runs the retry once
resumed ('%[1]s operation resume NAME' does both).`, e.Name, ichorv1.RetryAnnotation, ichorv1.RetryRequested),
		Example: fmt.Sprintf(`  # Retry and wait for the outcome (exit 0 done, 2 failed again, 3 timeout)
  %[1]s retry upgrade-talos-7fk2q --wait --timeout 30m`, e.Name),
		ValidArgsFunction: e.completeOperations(retryable),
	})
}

// planSkip sets the skip annotations for one machine, naming who asked.
// What the controller would refuse (a machine with a step in flight, one
// that has not failed, one the operation does not have) is refused here
// first, in the same words, and nothing is sent.
func planSkip(machine string, uncordon bool, who func() string) func(*ichorv1.TalosOperation, string) (plan, error) {
	return func(op *ichorv1.TalosOperation, _ string) (plan, error) {
		if err := finished(op, "skip"); err != nil {
			return plan{}, err
		}
		if req, ok := op.SkipRequested(); ok {
			if req.Machine == machine {
				return plan{verb: "skip of " + view.Clean(machine) + " already requested (pending)"}, nil
			}
			return plan{}, fmt.Errorf("talosoperation %q has a skip of %s pending: wait until ichor-controller has acted on it (its %s annotation goes), then skip %s",
				op.Name, view.Clean(req.Machine), ichorv1.SkipAnnotation, view.Clean(machine))
		}
		if why := op.CannotSkip(machine); why != "" {
			return plan{}, fmt.Errorf("cannot skip %s in talosoperation %q: %s", view.Clean(machine), op.Name, view.Clean(why))
		}
		ann := map[string]string{ichorv1.SkipAnnotation: machine}
		if by := who(); by != "" {
			ann[ichorv1.SkipByAnnotation] = by
		}
		note := fmt.Sprintf("Ichor's cordon on %[1]s, if it left one, stays: --uncordon lifts it (or kubectl uncordon %[1]s)", view.Clean(machine))
		if uncordon {
			ann[ichorv1.SkipUncordonAnnotation] = "true"
			note = ""
		}
		patch := mustJSON(map[string]any{"metadata": map[string]any{"annotations": ann}})
		return plan{patch: patch, verb: "skip of " + view.Clean(machine) + " requested", note: note}, nil
	}
}

// skipOptions drive skip: one operation and one of its machines.
type skipOptions struct {
	controlOptions
	machine  string
	uncordon bool
}

func (o *skipOptions) Complete(cmd *cobra.Command, args []string) error {
	if err := o.controlOptions.Complete(cmd, args[:1]); err != nil {
		return err
	}
	if o.machine = strings.TrimSpace(args[1]); o.machine == "" {
		return usageErrorf("give the machine to skip: its Node name, as the operation lists it")
	}
	return nil
}

func newSkipCmd(e *Env) *cobra.Command {
	o := &skipOptions{controlOptions: controlOptions{action: "skip"}}
	o.plan = func(op *ichorv1.TalosOperation, command string) (plan, error) {
		return planSkip(o.machine, o.uncordon, o.requester)(op, command)
	}
	cmd := newControlCmd(e, &o.controlOptions, &cobra.Command{
		Use:   "skip NAME MACHINE",
		Short: "Give up on a machine whose step failed, and go on with the rest",
		Long: fmt.Sprintf(`Skip a machine of an operation after its step failed and you have given up
on it (broken hardware): ichor-controller marks it Skipped, by you, and the
operation goes on with the other machines. The skipped machine no longer
counts against maxUnavailable as this operation's (a worker that is down
still counts, as every worker that is down does). Ichor's cordon on it stays
unless you pass --uncordon. The result says so: "done on 5/6 machine(s),
1 skipped".

Only a machine whose step failed can be skipped. A machine with a step in
flight is refused, since an irreversible call (an upgrade, a reboot) may be
under way on it: wait until the step has ended. To leave out a machine that
has not started, put its Node on hold (%[2]s) instead.

This sets the annotations %[3]s=MACHINE, %[4]s=<your user name>
and, with --uncordon, %[5]s=true, as

  kubectl annotate talosoperation NAME %[3]s=w-2 %[4]s=alice

does. The controller acts on them once, leaves a MachineSkipped Event naming
you, and removes them.`, e.Name, ichorv1.UpgradeHoldAnnotation, ichorv1.SkipAnnotation, ichorv1.SkipByAnnotation, ichorv1.SkipUncordonAnnotation),
		Example: fmt.Sprintf(`  # Give up on worker-3, whose install failed, and lift Ichor's cordon on it
  %[1]s operation skip upgrade-talos-7fk2q worker-3 --uncordon`, e.Name),
		ValidArgsFunction: e.completeSkip,
	})
	cmd.RunE = runE(o)
	cmd.Args = cobra.ExactArgs(2)
	cmd.Flags().BoolVar(&o.uncordon, "uncordon", false, "Also lift Ichor's cordon on the skipped machine (without it the cordon stays)")
	return cmd
}
