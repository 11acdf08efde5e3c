package v1alpha1_test

import (
	"context"
	"reflect"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestMachineEntriesAreNotWalked checks that the installed CRD leaves the
// machine entries to the controller: no schema under status.machines for
// the API server to check, prune and default, entry by entry, on every
// write (what made a status write of 1,000 machines twice as slow; see
// the field's comment).
func TestMachineEntriesAreNotWalked(t *testing.T) {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(apiextensionsv1.SchemeGroupVersion.WithKind("CustomResourceDefinition"))
	if err := env.Client.Get(context.Background(), keyOf("", "talosoperations.ichor.maesh.dev"), u); err != nil {
		t.Fatal(err)
	}
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, crd); err != nil {
		t.Fatal(err)
	}
	machines := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties["machines"]
	if machines.XPreserveUnknownFields == nil || !*machines.XPreserveUnknownFields {
		t.Error("status.machines does not preserve unknown fields: the API server would prune the entries")
	}
	if machines.Items != nil || len(machines.Properties) > 0 {
		t.Errorf("status.machines declares a schema for its entries (items %v, properties %d): the API server walks every entry on every write", machines.Items != nil, len(machines.Properties))
	}
}

// TestMachineEntryRoundTrips writes an entry with every field set through
// the status subresource and reads back the same entry: with no schema
// under status.machines, nothing of it is lost or changed on the way.
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
