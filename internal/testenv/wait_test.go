package testenv

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// fatalRecorder is a testing.TB whose Fatalf records the message and ends
// the goroutine, as testing's does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// eventually runs Eventually with r and returns what it failed with ("" if
// it returned).
func eventually(t *testing.T, timeout time.Duration, cond func(context.Context) (bool, error)) string {
	r := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Eventually(r, timeout, "the thing", cond)
	}()
	<-done
	return r.msg
}

// TestEventually: a condition's error fails the test at once, as the
// deadline does.
func TestEventually(t *testing.T) {
	boom := errors.New("boom")
	for _, tt := range []struct {
		name    string
		timeout time.Duration
		cond    func(n int) (bool, error)
		want    string
		looks   int // how many times cond is asked; 0: any
	}{
		{"true at once", time.Minute, func(int) (bool, error) { return true, nil }, "", 1},
		{"true on the third look", time.Minute, func(n int) (bool, error) { return n == 3, nil }, "", 3},
		{"an error fails at once", 10 * time.Second, func(int) (bool, error) { return false, boom }, "waiting for the thing: boom", 1},
		{"an error on the third look", 10 * time.Second, func(n int) (bool, error) {
			if n == 3 {
				return false, boom
			}
			return false, nil
		}, "waiting for the thing: boom", 3},
		{"an error with true", 10 * time.Second, func(int) (bool, error) { return true, boom }, "waiting for the thing: boom", 1},
		{"never true", 100 * time.Millisecond, func(int) (bool, error) { return false, nil }, "timed out after 100ms waiting for the thing", 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			n := 0
			got := eventually(t, tt.timeout, func(context.Context) (bool, error) { n++; return tt.cond(n) })
			if got != tt.want || tt.looks != 0 && n != tt.looks {
				t.Errorf("failed with %q after %d looks, want %q after %d", got, n, tt.want, tt.looks)
			}
		})
	}
}

// TestPollBackoff: Eventually polls every 20ms at first, then less often,
// never less often than every 100ms.
func TestPollBackoff(t *testing.T) {
	next := pollBackoff().DelayFunc()
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	for i, want := range []time.Duration{ms(20), ms(30), ms(45), ms(67.5), ms(100), ms(100), ms(100)} {
		if got := next(); got != want {
			t.Fatalf("wait %d: %s, want %s", i, got, want)
		}
	}
}
