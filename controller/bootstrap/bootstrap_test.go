package bootstrap_test

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/controller/bootstrap"
	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// configMap is a rendered ConfigMap, as a manifest holds it.
func configMap(ns, name, value string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"namespace": ns, "name": name},
		"data":     map[string]any{"v": value},
	}}
}

// TestSync, against the real API server: a sync creates what Talos renders
// under Talos's field manager and records it in the inventory; run again it
// changes nothing; what Talos no longer renders is pruned and leaves the
// inventory; an object of another inventory is refused, saying what to do,
// and changed not.
func TestSync(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	c := env.Client
	a, b := configMap(ns, "a", "1"), configMap(ns, "b", "1")
	res, err := bootstrap.Sync(ctx, c, []*unstructured.Unstructured{a.DeepCopy(), b.DeepCopy()})
	if err != nil || res.String() != "2 created" {
		t.Fatalf("first sync: %s, %v", res, err)
	}
	got := &corev1.ConfigMap{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "a"}, got); err != nil {
		t.Fatal(err)
	}
	if got.Annotations[inventory.OwningAnnotation] != inventory.Name || !slices.ContainsFunc(got.ManagedFields, func(f metav1.ManagedFieldsEntry) bool {
		return f.Manager == "talos" && f.Operation == metav1.ManagedFieldsOperationApply
	}) {
		t.Errorf("a: annotations %v, managers %+v", got.Annotations, got.ManagedFields)
	}
	checkTracked(t, ns, "a", "b")

	if res, err := bootstrap.Sync(ctx, c, []*unstructured.Unstructured{a.DeepCopy(), b.DeepCopy()}); err != nil || res.String() != "2 unchanged" {
		t.Errorf("the same sync again: %s, %v", res, err)
	}

	res, err = bootstrap.Sync(ctx, c, []*unstructured.Unstructured{configMap(ns, "a", "2")})
	if err != nil || res.String() != "1 configured, 1 pruned" {
		t.Errorf("a changed, b no longer rendered: %s, %v", res, err)
	}
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "b"}, &corev1.ConfigMap{}); !apierrors.IsNotFound(err) {
		t.Errorf("b was not pruned: %v", err)
	}
	checkTracked(t, ns, "a")

	other := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "c",
		Annotations: map[string]string{inventory.OwningAnnotation: "someone-else"}}, Data: map[string]string{"v": "mine"}}
	if err := c.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	_, err = bootstrap.Sync(ctx, c, []*unstructured.Unstructured{configMap(ns, "a", "2"), configMap(ns, "c", "1")})
	if err == nil || !strings.Contains(err.Error(), `ConfigMap `+ns+`/c belongs to inventory "someone-else"`) || !strings.Contains(err.Error(), "remove the annotation") {
		t.Errorf("an object of another inventory: %v", err)
	}
	if err := c.Get(ctx, client.ObjectKeyFromObject(other), other); err != nil || other.Data["v"] != "mine" {
		t.Errorf("the refused sync changed c: %v %v", other.Data, err)
	}
	checkTracked(t, ns, "a")
}

// checkTracked checks that the inventory tracks exactly the ConfigMaps
// names of namespace ns.
func checkTracked(t *testing.T, ns string, names ...string) {
	t.Helper()
	var want []inventory.Object
	for _, n := range names {
		want = append(want, inventory.Ref("", "ConfigMap", ns, n))
	}
	got, err := inventory.Read(context.Background(), env.Client)
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("the inventory tracks %v (%v), want %v", got, err, want)
	}
}
