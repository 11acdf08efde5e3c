package v1alpha1_test

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func TestQueuePlaceBefore(t *testing.T) {
	t0 := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	t1 := metav1.NewTime(t0.Add(time.Second))
	place := func(created metav1.Time, rev, name string) ichorv1.QueuePlace {
		return ichorv1.QueuePlace{Created: created, Revision: rev, Name: name}
	}
	tests := []struct {
		name string
		a, b ichorv1.QueuePlace
		want bool
	}{
		{"created earlier", place(t0, "900", "z"), place(t1, "100", "a"), true},
		{"created later", place(t1, "100", "a"), place(t0, "900", "z"), false},
		{"same second, lower revision, whatever the name", place(t0, "99", "z"), place(t0, "100", "a"), true},
		{"same second, higher revision", place(t0, "100", "a"), place(t0, "99", "z"), false},
		{"same second, a revision that cannot be compared goes after", place(t0, "", "a"), place(t0, "100", "z"), false},
		{"same second, a comparable revision goes before", place(t0, "100", "z"), place(t0, "x", "a"), true},
		{"same second, neither comparable: by name", place(t0, "", "a"), place(t0, "", "z"), true},
		{"same place", place(t0, "100", "a"), place(t0, "100", "a"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.a.Before(tt.b); got != tt.want {
				t.Errorf("%+v before %+v = %v, want %v", tt.a, tt.b, got, tt.want)
			}
		})
	}
}

func TestOperationQueuePlace(t *testing.T) {
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "a", ResourceVersion: "200"}}
	if p := op.QueuePlace(); p.Revision != "200" || p.Name != "ns/a" {
		t.Errorf("before its arrival is recorded: %+v, want its resourceVersion", p)
	}
	op.Annotations = map[string]string{ichorv1.ArrivalAnnotation: "150"}
	if p := op.QueuePlace(); p.Revision != "150" {
		t.Errorf("after: %+v, want the arrival revision", p)
	}
}

func TestLockObject(t *testing.T) {
	for _, o := range []ichorv1.LockObject{
		{Kind: ichorv1.ObjectOperation, Namespace: "ns", Name: "a"},
		{Kind: ichorv1.ObjectNode, Name: "cp-1"},
		{Kind: ichorv1.ObjectJob, Namespace: "kube-system", Name: "cilium"},
	} {
		got, err := ichorv1.ParseLockObject(o.String())
		if err != nil || got != o {
			t.Errorf("ParseLockObject(%q) = %+v %v", o.String(), got, err)
		}
	}
	for _, bad := range []string{"", "Node/", "Pod/ns/a", "TalosOperation/a", "Job/ns/a/b"} {
		if _, err := ichorv1.ParseLockObject(bad); err == nil {
			t.Errorf("ParseLockObject(%q) accepted it", bad)
		}
	}
	h, _ := ichorv1.ParseLockHolder(ichorv1.MachineIdentity("cp-1"))
	if h.Object() != (ichorv1.LockObject{Kind: ichorv1.ObjectNode, Name: "cp-1"}) {
		t.Errorf("a machine identity stands for its Node: %+v", h.Object())
	}
}
