package testenv

import (
	"context"
	"math"
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
//
// It polls at once, then every 20ms, and less often the longer it waits,
// up to every 100ms: a condition met soon is seen soon, and a long wait
// does not keep an API server busy (at 20ms a wait on an object was 50
// quorum reads a second; a CPU profile of the operation package's shared
// API server showed 9% of its time serving GETs of TalosOperations).
func Eventually(t testing.TB, timeout time.Duration, what string, cond func(ctx context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var condErr error
	err := pollBackoff().DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
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

// Receive takes a value from ch, failing the test when ctx ends first: a
// wait for something another goroutine sends, with a deadline.
func Receive[T any](t testing.TB, ctx context.Context, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-ctx.Done():
		t.Fatalf("no %s before the deadline", what)
		panic("unreachable") // Fatalf does not return
	}
}

// pollBackoff: 20ms, growing by half each poll to 100ms, where it stays.
func pollBackoff() wait.Backoff {
	return wait.Backoff{Duration: 20 * time.Millisecond, Factor: 1.5, Steps: math.MaxInt32, Cap: 100 * time.Millisecond}
}
