package commands

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/duration"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	stages "maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/plugin/view"
)

func newTabWriter(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 8, 2, ' ', 0) }

func newDescribeCmd(e *Env) *cobra.Command {
	return &cobra.Command{
		Use:   "describe NAME...",
		Short: "Show an operation in detail: spec, conditions, machines, the lock, recent Events",
		Example: fmt.Sprintf(`  %[1]s operation describe upgrade-talos-7fk2q
  %[1]s operation describe $(%[1]s operation list -o name)`, e.Name),
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: e.completeOperations(anyOperation),
		RunE: func(cmd *cobra.Command, args []string) error {
			names, err := operationNames(args)
			if err != nil {
				return err
			}
			ns, err := e.Namespace()
			if err != nil {
				return err
			}
			c, err := e.NewClient()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			for i, name := range names {
				op, err := getOperation(ctx, c, ns, name)
				if err != nil {
					return err
				}
				if i > 0 {
					fmt.Fprintln(e.Streams.Out)
				}
				if err := e.describe(ctx, c, op, e.Streams.Out); err != nil {
					return err
				}
			}
			return nil
		},
	}
}

// describe prints an operation for a person, kubectl describe style.
func (e *Env) describe(ctx context.Context, c client.Reader, op *ichorv1.TalosOperation, out io.Writer) error {
	now := e.Now()
	w := newTabWriter(out)
	st := op.Status
	field := func(label, value string) {
		if value != "" {
			fmt.Fprintf(w, "%s:\t%s\n", label, value)
		}
	}
	when := func(t *metav1.Time) string {
		if t == nil {
			return ""
		}
		return fmt.Sprintf("%s (%s ago)", t.UTC().Format(time.RFC3339), duration.HumanDuration(now.Sub(t.Time)))
	}
	field("Name", view.Clean(op.Name))
	field("Namespace", view.Clean(op.Namespace))
	field("Kind", string(op.Spec.Kind))
	field("Target", view.Target(op))
	field("Created", when(&op.CreationTimestamp))
	phase := string(st.Phase)
	if phase == "" {
		phase = "<not yet picked up by ichor-controller>"
	}
	if st.Reason != "" {
		phase += " (" + view.Clean(st.Reason) + ")"
	}
	field("Phase", phase)
	field("Failure", view.Clean(st.FailureReason))
	field("Message", view.Clean(st.Message))
	// What the operator must do once it succeeds (a succeeded one's
	// message says it).
	if st.Phase != ichorv1.PhaseSucceeded {
		field("Afterwards", ichorv1.Afterwards(op.Spec))
	}
	field("Stage", view.Clean(st.Stage))
	field("Progress", view.Clean(st.Progress))
	field("Current", view.Clean(st.Current))
	switch st.Lock {
	case ichorv1.LockHeld:
		field("Lock", "Held")
	case ichorv1.LockWaiting:
		field("Lock", "Waiting for "+view.Clean(st.LockHolder))
	}
	field("Started", when(st.StartTime))
	field("Completed", when(st.CompletionTime))
	if st.RetryCount > 0 || st.LastRetry != nil {
		field("Retries", fmt.Sprintf("%d, last %s", st.RetryCount, when(st.LastRetry)))
	}
	if op.RetryPending() {
		field("Retry", "requested, waiting for ichor-controller ("+ichorv1.RetryAnnotation+"="+ichorv1.RetryRequested+")")
	}
	if req, ok := op.SkipRequested(); ok {
		field("Skip", fmt.Sprintf("of %s requested by %s, waiting for ichor-controller (%s)", view.Clean(req.Machine), view.Clean(req.By), ichorv1.SkipAnnotation))
	}
	field("Generation", fmt.Sprintf("%d (observed %d)", op.Generation, st.ObservedGeneration))
	if op.DeletionTimestamp != nil {
		field("Deleting", "since "+when(op.DeletionTimestamp)+"; let go once the step in flight settles")
	}
	spec, err := yaml.Marshal(op.Spec)
	if err != nil {
		return err
	}
	fmt.Fprintln(w, "Spec:")
	for _, l := range strings.Split(strings.TrimRight(string(spec), "\n"), "\n") {
		fmt.Fprintf(w, "  %s\n", view.Clean(l))
	}

	fmt.Fprintln(w, "Conditions:")
	if len(st.Conditions) == 0 {
		fmt.Fprintln(w, "  <none>")
	} else {
		fmt.Fprintln(w, "  TYPE\tSTATUS\tREASON\tSINCE\tGEN\tMESSAGE")
		for _, cnd := range st.Conditions {
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%d\t%s\n", view.Clean(cnd.Type), cnd.Status, view.Clean(cnd.Reason),
				duration.HumanDuration(now.Sub(cnd.LastTransitionTime.Time)), cnd.ObservedGeneration, view.Clean(cnd.Message))
		}
	}

	machines, title := st.Machines, "Machines:"
	if len(st.Stages) > 0 {
		fmt.Fprintln(w, "Stages:")
		for _, r := range view.StageTable(op, now) {
			fmt.Fprintf(w, "  %s\n", r)
		}
		// The others' phases and steps are those of an earlier stage.
		machines = view.StageMachines(op)
		if s, i := stages.Stage(&st); i >= 0 {
			title = fmt.Sprintf("Machines (stage %s, %d of %d):", view.Clean(s.Name), len(machines), len(st.Machines))
		}
	}
	fmt.Fprintln(w, title)
	if len(machines) == 0 {
		fmt.Fprintln(w, "  <none yet>")
	} else {
		fmt.Fprintln(w, "  NAME\tROLE\tPHASE\tSTEP\tATTEMPTS\tFROM\tTO\tTIME\tMESSAGE")
		for i := range machines {
			m := &machines[i]
			took := ""
			if m.StartedAt != nil {
				end := now
				if m.FinishedAt != nil {
					end = m.FinishedAt.Time
				}
				took = duration.HumanDuration(end.Sub(m.StartedAt.Time))
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", view.Clean(m.Name), m.Role, m.Phase, view.Clean(m.Step), m.Attempts,
				view.Clean(m.From), view.Clean(m.To), took, view.Clean(m.Message))
		}
	}

	fmt.Fprintln(w, "Cluster lock:")
	if lock, err := readLock(ctx, c, e.ControllerNamespace); err != nil {
		fmt.Fprintf(w, "  <unknown: %s>\n", view.Clean(err.Error()))
	} else {
		lock.print(w, now, "  ")
	}

	fmt.Fprintln(w, "Events:")
	events, err := recentEvents(ctx, c, op)
	switch {
	case err != nil:
		fmt.Fprintf(w, "  <unknown: %s>\n", view.Clean(err.Error()))
	case len(events) == 0:
		fmt.Fprintln(w, "  <none>")
	default:
		fmt.Fprintln(w, "  TYPE\tREASON\tAGE\tFROM\tMESSAGE")
		for _, ev := range events {
			age := duration.HumanDuration(now.Sub(eventTime(&ev)))
			if ev.Count > 1 {
				age += fmt.Sprintf(" (x%d)", ev.Count)
			}
			from := ev.Source.Component
			if from == "" {
				from = ev.ReportingController
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\n", view.Clean(ev.Type), view.Clean(ev.Reason), age, view.Clean(from), view.Clean(ev.Message))
		}
	}
	return w.Flush()
}

// recentEvents are the operation's last 20 Events, oldest first.
func recentEvents(ctx context.Context, c client.Reader, op *ichorv1.TalosOperation) ([]corev1.Event, error) {
	list := &corev1.EventList{}
	sel := fields.Set{"involvedObject.uid": string(op.UID)}.AsSelector()
	if err := c.List(ctx, list, client.InNamespace(op.Namespace), client.MatchingFieldsSelector{Selector: sel}); err != nil {
		return nil, err
	}
	evs := list.Items
	sort.SliceStable(evs, func(i, j int) bool { return eventTime(&evs[i]).Before(eventTime(&evs[j])) })
	if len(evs) > 20 {
		evs = evs[len(evs)-20:]
	}
	return evs, nil
}

func eventTime(ev *corev1.Event) time.Time {
	switch {
	case !ev.LastTimestamp.IsZero():
		return ev.LastTimestamp.Time
	case !ev.EventTime.IsZero():
		return ev.EventTime.Time
	}
	return ev.CreationTimestamp.Time
}
