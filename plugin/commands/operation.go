package commands

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/kubectl/pkg/cmd/get"
	cmdutil "k8s.io/kubectl/pkg/cmd/util"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func newOperationCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "operation",
		Aliases: []string{"op", "ops", "operations"},
		Short:   "List, describe, pause, resume, retry, skip, cancel and delete operations",
	}
	cmd.AddCommand(newListCmd(e), newDescribeCmd(e), newPauseCmd(e), newResumeCmd(e), newRetryCmd(e), newSkipCmd(e), newCancelCmd(e), newDeleteCmd(e))
	return cmd
}

// Flags of kubectl get that name other resources; the operation commands
// always list TalosOperations.
var otherResourceFlags = []string{"raw", "filename", "kustomize", "recursive", "subresource"}

// newListCmd is kubectl's own get command fixed to TalosOperations, so its
// tables (from the server, with the CRD's columns), -o, -w, -A, -l, --sort-by
// and the rest are exactly kubectl's.
func newListCmd(e *Env) *cobra.Command {
	cmd := get.NewCmdGet(e.Name, e.Factory, e.Streams)
	run := cmd.Run
	cmd.Use = "list [NAME...]"
	cmd.Aliases = []string{"get", "ls"}
	cmd.SuggestFor = nil
	cmd.Short = "List operations, or print some (like kubectl get talosoperations)"
	cmd.Long = fmt.Sprintf(`List TalosOperations, or print the named ones. This is kubectl get for
TalosOperations: the same table (its columns come from the server), the same
-o formats (wide, json, yaml, name, jsonpath, go-template, custom-columns),
and the same -w, -A, -l and --sort-by. '%[1]s operation get NAME' prints one.`, e.Name)
	cmd.Example = fmt.Sprintf(`  # Operations in the current namespace, with the lock and target columns
  %[1]s operation list -o wide

  # One operation as YAML
  %[1]s operation get upgrade-talos-7fk2q -o yaml

  # The phase of every operation in the cluster
  %[1]s operation list -A -o custom-columns=NAME:.metadata.name,PHASE:.status.phase`, e.Name)
	for _, f := range otherResourceFlags {
		if fl := cmd.Flags().Lookup(f); fl != nil {
			fl.Hidden = true
		}
	}
	cmd.ValidArgsFunction = e.completeOperations(anyOperation)
	cmd.Run = nil
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		for _, f := range otherResourceFlags {
			if cmd.Flags().Changed(f) {
				return usageErrorf("--%s is not supported here: use kubectl get for other resources", f)
			}
		}
		names, err := operationNames(args)
		if err != nil {
			return err
		}
		run(cmd, append([]string{qualified}, names...))
		return nil
	}
	return cmd
}

// delete

type deleteOptions struct {
	e          *Env
	printFlags *genericclioptions.PrintFlags
	wait       bool
	timeout    time.Duration

	names     []string
	namespace string
	dryRun    cmdutil.DryRunStrategy
}

func newDeleteCmd(e *Env) *cobra.Command {
	o := &deleteOptions{e: e, printFlags: genericclioptions.NewPrintFlags("deleted").WithTypeSetter(Scheme)}
	cmd := &cobra.Command{
		Use:   "delete NAME...",
		Short: "Delete operations (one mid-step is let go once the step in flight settles)",
		Long: `Delete operations. ichor-controller keeps an operation deleted mid-step
(a finalizer) until the step in flight has settled, then lets go of the
cluster lock; --wait waits for that. Nothing is rolled back.`,
		Example:           fmt.Sprintf("  %[1]s operation delete upgrade-talos-7fk2q --wait --timeout 10m", e.Name),
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: e.completeOperations(anyOperation),
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if o.names, err = operationNames(args); err != nil {
				return err
			}
			if o.namespace, err = e.Namespace(); err != nil {
				return err
			}
			if o.dryRun, err = cmdutil.GetDryRunStrategy(cmd); err != nil {
				return err
			}
			if o.timeout > 0 {
				o.wait = true
			}
			return o.Run(cmd.Context())
		},
	}
	cmdutil.AddDryRunFlag(cmd)
	o.printFlags.AddFlags(cmd)
	cmd.Flags().BoolVar(&o.wait, "wait", false, "Wait until the operations are gone")
	cmd.Flags().DurationVar(&o.timeout, "timeout", 0, "Give up waiting after this long, with exit code 3; implies --wait")
	return cmd
}

func (o *deleteOptions) Run(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c, err := o.e.NewClient()
	if err != nil {
		return err
	}
	printer, err := cmdutil.PrintFlagsWithDryRunStrategy(o.printFlags, o.dryRun).ToPrinter()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range o.names {
		op, err := getOperation(ctx, c, o.namespace, name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if o.dryRun != cmdutil.DryRunClient {
			opts := []client.DeleteOption{}
			if o.dryRun == cmdutil.DryRunServer {
				opts = append(opts, client.DryRunAll)
			}
			if err := c.Delete(ctx, op, opts...); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		if err := printer.PrintObj(op, o.e.Streams.Out); err != nil {
			return err
		}
		if o.wait && o.dryRun == cmdutil.DryRunNone {
			if err := o.waitGone(ctx, c, op); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return utilerrors.NewAggregate(errs)
}

func (o *deleteOptions) waitGone(ctx context.Context, c client.WithWatch, op *ichorv1.TalosOperation) error {
	if o.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}
	w := watchOperations(ctx, c, op.Namespace, op.Name)
	defer w.Stop()
	if _, err := getOperation(ctx, c, op.Namespace, op.Name); apierrors.IsNotFound(err) {
		return nil
	}
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return fmt.Errorf("watch of %s ended unexpectedly", ref(op.Name))
			}
			if ev.Type == watch.Deleted {
				return nil
			}
		case <-ctx.Done():
			return exitError(ExitTimeout, "timed out after %s waiting for %s to be deleted (ichor-controller lets go once the step in flight settles)", o.timeout, ref(op.Name))
		}
	}
}
