package operation

import (
	"errors"
	"fmt"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestOwnWritesLatest(t *testing.T) {
	at := func(uid types.UID, rv, message string) *ichorv1.TalosOperation {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: uid, ResourceVersion: rv}}
		op.Status.Message = message
		return op
	}
	tests := []struct {
		name   string
		writes [][2]string // the version replaced, the version written
		cached *ichorv1.TalosOperation
		want   string // the version the turn works from
		// then is the version a turn works from when the cache shows
		// the first replaced version again afterwards: remembered or not.
		then string
	}{
		{"nothing written", nil, at("a", "1", ""), "1", "1"},
		{"the cache shows the version the write replaced", [][2]string{{"1", "2"}}, at("a", "1", ""), "2", "2"},
		{"the cache shows a version of two writes ago", [][2]string{{"1", "2"}, {"2", "3"}}, at("a", "1", ""), "3", "3"},
		{"the cache caught up: forgotten", [][2]string{{"1", "2"}}, at("a", "2", ""), "2", "1"},
		{"someone else wrote after: theirs, forgotten", [][2]string{{"1", "2"}}, at("a", "7", ""), "7", "1"},
		{"another operation's write", [][2]string{{"1", "2"}}, at("b", "1", ""), "1", "1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var w ownWrites
			for _, wr := range tt.writes {
				w.wrote(wr[0], at("a", wr[1], "written"))
			}
			got := w.latest(tt.cached)
			if got.ResourceVersion != tt.want {
				t.Fatalf("works from version %s, want %s", got.ResourceVersion, tt.want)
			}
			if got.ResourceVersion != tt.cached.ResourceVersion {
				got.Status.Message = "changed by the turn"
				if again := w.latest(tt.cached); again.Status.Message != "written" {
					t.Errorf("a turn's change reached the remembered write: %q", again.Status.Message)
				}
			}
			if again := w.latest(at(tt.cached.UID, "1", "")); again.ResourceVersion != tt.then {
				t.Errorf("afterwards, a cache at version 1 gives version %s, want %s", again.ResourceVersion, tt.then)
			}
		})
	}
}

// TestOwnWritesFailed: after a write ends in a conflict, the cache is
// trusted again, even showing a version this controller replaced (an etcd
// restore rewinds the store); another failure forgets nothing.
func TestOwnWritesFailed(t *testing.T) {
	conflict := apierrors.NewConflict(schema.GroupResource{Group: ichorv1.GroupVersion.Group, Resource: "talosoperations"}, "op", errors.New("changed"))
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"a conflict", conflict, "1"},
		{"a wrapped conflict", fmt.Errorf("write status: %w", conflict), "1"},
		{"another error", errors.New("connection refused"), "2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var w ownWrites
			written := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: "a", ResourceVersion: "2"}}
			w.wrote("1", written)
			w.failed("a", tt.err)
			got := w.latest(&ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: "a", ResourceVersion: "1"}})
			if got.ResourceVersion != tt.want {
				t.Errorf("works from version %s, want %s", got.ResourceVersion, tt.want)
			}
		})
	}
}
