package operation_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

const controllerSA = "system:serviceaccount:ichor-system:ichor-controller"

// TestControllerRBAC runs the controller as its ServiceAccount with exactly
// the RBAC of manifests/, through a Talos upgrade that drains a pod, a Talos
// CA rotation and a node action: least privilege is enough. And it reads
// no other Secret.
func TestControllerRBAC(t *testing.T) {
	ctx := context.Background()
	// --force-conflicts: TestIchorUpgradeThroughInstaller applies the same
	// manifests as the installer Job (its own field manager) on this API server.
	if _, _, err := env.Kubectl(ctx, nil, "apply", "--server-side", "--force-conflicts", "-k", filepath.Join(env.Root, "manifests")); err != nil {
		t.Fatal(err)
	}
	c := newClusterIn(t, sim.Cluster("", 1, 2), ichorv1.DefaultNamespace)
	c.writeTalosconfig()
	t.Cleanup(func() {
		_ = env.Client.Delete(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: ichorv1.TalosconfigSecret}})
	})
	w1 := c.fleet.Machines()[1].Name()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "app"}, Spec: corev1.PodSpec{
		NodeName: w1, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}
	if err := env.Client.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	c.start(as(controllerSA, "system:serviceaccounts", "system:serviceaccounts:ichor-system", "system:authenticated"), withLeaderElection())
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitSucceeded("upgrade", 2*time.Minute)
	if err := env.Client.Get(ctx, keyOf(c.ns, "app"), &corev1.Pod{}); !notFound(err) {
		t.Errorf("the pod on %s was not drained: %v", w1, err)
	}
	// A Talos CA rotation: its Secret, and ichor-talosconfig replaced.
	c.create("rotate-ca", caSpec())
	c.waitSucceeded("rotate-ca", 2*time.Minute)

	checkControllerCan(t, []canI{
		{[]string{"get", "secrets", "-n", "kube-system"}, "no"},
		{[]string{"get", "secrets/other", "-n", ichorv1.DefaultNamespace}, "no"},
		{[]string{"get", "secrets/" + ichorv1.TalosconfigSecret, "-n", ichorv1.DefaultNamespace}, "yes"},
		{[]string{"update", "secrets/" + ichorv1.TalosconfigSecret, "-n", ichorv1.DefaultNamespace}, "yes"},
		{[]string{"update", "secrets/other", "-n", ichorv1.DefaultNamespace}, "no"},
		{[]string{"get", "secrets/" + executor.CARotationSecret, "-n", ichorv1.DefaultNamespace}, "yes"},
		{[]string{"delete", "secrets/" + executor.KubernetesCARotationSecret, "-n", ichorv1.DefaultNamespace}, "yes"},
		{[]string{"create", "secrets", "-n", "kube-system"}, "no"},
		{[]string{"create", "leases", "-n", "kube-system"}, "no"},
		{[]string{"update", "leases", "-n", ichorv1.DefaultNamespace}, "yes"},
		{[]string{"delete", "nodes"}, "no"},
		// The write-back of an etcd restore (manifests/policies/writeback.yaml
		// allows no other create; manifests' tests hold it to that).
		{[]string{"create", "talosoperations"}, "yes"},
		{[]string{"delete", "talosoperations"}, "no"},
	})
}

// TestKubernetesRBAC runs a Kubernetes upgrade with the controller as its
// ServiceAccount and exactly the RBAC of manifests/: the bootstrap-manifests
// stage server-side-applies what Talos renders (kube-proxy's DaemonSet,
// ServiceAccount and ClusterRoleBinding to system:node-proxier, CoreDNS's
// Deployment, Service, ConfigMap, ServiceAccount, ClusterRole and its
// binding) and writes Talos's inventory, and kube-proxy rolls to the new
// image. It may do that and no more: no other DaemonSet, no Secret, no
// escalate, no bind of another role.
func TestKubernetesRBAC(t *testing.T) {
	ctx := context.Background()
	c := newShippedRBACCluster(t)
	c.start(as(controllerSA, "system:serviceaccounts", "system:serviceaccounts:ichor-system", "system:authenticated"), withLeaderElection())
	const to = "v1.35.1"
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}})
	c.waitSucceeded("k8s", 3*time.Minute)
	checkKubeProxyRolled(t, "registry.k8s.io/kube-proxy:"+to, 2, 2)
	for _, name := range []string{"kube-proxy", "system:coredns"} {
		crb := &rbacv1.ClusterRoleBinding{}
		if err := env.Client.Get(ctx, keyOf("", name), crb); err != nil || crb.Annotations[inventory.OwningAnnotation] != inventory.Name {
			t.Errorf("ClusterRoleBinding %s was not applied by the sync (%v): annotations %v", name, err, crb.Annotations)
		}
	}

	checkControllerCan(t, []canI{
		{[]string{"patch", "daemonsets/kube-proxy", "-n", "kube-system"}, "yes"},
		{[]string{"patch", "daemonsets/other", "-n", "kube-system"}, "no"},
		{[]string{"patch", "deployments/coredns", "-n", "default"}, "no"},
		{[]string{"get", "secrets", "-n", "kube-system"}, "no"},
		{[]string{"bind", "clusterroles/system:node-proxier"}, "yes"},
		{[]string{"bind", "clusterroles/cluster-admin"}, "no"},
		{[]string{"escalate", "clusterroles/system:coredns"}, "no"},
		{[]string{"patch", "clusterrolebindings/cluster-admin"}, "no"},
	})
}

// TestKubernetesRBACCheckedFirst: a bootstrap manifest the shipped RBAC
// does not name (an inline manifest's ConfigMap) refuses the upgrade before
// anything moves, naming the object, the verbs it lacks and what to do;
// once the controller is granted them, the same upgrade syncs the manifest.
func TestKubernetesRBACCheckedFirst(t *testing.T) {
	ctx := context.Background()
	c := newShippedRBACCluster(t)
	cp := c.fleet.ControlPlanes()[0]
	const extra = "ichor-test-extra"
	applyNoReboot(t, c.fleet, cp, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterInlineManifests = v1alpha1.ClusterInlineManifests{{InlineManifestName: "extra",
			InlineManifestContents: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: " + extra + ", namespace: " + c.ns + "}\ndata: {a: b}\n"}}
	})
	tc := adminTalos(t, c.fleet)
	testenv.Eventually(t, 30*time.Second, "Talos to render the inline manifest", func(context.Context) (bool, error) {
		_, err := safe.StateGetByID[*k8s.Manifest](talosclient.WithNode(ctx, cp.Address()), tc.COSI, "99-extra")
		return err == nil, nil
	})
	c.start(as(controllerSA, "system:serviceaccounts", "system:serviceaccounts:ichor-system", "system:authenticated"), withLeaderElection())
	const to = "v1.35.1"
	k8sSpec := ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}}
	c.create("k8s", k8sSpec)
	op := c.waitFor("k8s", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
	cond := meta.FindStatusCondition(op.Status.Conditions, operation.CheckActionAllowed)
	want := fmt.Sprintf("ConfigMap %s/%s (get, patch, create)", c.ns, extra)
	if cond == nil || !strings.Contains(cond.Message, want) || !strings.Contains(cond.Message, cp.Name()) || !strings.Contains(cond.Message, "grant the controller's ServiceAccount") {
		t.Fatalf("condition %s = %+v, want a message naming %s and %q and what to do", operation.CheckActionAllowed, cond, cp.Name(), want)
	}
	for _, call := range []string{"ApplyConfiguration", "ImagePull"} {
		if n := c.fleet.Recorder().Calls("", call); n > 1 || (n == 1 && call != "ApplyConfiguration") { // the test's own apply
			t.Errorf("a refused operation called %s %d times", call, n)
		}
	}

	// Granted by name, the same upgrade syncs it.
	grant := []client.Object{
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: extra}, Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""}, Resources: []string{"configmaps"}, ResourceNames: []string{extra}, Verbs: []string{"get", "patch", "create"}}}},
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: extra},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: extra},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ichorv1.DefaultNamespace, Name: "ichor-controller"}}},
	}
	for _, o := range grant {
		c.createObject(o)
	}
	c.create("k8s-granted", k8sSpec)
	c.waitSucceeded("k8s-granted", 3*time.Minute)
	cm := &corev1.ConfigMap{}
	if err := env.Client.Get(ctx, keyOf(c.ns, extra), cm); err != nil || cm.Data["a"] != "b" {
		t.Errorf("the inline manifest's ConfigMap after the sync: %v %v", err, cm.Data)
	}
}

// newShippedRBACCluster is a control plane and a worker running
// kube-proxy 1.35.0, with the shipped manifests (RBAC included) applied and
// the talosconfig in the controller's namespace, for a controller started
// as its ServiceAccount.
func newShippedRBACCluster(t *testing.T) *cluster {
	t.Helper()
	if _, _, err := env.Kubectl(context.Background(), nil, "apply", "--server-side", "--force-conflicts", "-k", filepath.Join(env.Root, "manifests")); err != nil {
		t.Fatal(err)
	}
	spec := sim.Cluster("", 1, 1)
	spec.KubeProxy = true
	c := newClusterIn(t, spec, ichorv1.DefaultNamespace)
	c.writeTalosconfig()
	t.Cleanup(func() {
		removeBootstrapManifests(t)
		_ = env.Client.Delete(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ichorv1.DefaultNamespace, Name: ichorv1.TalosconfigSecret}})
	})
	waitKubeProxy(t, "registry.k8s.io/kube-proxy:v1.35.0", 2)
	return c
}

// canI is a question to `kubectl auth can-i` about the controller's
// ServiceAccount (a verb and a resource, maybe -n), and the answer wanted.
type canI struct {
	args []string
	want string
}

func checkControllerCan(t *testing.T, questions []canI) {
	t.Helper()
	for _, q := range questions {
		out, _, _ := env.Kubectl(context.Background(), nil, append([]string{"auth", "can-i", "--as", controllerSA}, q.args...)...)
		if got := strings.TrimSpace(out); got != q.want {
			t.Errorf("can the controller %s? %q, want %q", strings.Join(q.args, " "), got, q.want)
		}
	}
}
