package v1alpha1_test

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestMalformedEntryIsRefused checks that the API server refuses a status
// whose machine entry has a value of the wrong type: stored, it would stop
// the controller's informer from decoding any operation. The entries'
// schema costs about half of the API server's CPU on a write of 1,000
// machines (README, Benchmarks), and is kept for this.
func TestMalformedEntryIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	if err := env.Client.Create(ctx, newOp(ns, "malformed", valid()["talos"])); err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(ichorv1.GroupVersion.WithKind("TalosOperation"))
	if err := env.Client.Get(ctx, keyOf(ns, "malformed"), u); err != nil {
		t.Fatal(err)
	}
	entry := map[string]any{"name": "w-1", "role": "worker", "phase": "Pending", "attempts": "two"}
	if err := unstructured.SetNestedSlice(u.Object, []any{entry}, "status", "machines"); err != nil {
		t.Fatal(err)
	}
	err := env.Client.Status().Update(ctx, u)
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "status.machines[0].attempts") {
		t.Fatalf("status write with attempts \"two\": got %v, want it refused as invalid at status.machines[0].attempts", err)
	}
	got := &ichorv1.TalosOperation{}
	if err := env.Client.Get(ctx, keyOf(ns, "malformed"), got); err != nil {
		t.Fatalf("the operation no longer decodes: %v", err)
	}
}

// TestMachineEntryRoundTrips writes an entry with every field set through
// the status subresource and reads back the same entry: the CRD's schema
// declares every field, so the API server prunes none of them.
func TestMachineEntryRoundTrips(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	op := newOp(ns, "entries", valid()["talos"])
	if err := env.Client.Create(ctx, op); err != nil {
		t.Fatal(err)
	}
	at := metav1.NewTime(time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC))
	full := ichorv1.MachineStatus{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress,
		Step: "reboot", Attempts: 2, StartedAt: &at, FinishedAt: &at, From: "v1.13.2", To: "v1.13.7",
		BootID: "0b5d", Stopped: true, Calls: 1, Message: "waiting for the machine to boot"}
	// Every field is set, so that a field added later is checked too (or
	// this fails until it is set here).
	v := reflect.ValueOf(full)
	for i := range v.NumField() {
		if v.Field(i).IsZero() {
			t.Fatalf("the entry leaves %s unset: set it, so that its round trip is checked", v.Type().Field(i).Name)
		}
	}
	op.Status = ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning,
		Machines: []ichorv1.MachineStatus{full, {Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachinePending}}}
	// The write answers with the object stored, into op: compare with a copy.
	want := op.DeepCopy().Status.Machines
	if err := env.Client.Status().Update(ctx, op); err != nil {
		t.Fatal(err)
	}
	got := &ichorv1.TalosOperation{}
	if err := env.Client.Get(ctx, keyOf(ns, "entries"), got); err != nil {
		t.Fatal(err)
	}
	if !equality.Semantic.DeepEqual(got.Status.Machines, want) {
		t.Errorf("the entries read back differ:\n got %+v\nwant %+v", got.Status.Machines, want)
	}
}
