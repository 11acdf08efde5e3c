package commands

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	watchtools "k8s.io/client-go/tools/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

// verdictWait is how long a create without --watch or --wait waits for
// ichor-controller to check the new operation.
const verdictWait = 5 * time.Second

// checked reports whether the controller has checked the operation and
// given its first verdict: refused, or accepted (running, waiting for the
// lock, paused).
func checked(op *ichorv1.TalosOperation) bool {
	return op.Status.Phase != "" && op.Status.Phase != ichorv1.PhasePending && op.Observed()
}

// verdict waits briefly for the controller's first verdict on an operation
// just created and says it: refused (exit 2, with what would pass), or
// accepted and how to follow it. noController says why no controller seems
// to run, if none does: then it does not wait.
func (e *Env) verdict(ctx context.Context, c client.WithWatch, op *ichorv1.TalosOperation, noController string) error {
	follow := fmt.Sprintf("follow it with: %s watch %s", e.Name, op.Name)
	if noController != "" {
		fmt.Fprintf(e.Streams.ErrOut, "%s is not checked yet: %s; %s\n", op.Name, noController, follow)
		return nil
	}
	got, err := waitFor(ctx, c, op.Namespace, op.Name, verdictWait, checked)
	switch {
	case errors.Is(err, watchtools.ErrWatchClosed) || wait.Interrupted(err):
		msg := "ichor-controller has not checked it yet"
		if got != nil && got.Status.Message != "" {
			msg += " (" + view.Clean(got.Status.Message) + ")"
		}
		fmt.Fprintf(e.Streams.ErrOut, "%s within %s; %s\n", msg, verdictWait, follow)
		return nil
	case err != nil:
		return err
	}
	if done, err := outcome(got, -1, e.Name); done && err != nil {
		return err
	}
	fmt.Fprintf(e.Streams.ErrOut, "ichor-controller checked it: %s; %s\n", acceptedWords(got, e.Name), follow)
	return nil
}

// acceptedWords say where an operation the controller accepted stands.
func acceptedWords(op *ichorv1.TalosOperation, command string) string {
	switch {
	case op.Succeeded():
		return "it has succeeded already"
	case op.PausedByOperator():
		return fmt.Sprintf("it is paused until %s operation resume %s", command, op.Name)
	case op.WaitingForLock():
		return fmt.Sprintf("it waits for the cluster lock, held by %s (see: %s lock)", view.Clean(op.Status.LockHolder), command)
	}
	return "it is running"
}

// waitFor watches one operation until cond holds, for at most timeout (0:
// no limit but ctx's). It returns the last state seen, also when it gives up.
func waitFor(ctx context.Context, c client.WithWatch, ns, name string, timeout time.Duration, cond func(*ichorv1.TalosOperation) bool) (*ichorv1.TalosOperation, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	var last *ichorv1.TalosOperation
	_, err := watchtools.UntilWithSync(ctx, operationsListWatch(c, ns, name), &ichorv1.TalosOperation{}, nil, func(ev watch.Event) (bool, error) {
		op, ok := ev.Object.(*ichorv1.TalosOperation)
		if !ok {
			return false, nil
		}
		if ev.Type == watch.Deleted {
			return false, fmt.Errorf("%s was deleted", ref(name))
		}
		last = op
		return cond(op), nil
	})
	return last, err
}
