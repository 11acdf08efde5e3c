package clitest

import (
	"context"
	"os"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// createWithinOneSecond creates operations named names, in that order, in a
// fresh namespace, all with the same creationTimestamp (a second boundary
// between two creations means a new attempt in another namespace). It
// returns the namespace and the operations as created.
func createWithinOneSecond(t *testing.T, names ...string) (string, []*ichorv1.TalosOperation) {
	t.Helper()
	for range 5 {
		ns := env.Namespace(t)
		var ops []*ichorv1.TalosOperation
		for _, name := range names {
			ops = append(ops, createOp(t, ns, name))
		}
		if ops[0].CreationTimestamp.Equal(&ops[len(ops)-1].CreationTimestamp) {
			return ns, ops
		}
	}
	t.Fatalf("could not create %v within one second in 5 attempts", names)
	return "", nil
}

// TestWatchLatestWithinOneSecond follows `kubectl ichor watch --latest`
// when several operations were created within one second, which
// creationTimestamp cannot tell apart: it follows the one created last, in
// the order the controller records (the arrival revision) even after an
// older one has changed since, and before the controller has seen them
// (their resourceVersion). Ctrl-C (SIGINT to the plugin) stops following,
// says the operation keeps running and exits 130 without an error.
func TestWatchLatestWithinOneSecond(t *testing.T) {
	for _, tc := range []struct {
		name string
		// arrived records the arrival revisions as the controller does, then
		// changes the older operation, so that its resourceVersion is the
		// newest.
		arrived bool
	}{
		{name: "arrival recorded, the older changed since", arrived: true},
		{name: "not yet seen by the controller"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Names sort against the order of creation.
			ns, ops := createWithinOneSecond(t, "b-first", "a-second")
			if tc.arrived {
				for _, op := range ops {
					metav1.SetMetaDataAnnotation(&op.ObjectMeta, ichorv1.ArrivalAnnotation, op.ResourceVersion)
					if err := env.Client.Update(context.Background(), op); err != nil {
						t.Fatal(err)
					}
				}
				setStatus(t, ops[0], ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Progress: "0/1"})
			}

			p := start(t, "ichor", "watch", "--latest", "-n", ns)
			p.waitOutput(t, "a-second phase=Pending")
			if err := p.cmd.Process.Signal(os.Interrupt); err != nil {
				t.Fatal(err)
			}
			if code := p.wait(t); code != 130 {
				t.Errorf("Ctrl-C: exit %d, want 130; stderr %q", code, p.stderr())
			}
			want := "stopped following talosoperation.ichor.maesh.dev/a-second; the operation keeps running (not yet picked up by ichor-controller)\n"
			if p.stderr() != want {
				t.Errorf("Ctrl-C printed %q, want %q", p.stderr(), want)
			}
			if strings.Contains(p.stdout(), "b-first") {
				t.Errorf("watch --latest showed the older operation:\n%s", p.stdout())
			}
		})
	}
}
