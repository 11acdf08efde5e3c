package commands

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

type watchOptions struct {
	e      *Env
	ff     followFlags
	latest bool
	output string

	namespace string
	name      string
}

func newWatchCmd(e *Env) *cobra.Command {
	o := &watchOptions{e: e}
	cmd := &cobra.Command{
		Use:   "watch [NAME | --latest]",
		Short: "Watch an operation live until it succeeds or fails",
		Long: fmt.Sprintf(`Watch an operation live: its phase, stage, lock and one line per machine
with its step, elapsed time and message. Machines in the same phase fold into
one row when they do not fit the terminal.

On a terminal the view redraws in place; otherwise it prints an append-only,
timestamped log of changes; -o json streams one watch event per line.

The watch ends by itself when the operation succeeds (exit 0), a step fails,
preflight refuses it or it was cancelled (exit 2, once the steps in flight have
settled); --timeout ends it with exit 3 and Ctrl-C with
130. An etcd restore is followed through the API's absence and the rewind:
the operation the controller writes back from its journal (a new UID) is the
same one. Without NAME or --latest it shows every operation in the namespace until
interrupted or --timeout.

Icons:
%s`, view.Legend()),
		Example: fmt.Sprintf(`  # Follow the newest operation in the namespace
  %[1]s watch --latest

  # Follow one operation for at most an hour, in a CI log
  %[1]s watch upgrade-talos-7fk2q --timeout 1h

  # Stream changes as JSON
  %[1]s watch upgrade-talos-7fk2q -o json | jq -c '.object.status.progress'`, e.Name),
		Args:              cobra.MaximumNArgs(1),
		ValidArgsFunction: e.completeOperations(anyOperation),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.Complete(args); err != nil {
				return err
			}
			if err := o.Validate(); err != nil {
				return err
			}
			return o.Run(cmd.Context())
		},
	}
	o.ff.addFlags(cmd, false)
	cmd.Flags().BoolVar(&o.latest, "latest", false, "Watch the newest operation in the namespace")
	cmd.Flags().StringVarP(&o.output, "output", "o", "", "Output format: empty for the live view or log, json for one watch event per line")
	_ = cmd.RegisterFlagCompletionFunc("output", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return []string{"json"}, cobra.ShellCompDirectiveNoFileComp
	})
	return cmd
}

func (o *watchOptions) Complete(args []string) error {
	var err error
	if o.namespace, err = o.e.Namespace(); err != nil {
		return err
	}
	if len(args) == 1 {
		if o.name, err = operationName(args[0]); err != nil {
			return err
		}
	}
	o.ff.watch = true
	o.ff.json = o.output == "json"
	return nil
}

func (o *watchOptions) Validate() error {
	if o.name != "" && o.latest {
		return usageErrorf("give NAME or --latest, not both")
	}
	if o.output != "" && o.output != "json" {
		return usageErrorf("unsupported --output %q: watch prints the live view, or json", o.output)
	}
	return o.ff.validate()
}

func (o *watchOptions) Run(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c, err := o.e.NewClient()
	if err != nil {
		return err
	}
	if o.latest {
		op, err := latestOperation(ctx, c, o.namespace)
		if err != nil {
			return err
		}
		o.name = op.Name
	}
	if o.name != "" {
		return o.e.follow(ctx, c, o.namespace, o.name, o.ff, o.e.Streams.Out, -1)
	}
	return o.watchAll(ctx, c)
}

// watchAll shows every operation in the namespace until interrupted or the
// timeout passes; it has no outcome of its own.
func (o *watchOptions) watchAll(ctx context.Context, c client.WithWatch) error {
	// Fail fast, the way kubectl does, when the operations cannot be listed.
	if err := c.List(ctx, &ichorv1.TalosOperationList{}, client.InNamespace(o.namespace), client.Limit(1)); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	var deadline <-chan time.Time
	if o.ff.timeout > 0 {
		t := time.NewTimer(o.ff.timeout)
		defer t.Stop()
		deadline = t.C
	}
	w := watchOperations(ctx, c, o.namespace, "")
	defer w.Stop()

	out := o.e.Streams.Out
	ops := map[string]*ichorv1.TalosOperation{}
	tty := !o.ff.json && o.e.IsTerminal(out)
	var screen *view.Screen
	if tty {
		screen = view.NewScreen(out)
		defer func() { _ = screen.Close() }()
	}
	var jsonOut jsonDisplay
	jsonOut.out = out
	draw := func() error {
		width, height, err := o.e.TermSize(out)
		if err != nil {
			width, height = 120, 40
		}
		sorted := make([]ichorv1.TalosOperation, 0, len(ops))
		for _, op := range ops {
			sorted = append(sorted, *op)
		}
		sortByArrival(sorted)
		frame := view.RenderList(o.namespace, sorted, view.Options{
			Width: width, Height: height - 1, Color: o.e.UseColor(out), ASCII: o.ff.ascii, Now: o.e.Now(), Command: o.e.Name,
		})
		return screen.Draw(frame, width)
	}
	if tty {
		if err := draw(); err != nil {
			return err
		}
	}
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return errors.New("watch of TalosOperations ended unexpectedly")
			}
			op, isOp := ev.Object.(*ichorv1.TalosOperation)
			if !isOp {
				continue
			}
			prev := ops[op.Name]
			switch {
			case o.ff.json:
				if err := jsonOut.update(ev.Type, op); err != nil {
					return err
				}
			case !tty:
				lines := view.Changes(prev, op, o.e.Now())
				if ev.Type == watch.Deleted {
					lines = []string{fmt.Sprintf("%s %s deleted", o.e.Now().UTC().Format(time.RFC3339), view.Clean(op.Name))}
				}
				for _, l := range lines {
					fmt.Fprintln(out, l)
				}
			}
			if ev.Type == watch.Deleted {
				delete(ops, op.Name)
			} else {
				ops[op.Name] = op
			}
			if tty {
				if err := draw(); err != nil {
					return err
				}
			}
		case <-ticker.C:
			if tty {
				if err := draw(); err != nil {
					return err
				}
			}
		case <-deadline:
			return exitError(ExitTimeout, "timed out after %s watching TalosOperations in %s", o.ff.timeout, o.namespace)
		case <-ctx.Done():
			return stoppedFollowing(fmt.Sprintf("stopped watching TalosOperations in %s; the operations keep running", o.namespace))
		}
	}
}
