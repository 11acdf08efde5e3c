package testenv

import (
	"context"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// Eventually waits until cond returns true, failing the test with what when
// the deadline passes or, at once, when cond returns an error: a condition
// handles what it expects to see on the way (a NotFound before an object
// exists, say) and returns an error only for what must not happen. It
// polls a condition with a deadline; it never stands in for
// synchronisation with a fixed sleep.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func(ctx context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var condErr error
	err := wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		condErr = err
		return ok, err
	})
	switch {
	case err == nil:
	case ctx.Err() == nil: // cond's error, not the deadline's
		t.Fatalf("waiting for %s: %v", what, condErr)
	default:
		t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}
