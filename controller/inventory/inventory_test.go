package inventory_test

import (
	"context"
	"os"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// The keys are go-kubernetes' (fluxcd cli-utils ObjMetadata); removing
// objects leaves the others, and removing what is not there changes nothing.
func TestInventory(t *testing.T) {
	ctx := context.Background()
	if objs, err := inventory.Read(ctx, env.Client); err != nil || objs != nil {
		t.Fatalf("no inventory: %v %v", objs, err)
	}
	if err := inventory.Remove(ctx, env.Client, inventory.KubeProxy...); err != nil {
		t.Fatalf("removing from no inventory: %v", err)
	}
	coredns := inventory.Ref("apps", "Deployment", "kube-system", "coredns")
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: inventory.Namespace, Name: inventory.Name}, Data: map[string]string{
		"kube-system_kube-proxy_apps_DaemonSet":                         "",
		"kube-system_kube-proxy__ServiceAccount":                        "",
		"_kube-proxy_rbac.authorization.k8s.io_ClusterRoleBinding":      "",
		"kube-system_coredns_apps_Deployment":                           "",
		"_system__coredns_rbac.authorization.k8s.io_ClusterRoleBinding": "",
	}}
	if err := env.Client.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	tracked, err := inventory.Tracked(ctx, env.Client, append(inventory.KubeProxy, inventory.Ref("apps", "DaemonSet", "kube-system", "cilium"))...)
	if err != nil || !reflect.DeepEqual(tracked, inventory.KubeProxy) {
		t.Fatalf("tracked %v %v, want kube-proxy's objects and not cilium", tracked, err)
	}
	if err := inventory.Remove(ctx, env.Client, inventory.KubeProxy...); err != nil {
		t.Fatal(err)
	}
	objs, err := inventory.Read(ctx, env.Client)
	if err != nil {
		t.Fatal(err)
	}
	// RBAC names keep their colon, stored as a double underscore.
	crb := inventory.Ref("rbac.authorization.k8s.io", "ClusterRoleBinding", "", "system:coredns")
	if want := []inventory.Object{crb, coredns}; !reflect.DeepEqual(objs, want) {
		t.Fatalf("after removing kube-proxy: %v, want %v", objs, want)
	}
	got := &corev1.ConfigMap{}
	if err := env.Client.Get(ctx, client.ObjectKeyFromObject(cm), got); err != nil {
		t.Fatal(err)
	}
	if _, ok := got.Data["kube-system_coredns_apps_Deployment"]; !ok || len(got.Data) != 2 {
		t.Fatalf("inventory data %v", got.Data)
	}
}
