package operation_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/internal/testenv"
)

// TestAuditLogCountsTheAuditedUser: the API server's audit log, which the
// benchmarks count the controller's requests with, holds every request of
// testenv.AuditedUser once, with its verb and resource, and no other
// user's.
func TestAuditLogCountsTheAuditedUser(t *testing.T) {
	ns := env.Namespace(t)
	cfg, err := env.User(testenv.AuditedUser, "system:masters")
	if err != nil {
		t.Fatal(err)
	}
	audited, err := client.New(cfg, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	since := time.Now().Add(-time.Millisecond)
	cm := &corev1.ConfigMap{}
	cm.Namespace, cm.Name = ns, "audited"
	if err := audited.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	if err := audited.List(ctx, &corev1.ConfigMapList{}, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	// The admin's own requests are not the audited user's.
	other := &corev1.ConfigMap{}
	other.Namespace, other.Name = ns, "not-audited"
	if err := env.Client.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	if err := env.Client.Get(ctx, client.ObjectKeyFromObject(cm), &corev1.ConfigMap{}); err != nil {
		t.Fatal(err)
	}
	reqs, err := env.AuditedRequests()
	if err != nil {
		t.Fatal(err)
	}
	var got []testenv.Request
	for _, r := range reqs {
		if r.Namespace == ns && !r.At.Before(since) {
			r.At = time.Time{}
			got = append(got, r)
		}
	}
	want := []testenv.Request{
		{Verb: "create", Resource: "configmaps", Namespace: ns},
		{Verb: "list", Resource: "configmaps", Namespace: ns},
	}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("audited requests in %s: got %+v, want %+v", ns, got, want)
	}
}
