// Package manifests_test installs the kustomize base with the real kubectl
// into a real API server and checks who may do what: the ClusterRoles, their
// aggregation into the built-in roles, and the ValidatingAdmissionPolicies
// that guard the dangerous kinds and spec.override. Every request is made by
// a user of its own (a client certificate), bound to one role.
package manifests_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) {
	// The controller manager aggregates ClusterRoles into admin, edit and view.
	os.Exit(testenv.Main(m, &env, testenv.With(testenv.Components{ControllerManager: true}), install))
}

// install applies the kustomize base as a user would (`kubectl apply -k
// manifests`).
func install(e *testenv.Env) error {
	_, _, err := e.Kubectl(context.Background(), nil, "apply", "--server-side", "--force-conflicts", "-k", e.Root+"/manifests")
	return err
}

// The users of the tests, each bound to one role.
const (
	admin      = "alice-ichor-admin"    // ichor-admin, ClusterRoleBinding
	nsAdmin    = "nadia-ns-ichor-admin" // ichor-admin, RoleBinding in the test's namespace
	operator   = "oscar-ichor-operator" // ichor-operator, ClusterRoleBinding
	viewer     = "victor-ichor-viewer"  // ichor-viewer, ClusterRoleBinding
	kubeAdmin  = "ada-admin"            // built-in admin, RoleBinding
	kubeEdit   = "eddie-edit"           // built-in edit, RoleBinding
	kubeView   = "vera-view"            // built-in view, RoleBinding
	nobody     = "nora-nobody"          // no role
	controller = "system:serviceaccount:ichor-system:ichor-controller"
)

// setup binds every user in a fresh namespace and returns it.
func setup(t *testing.T) string {
	t.Helper()
	ns := env.Namespace(t)
	ctx := context.Background()
	clusterBind := map[string]string{admin: "ichor-admin", operator: "ichor-operator", viewer: "ichor-viewer"}
	for user, role := range clusterBind {
		crb := &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + user},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}},
		}
		if err := env.Client.Create(ctx, crb); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = env.Client.Delete(ctx, crb) })
	}
	nsBind := map[string]string{nsAdmin: "ichor-admin", kubeAdmin: "admin", kubeEdit: "edit", kubeView: "view"}
	for user, role := range nsBind {
		rb := &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: user, Namespace: ns},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}},
		}
		if err := env.Client.Create(ctx, rb); err != nil {
			t.Fatal(err)
		}
	}
	// What ichor-controller does to operations: update them (finalizer,
	// retry annotation) and their status. It holds neither start nor override.
	ctrlRole := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "controller", Namespace: ns},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{ichorv1.GroupVersion.Group},
			Resources: []string{"talosoperations", "talosoperations/status"},
			Verbs:     []string{"get", "list", "watch", "update", "patch"},
		}},
	}
	ctrlBinding := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "controller", Namespace: ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "controller"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "ichor-controller", Namespace: "ichor-system"}},
	}
	for _, obj := range []client.Object{ctrlRole, ctrlBinding} {
		if err := env.Client.Create(ctx, obj); err != nil {
			t.Fatal(err)
		}
	}
	waitForPolicies(t, ns)
	waitForAggregation(t)
	return ns
}

var clients = map[string]client.Client{}

// as is a client that authenticates as the user.
func as(t *testing.T, user string) client.Client {
	t.Helper()
	if c, ok := clients[user]; ok {
		return c
	}
	var groups []string
	if strings.HasPrefix(user, "system:serviceaccount:") {
		groups = []string{"system:serviceaccounts", "system:serviceaccounts:ichor-system"}
	}
	cfg, err := env.User(user, groups...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	clients[user] = c
	return c
}

// waitForPolicies waits until the API server has loaded the policies and the
// bindings of the namespace: an operator's dry run of a ca-rotation is refused.
func waitForPolicies(t *testing.T, ns string) {
	t.Helper()
	c := as(t, operator)
	testenv.Eventually(t, 30*time.Second, "the admission policies to be enforced", func(ctx context.Context) (bool, error) {
		op := operation(ns, "probe-start", kind{k: ichorv1.KindCARotation})
		err := c.Create(ctx, op, client.DryRunAll)
		if err == nil {
			return false, nil
		}
		if strings.Contains(err.Error(), "ValidatingAdmissionPolicy 'ichor-start'") {
			return true, nil
		}
		return false, err // refused by something else
	})
	testenv.Eventually(t, 30*time.Second, "the override policy to be enforced", func(ctx context.Context) (bool, error) {
		op := operation(ns, "probe-override", kind{k: ichorv1.KindTalos})
		op.Spec.Override = true
		err := c.Create(ctx, op, client.DryRunAll)
		if err == nil {
			return false, nil
		}
		if strings.Contains(err.Error(), "ValidatingAdmissionPolicy 'ichor-override'") {
			return true, nil
		}
		return false, err // refused by something else
	})
}

// kind is a kind, with the node action for kind node.
type kind struct {
	k      ichorv1.OperationKind
	action ichorv1.NodeActionType
}

func (k kind) String() string {
	if k.action != "" {
		return string(k.k) + "-" + string(k.action)
	}
	return string(k.k)
}

var allKinds = []kind{
	{k: ichorv1.KindTalos}, {k: ichorv1.KindKubernetes}, {k: ichorv1.KindIchor}, {k: ichorv1.KindCNI},
	{k: ichorv1.KindConfig}, {k: ichorv1.KindNode, action: ichorv1.NodeReboot}, {k: ichorv1.KindNode, action: ichorv1.NodeReset},
	{k: ichorv1.KindShutdown}, {k: ichorv1.KindCARotation}, {k: ichorv1.KindKeyRotation}, {k: ichorv1.KindEtcdRestore},
}

// operation is a valid operation of the kind.
func operation(ns, name string, k kind) *ichorv1.TalosOperation {
	op := &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       ichorv1.TalosOperationSpec{Kind: k.k},
	}
	s := &op.Spec
	switch k.k {
	case ichorv1.KindTalos:
		s.Talos = &ichorv1.TalosUpgrade{Version: "v1.13.7"}
	case ichorv1.KindKubernetes:
		s.Kubernetes = &ichorv1.KubernetesUpgrade{Version: "v1.36.2"}
	case ichorv1.KindIchor:
		s.Ichor = &ichorv1.IchorUpgrade{Version: "v0.2.0"}
	case ichorv1.KindCNI:
		s.CNI = &ichorv1.CNIChange{KubeProxyReplacement: ptr.To(true)}
	case ichorv1.KindConfig:
		s.Config = &ichorv1.ConfigRollout{Patches: []string{"machine: {}"}}
	case ichorv1.KindNode:
		s.Node = &ichorv1.NodeAction{Machine: "w-1", Action: k.action}
	case ichorv1.KindShutdown:
		s.Shutdown = &ichorv1.ClusterShutdown{}
	case ichorv1.KindCARotation:
		s.CARotation = &ichorv1.CARotation{}
	case ichorv1.KindKeyRotation:
		s.KeyRotation = &ichorv1.KeyRotation{}
	case ichorv1.KindEtcdRestore:
		s.EtcdRestore = &ichorv1.EtcdRestore{Snapshot: "file:///var/lib/etcd-backup/snap.db"}
	}
	return op
}

// The denials the policies give, word for word.
func startDenial(k kind) string {
	what := string(k.k)
	if k.k == ichorv1.KindNode {
		what += " with action reset"
	}
	return `ValidatingAdmissionPolicy 'ichor-start' with binding 'ichor-start' denied request: creating a talosoperation of kind ` +
		what + ` needs verb "start" on "talosoperations/` + string(k.k) + `" in group ichor.maesh.dev; ask an ichor-admin`
}

const overrideDenial = `ValidatingAdmissionPolicy 'ichor-override' with binding 'ichor-override' denied request: ` +
	`setting spec.override to true needs verb "override" on "talosoperations" in group ichor.maesh.dev; ask an ichor-admin`

// outcome is what a request should come to.
type outcome int

const (
	allowed      outcome = iota
	deniedPolicy         // refused by an admission policy, with its message
	forbidden            // refused by RBAC before admission
)

func expect(t *testing.T, what string, err error, want outcome, denial string) {
	t.Helper()
	switch want {
	case allowed:
		if err != nil {
			t.Errorf("%s: want allowed, got %v", what, err)
		}
	case deniedPolicy:
		if !apierrors.IsForbidden(err) || !strings.HasSuffix(err.Error(), denial) {
			t.Errorf("%s: want the denial\n  %s\ngot\n  %v", what, denial, err)
		}
	case forbidden:
		if !apierrors.IsForbidden(err) || strings.Contains(err.Error(), "ValidatingAdmissionPolicy") {
			t.Errorf("%s: want RBAC to forbid it, got %v", what, err)
		}
	}
}

// Who may create which kind.
func TestCreateMatrix(t *testing.T) {
	ns := setup(t)
	ctx := context.Background()
	mayStartAll := map[string]bool{admin: true, nsAdmin: true}
	mayCreate := map[string]bool{admin: true, nsAdmin: true, operator: true, kubeAdmin: true, kubeEdit: true}
	for _, user := range []string{admin, nsAdmin, operator, viewer, kubeAdmin, kubeEdit, kubeView, nobody} {
		for _, k := range allKinds {
			name := fmt.Sprintf("%s-%s", strings.SplitN(user, "-", 2)[0], k)
			err := as(t, user).Create(ctx, operation(ns, name, k))
			dangerous := ichorv1.DangerousKind(k.k, k.action)
			want := allowed
			switch {
			case !mayCreate[user]:
				want = forbidden
			case dangerous && !mayStartAll[user]:
				want = deniedPolicy
			}
			expect(t, user+" creates "+k.String(), err, want, startDenial(k))
		}
	}
}

// Who may set spec.override, on create and by an update from false.
func TestOverrideMatrix(t *testing.T) {
	ns := setup(t)
	ctx := context.Background()
	for _, tt := range []struct {
		user string
		want outcome
	}{
		{admin, allowed}, {nsAdmin, allowed},
		{operator, deniedPolicy}, {kubeAdmin, deniedPolicy}, {kubeEdit, deniedPolicy},
		{viewer, forbidden}, {kubeView, forbidden}, {nobody, forbidden},
	} {
		short := strings.SplitN(tt.user, "-", 2)[0]
		op := operation(ns, short+"-create", kind{k: ichorv1.KindTalos})
		op.Spec.Override = true
		expect(t, tt.user+" creates with override", as(t, tt.user).Create(ctx, op), tt.want, overrideDenial)

		// An operation without override, created by the admin, that the user then tries to override.
		op = operation(ns, short+"-update", kind{k: ichorv1.KindKubernetes})
		if err := as(t, admin).Create(ctx, op); err != nil {
			t.Fatal(err)
		}
		patch := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"override":true}}`))
		expect(t, tt.user+" sets override by a patch", as(t, tt.user).Patch(ctx, op, patch), tt.want, overrideDenial)

		// And by an update (PUT) of the whole object.
		fresh := &ichorv1.TalosOperation{}
		if err := env.Client.Get(ctx, client.ObjectKeyFromObject(op), fresh); err != nil {
			t.Fatal(err)
		}
		if fresh.Spec.Override {
			continue // the patch was allowed
		}
		fresh.Spec.Override = true
		expect(t, tt.user+" sets override by an update", as(t, tt.user).Update(ctx, fresh), tt.want, overrideDenial)
	}
}

// Updates that start nothing new are never denied: pausing, resuming,
// retrying, skipping a machine and relabelling an operation whose override is already true or
// whose kind is dangerous, and clearing override.
func TestUnrelatedUpdatesAreAllowed(t *testing.T) {
	ns := setup(t)
	ctx := context.Background()
	for _, k := range []kind{{k: ichorv1.KindCARotation}, {k: ichorv1.KindNode, action: ichorv1.NodeReset}, {k: ichorv1.KindTalos}} {
		op := operation(ns, "overridden-"+k.String(), k)
		op.Spec.Override = true
		if err := as(t, admin).Create(ctx, op); err != nil {
			t.Fatal(err)
		}
		for _, p := range []struct{ what, patch string }{
			{"pause", `{"spec":{"paused":true}}`},
			{"resume", `{"spec":{"paused":false}}`},
			{"retry", `{"metadata":{"annotations":{"ichor.maesh.dev/retry":"true"}}}`},
			{"skip", `{"metadata":{"annotations":{"ichor.maesh.dev/skip":"w-1","ichor.maesh.dev/skip-by":"bob","ichor.maesh.dev/skip-uncordon":"true"}}}`},
			{"label", `{"metadata":{"labels":{"team":"infra"}}}`},
			{"clear override", `{"spec":{"override":false}}`},
		} {
			err := as(t, operator).Patch(ctx, op, client.RawPatch(types.MergePatchType, []byte(p.patch)))
			expect(t, "operator: "+p.what+" of "+k.String(), err, allowed, "")
		}
	}
}

// A Pending operation's spec may still change, but not into a dangerous
// kind without start: a reboot turned into a reset is refused.
func TestChangingIntoADangerousKind(t *testing.T) {
	ns := setup(t)
	ctx := context.Background()
	op := operation(ns, "reboot", kind{k: ichorv1.KindNode, action: ichorv1.NodeReboot})
	if err := as(t, operator).Create(ctx, op); err != nil {
		t.Fatal(err)
	}
	reset := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"node":{"action":"reset"}}}`))
	want := `ValidatingAdmissionPolicy 'ichor-start' with binding 'ichor-start' denied request: changing a talosoperation to kind node with action reset ` +
		`needs verb "start" on "talosoperations/node" in group ichor.maesh.dev; ask an ichor-admin`
	expect(t, "operator turns a reboot into a reset", as(t, operator).Patch(ctx, op, reset), deniedPolicy, want)
	expect(t, "admin turns a reboot into a reset", as(t, admin).Patch(ctx, op, reset), allowed, "")

	op2 := operation(ns, "cni", kind{k: ichorv1.KindCNI})
	if err := as(t, operator).Create(ctx, op2); err != nil {
		t.Fatal(err)
	}
	toShutdown := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"kind":"shutdown","cni":null,"shutdown":{}}}`))
	want = `ValidatingAdmissionPolicy 'ichor-start' with binding 'ichor-start' denied request: changing a talosoperation to kind shutdown ` +
		`needs verb "start" on "talosoperations/shutdown" in group ichor.maesh.dev; ask an ichor-admin`
	expect(t, "operator turns a cni change into a shutdown", as(t, operator).Patch(ctx, op2, toShutdown), deniedPolicy, want)
}

// ichor-controller holds neither start nor override, and is never blocked
// writing status or updating operations of dangerous kinds with override
// set, nor writing an etcd restore back; it creates nothing else.
func TestControllerIsNeverBlocked(t *testing.T) {
	ns := setup(t)
	ctx := context.Background()
	op := operation(ns, "rotation", kind{k: ichorv1.KindCARotation})
	op.Spec.Override = true
	if err := as(t, admin).Create(ctx, op); err != nil {
		t.Fatal(err)
	}
	c := as(t, controller)
	got := &ichorv1.TalosOperation{}
	if err := c.Get(ctx, client.ObjectKeyFromObject(op), got); err != nil {
		t.Fatal(err)
	}
	got.Status.Phase = ichorv1.PhaseRunning
	got.Status.Message = "rotating the Kubernetes CA"
	expect(t, "controller writes status", c.Status().Update(ctx, got), allowed, "")
	got.Finalizers = append(got.Finalizers, ichorv1.Finalizer)
	expect(t, "controller adds its finalizer", c.Update(ctx, got), allowed, "")
	got.Finalizers = nil
	expect(t, "controller removes its finalizer", c.Update(ctx, got), allowed, "")
	// It creates nothing but the write-back of an etcd restore: its
	// role grants create, ichor-write-back holds it to that.
	expect(t, "controller creates an operation", c.Create(ctx, operation(ns, "x", kind{k: ichorv1.KindTalos})), deniedPolicy, writeBackDenial)
	unpaused := writeBack(ns, "restore-unpaused")
	unpaused.Spec.Paused = false
	expect(t, "controller creates an unpaused etcd restore", c.Create(ctx, unpaused), deniedPolicy, writeBackDenial)
	unmarked := writeBack(ns, "restore-unmarked")
	unmarked.Annotations = nil
	expect(t, "controller creates an etcd restore without the annotation", c.Create(ctx, unmarked), deniedPolicy, writeBackDenial)
	// The write-back itself needs neither start nor override of its own:
	// it repeats what an ichor-admin asked for.
	expect(t, "controller writes an etcd restore back", c.Create(ctx, writeBack(ns, "restore")), allowed, "")
	// Anyone else's write-back is a create like any other.
	forged := writeBack(ns, "restore-2")
	forged.Spec.Override = false
	expect(t, "operator creates a write-back", as(t, operator).Create(ctx, forged), deniedPolicy, startDenial(kind{k: ichorv1.KindEtcdRestore}))
}

const writeBackDenial = `ValidatingAdmissionPolicy 'ichor-write-back' with binding 'ichor-write-back' denied request: ` +
	`ichor-controller creates only the write-back of an etcd restore (kind etcd-restore, paused, annotation ichor.maesh.dev/restored-from-journal)`

// writeBack is an etcd restore as ichor-controller writes it back after the
// rewind: paused, annotated, with the override its admin set.
func writeBack(ns, name string) *ichorv1.TalosOperation {
	op := operation(ns, name, kind{k: ichorv1.KindEtcdRestore})
	op.Annotations = map[string]string{ichorv1.RestoredFromAnnotation: "0b5e7a9e-0000-4000-8000-000000000001"}
	op.Spec.Paused, op.Spec.Override = true, true
	return op
}

// The denial reaches a kubectl user as it is.
func TestKubectlShowsTheDenial(t *testing.T) {
	ns := setup(t)
	kubeconfig, err := env.UserKubeconfig(operator)
	if err != nil {
		t.Fatal(err)
	}
	manifest := `apiVersion: ichor.maesh.dev/v1alpha1
kind: TalosOperation
metadata:
  name: rotate
  namespace: ` + ns + `
spec:
  kind: key-rotation
  keyRotation: {}
`
	path := t.TempDir() + "/op.yaml"
	if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	_, stderr, err := testenv.RunKubectl(context.Background(), kubeconfig, nil, "create", "-f", path)
	want := `Error from server (Forbidden): error when creating "` + path + `": talosoperations.ichor.maesh.dev "rotate" is forbidden: ` +
		startDenial(kind{k: ichorv1.KindKeyRotation})
	if err == nil || strings.TrimSpace(stderr) != want {
		t.Fatalf("kubectl create: %v\nstderr: %s\nwant:   %s", err, stderr, want)
	}
}

// builtInVerbs is what each built-in role should hold on talosoperations.
var builtInVerbs = map[string][]string{
	"view":  {"get", "list", "watch"},
	"edit":  {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
	"admin": {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
}

// waitForAggregation waits until the aggregation controller has given the
// built-in roles Ichor's rules (view into edit into admin takes a moment).
func waitForAggregation(t *testing.T) {
	t.Helper()
	for role, verbs := range builtInVerbs {
		testenv.Eventually(t, 60*time.Second, fmt.Sprintf("%s to take in Ichor's rules (%v on talosoperations)", role, verbs), func(ctx context.Context) (bool, error) {
			cr := &rbacv1.ClusterRole{}
			if err := env.Client.Get(ctx, client.ObjectKey{Name: role}, cr); err != nil {
				return false, err
			}
			got := ichorVerbs(cr.Rules, "talosoperations")
			for _, v := range verbs {
				if !slices.Contains(got, v) {
					return false, nil // not aggregated yet
				}
			}
			return true, nil
		})
	}
}

// The built-in roles take in Ichor's rules, without start or override.
func TestAggregatedBuiltInRoles(t *testing.T) {
	waitForAggregation(t)
	for role := range builtInVerbs {
		cr := &rbacv1.ClusterRole{}
		if err := env.Client.Get(context.Background(), client.ObjectKey{Name: role}, cr); err != nil {
			t.Fatal(err)
		}
		for _, r := range cr.Rules {
			if !slices.Contains(r.APIGroups, ichorv1.GroupVersion.Group) && !slices.Contains(r.APIGroups, "*") {
				continue
			}
			if slices.Contains(r.Verbs, "start") || slices.Contains(r.Verbs, "override") || slices.Contains(r.Verbs, "*") {
				t.Errorf("%s grants %v on %v", role, r.Verbs, r.Resources)
			}
		}
	}
}

func ichorVerbs(rules []rbacv1.PolicyRule, resource string) []string {
	var verbs []string
	for _, r := range rules {
		if slices.Contains(r.APIGroups, ichorv1.GroupVersion.Group) && slices.Contains(r.Resources, resource) {
			verbs = append(verbs, r.Verbs...)
		}
	}
	return verbs
}

// The three Ichor roles read the cluster lock and the leader Lease (kubectl
// ichor lock, version), and nothing else in ichor-system.
func TestRolesReadTheLeases(t *testing.T) {
	setup(t)
	ctx := context.Background()
	for _, name := range []string{ichorv1.LockLeaseName, ichorv1.LeaderLeaseName, "someone-elses"} {
		lease := &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ichorv1.DefaultNamespace},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To("ichor-controller/op/team/upgrade")},
		}
		if err := env.Client.Create(ctx, lease); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	for _, user := range []string{admin, operator, viewer} {
		c := as(t, user)
		for _, name := range []string{ichorv1.LockLeaseName, ichorv1.LeaderLeaseName} {
			lease := &coordinationv1.Lease{}
			err := c.Get(ctx, client.ObjectKey{Namespace: ichorv1.DefaultNamespace, Name: name}, lease)
			expect(t, user+" reads Lease "+name, err, allowed, "")
			if err == nil {
				lease.Spec.HolderIdentity = ptr.To("me")
				expect(t, user+" takes Lease "+name, c.Update(ctx, lease), forbidden, "")
			}
		}
		err := c.Get(ctx, client.ObjectKey{Namespace: ichorv1.DefaultNamespace, Name: "someone-elses"}, &coordinationv1.Lease{})
		expect(t, user+" reads another Lease", err, forbidden, "")
	}
	err := as(t, nobody).Get(ctx, client.ObjectKey{Namespace: ichorv1.DefaultNamespace, Name: ichorv1.LockLeaseName}, &coordinationv1.Lease{})
	expect(t, "nobody reads the lock", err, forbidden, "")
}
