package testenv

import (
	"context"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// Eventually waits until cond returns true, failing the test with what when
// the deadline passes or cond returns an error. It polls a condition with a
// deadline; it never stands in for synchronisation with a fixed sleep.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func(ctx context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var lastErr error
	err := wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		lastErr = err
		return ok, nil
	})
	if err != nil {
		if lastErr != nil {
			t.Fatalf("timed out after %s waiting for %s: %v", timeout, what, lastErr)
		}
		t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}
