package manifests_test

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/internal/testenv"
)

// The policy ichor-secret-write-freeze refuses every write of a Secret
// (create, update, delete) while its ConfigMap exists, and nothing else;
// the controller (its own role) creates and deletes that ConfigMap; with
// the ConfigMap gone, Secret writes go through again.
func TestSecretWriteFreeze(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	c := env.Client
	kept := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "kept"}, StringData: map[string]string{"a": "b"}}
	if err := c.Create(ctx, kept); err != nil {
		t.Fatal(err)
	}
	freeze := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ichor-system", Name: "ichor-secret-write-freeze"},
		Data: map[string]string{"operation": ns + "/rotate-keys"}}
	if err := as(t, controller).Create(ctx, freeze); err != nil {
		t.Fatalf("the controller creates the freeze: %v", err)
	}
	t.Cleanup(func() { _ = c.Delete(context.Background(), freeze) })

	newSecret := func() *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "new"}}
	}
	testenv.Eventually(t, 30*time.Second, "Secret writes refused", func(ctx context.Context) (bool, error) {
		return denied(c.Create(ctx, newSecret(), client.DryRunAll)), nil
	})
	for what, write := range map[string]func() error{
		"create": func() error { return c.Create(ctx, newSecret()) },
		"update": func() error {
			k := kept.DeepCopy()
			k.Labels = map[string]string{"x": "y"}
			return c.Update(ctx, k)
		},
		"delete": func() error { return c.Delete(ctx, kept) },
	} {
		err := write()
		if !denied(err) {
			t.Errorf("%s of a Secret while frozen: %v, want the freeze's denial", what, err)
		} else if !strings.Contains(err.Error(), ns+"/rotate-keys") || !strings.Contains(err.Error(), "retry shortly") {
			t.Errorf("%s of a Secret while frozen: %q does not name the operation and say what to do", what, err)
		}
	}
	if err := c.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "other"}}); err != nil {
		t.Errorf("a ConfigMap while Secrets are frozen: %v", err)
	}

	if err := as(t, controller).Delete(ctx, freeze); err != nil {
		t.Fatalf("the controller deletes the freeze: %v", err)
	}
	testenv.Eventually(t, 30*time.Second, "Secret writes taken again", func(ctx context.Context) (bool, error) {
		err := c.Create(ctx, newSecret())
		return err == nil, client.IgnoreAlreadyExists(nilIfDenied(err))
	})
}

func denied(err error) bool {
	return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "ichor-secret-write-freeze")
}

func nilIfDenied(err error) error {
	if denied(err) {
		return nil
	}
	return err
}
