package operation

import (
	"testing"
	"time"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestStartTimeIsWhenTheLockIsHeld: an operation starts when its turn has
// the cluster lock, not when the turn began. A turn that waited in acquire
// (a takeover reads its holder first) began before the holder it took the
// lock from completed; its start, and the machines it starts, must not
// predate that completion.
func TestStartTimeIsWhenTheLockIsHeld(t *testing.T) {
	began := time.Date(2026, 1, 2, 3, 0, 0, 900_000_000, time.UTC)
	clock := began
	r := &Reconciler{Now: func() time.Time { return clock }}
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: "ops", Name: "b-reboot", UID: "b"}}
	tn := r.newTurn(op, logr.Discard())
	// Acquire took 200 ms: the holder completed meanwhile, at 3:00:01.
	clock = began.Add(200 * time.Millisecond)
	tn.start()
	if got := tn.op.Status.StartTime; got == nil || !got.Time.Equal(clock) {
		t.Fatalf("startTime %v, want %v (when the lock was held; the turn began at %v)", got, clock, began)
	}
	// The machines the turn starts next are recorded at the turn's time.
	if !tn.now.Time.Equal(clock) {
		t.Errorf("the turn records its machines' starts at %v, before the operation's start %v", tn.now, clock)
	}
}
