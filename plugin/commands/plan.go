package commands

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	watchtools "k8s.io/client-go/tools/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

// planWait is how long --plan waits for ichor-controller to check and plan
// the operation it created paused (--timeout overrides it).
const planWait = 2 * time.Minute

// runPlan carries out --plan for an operation just created paused: it waits
// for ichor-controller's preflight and plan, prints the plan, and asks
// whether to run it (resume) or not (delete); --yes answers yes. Without a
// terminal it leaves the operation paused and says how to resume it. The
// plan run is the plan shown (approvePlan).
func (o *createOptions) runPlan(ctx context.Context, c client.WithWatch, out io.Writer) error {
	timeout := planWait
	if o.follow.timeout > 0 {
		timeout = o.follow.timeout
	}
	name := o.op.Name
	shown, err := waitFor(ctx, c, o.namespace, name, timeout, checked)
	switch {
	case errors.Is(err, watchtools.ErrWatchClosed) || wait.Interrupted(err):
		msg := ""
		if shown != nil && shown.Status.Message != "" {
			msg = " (" + view.Clean(shown.Status.Message) + ")"
		}
		return fmt.Errorf("ichor-controller has not planned %s within %s%s; it stays paused: see it with %s watch %s, then %s", ref(name), timeout, msg, o.e.Name, name, o.leftPaused(name))
	case err != nil:
		return err
	}
	run, err := approvePlan(ctx, c, shown, out, o.e.Name, o.answer)
	if err != nil || !run {
		return err
	}
	if !o.follow.following() {
		fmt.Fprintf(o.e.Streams.ErrOut, "follow it with: %s watch %s\n", o.e.Name, name)
		return nil
	}
	return o.e.follow(ctx, c, o.namespace, name, o.follow, out, -1)
}

// approvePlan prints the plan of an operation that has not started and
// asks (answer) whether to run it; on a yes it resumes the operation
// with the plan approved (resumeUnchanged). If the cluster changed and the
// controller planned again meanwhile, the new plan is shown and asked
// about again. It reports whether the operation runs.
func approvePlan(ctx context.Context, c client.Client, shown *ichorv1.TalosOperation, out io.Writer, command string, answer func() (bool, error)) (bool, error) {
	for {
		if shown.Refused() {
			_, err := outcome(shown, -1, command)
			return false, err
		}
		text, err := planText(shown)
		if err != nil {
			return false, err
		}
		fmt.Fprint(out, text)
		run, err := answer()
		if err != nil || !run {
			return false, err
		}
		latest, changed, err := resumeUnchanged(ctx, c, shown, text)
		if err != nil {
			return false, err
		}
		if !changed {
			fmt.Fprintf(out, "%s resumed: it runs the plan above\n", ref(shown.Name))
			return true, nil
		}
		fmt.Fprintln(out, "The plan changed since it was printed (the cluster changed); the new plan:")
		shown = latest
	}
}

// answer says whether to run the plan: --yes, or the person at the
// terminal. A no deletes the operation; without a terminal it stays paused.
func (o *createOptions) answer() (bool, error) {
	name := o.op.Name
	if o.yes {
		return true, nil
	}
	if !o.e.IsTerminal(o.e.Streams.In) {
		fmt.Fprintf(o.e.Streams.ErrOut, "%s is paused, and nothing has run: there is no terminal to ask on. %s\n", ref(name), capitalize(o.leftPaused(name)))
		return false, nil
	}
	question := "Run this plan?"
	if o.danger != nil {
		question = o.danger(&o.op.Spec) + "\n" + question
	}
	run, err := o.e.ask(question)
	if err != nil || run {
		return run, err
	}
	c, err := o.e.NewClient()
	if err != nil {
		return false, err
	}
	if err := c.Delete(context.Background(), o.op); client.IgnoreNotFound(err) != nil {
		return false, err
	}
	fmt.Fprintf(o.e.Streams.ErrOut, "%s deleted; nothing ran\n", ref(name))
	return false, nil
}

// leftPaused says how to go on with an operation left paused.
func (o *createOptions) leftPaused(name string) string {
	return fmt.Sprintf("run it with: %s operation resume %s (or delete it: kubectl delete talosoperation %s -n %s)", o.e.Name, name, name, o.namespace)
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return string(s[0]-'a'+'A') + s[1:]
}

func planText(op *ichorv1.TalosOperation) (string, error) {
	var b bytes.Buffer
	err := view.Plan(&b, op)
	return b.String(), err
}

// resumeUnchanged resumes the operation only if it is as shown: the merge
// patch carries the resourceVersion it was printed at, so the API server
// refuses it if anything changed since, and the plan's fingerprint
// (PlanApprovedAnnotation), so the controller runs that plan only: if the
// cluster changes before the operation starts and the plan made again
// differs, the controller holds it (PlanChanged) for the new plan to be
// approved. A change that leaves the printed plan as it was (a
// condition's time) is not a change of plan: the resume is sent again on
// the latest version. Otherwise it returns the latest version and changed.
func resumeUnchanged(ctx context.Context, c client.Client, shown *ichorv1.TalosOperation, text string) (*ichorv1.TalosOperation, bool, error) {
	for {
		patch := mustJSON(map[string]any{
			"metadata": map[string]any{"resourceVersion": shown.ResourceVersion, "annotations": map[string]string{ichorv1.PlanApprovedAnnotation: shown.PlanFingerprint()}},
			"spec":     map[string]any{"paused": false},
		})
		op := shown.DeepCopy()
		err := c.Patch(ctx, op, client.RawPatch(types.MergePatchType, patch), client.FieldOwner(FieldManager))
		if !apierrors.IsConflict(err) {
			return op, false, err
		}
		latest, err := getOperation(ctx, c, shown.Namespace, shown.Name)
		if err != nil {
			return nil, false, err
		}
		now, err := planText(latest)
		if err != nil {
			return nil, false, err
		}
		if now != text || !awaitsApproval(latest) {
			return latest, true, nil
		}
		shown = latest
	}
}

// awaitsApproval reports whether the operation waits for a person to run
// its plan: created paused to be planned (--plan), or held because its
// plan changed since it was approved.
func awaitsApproval(op *ichorv1.TalosOperation) bool {
	return op.Status.StartTime == nil && (op.PausedByOperator() || op.PlanChanged())
}
