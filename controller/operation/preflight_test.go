package operation_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestPreflightRefuses: an upgrade that preflight refuses is Refused with
// the failed check in its conditions and a Warning Event, takes no lock and
// touches no machine.
func TestPreflightRefuses(t *testing.T) {
	tests := []struct {
		name, talos, kubernetes, target string
		// newest, when set, is what the last machine runs instead of talos.
		newest      string
		check, want string
	}{
		{"downgrade", "v1.12.4", "1.35.0", "v1.12.2", "", "TalosVersionNewer", "v1.12.2 is not newer"},
		{"downgrade of one machine", "v1.13.2", "1.35.0", "v1.13.7", "v1.13.9", "TalosVersionNewer",
			"older than what 1 machine(s) run (v1.13.9 on %s), and Ichor does not downgrade a machine; pick v1.13.9 or newer"},
		{"skipped minor", "v1.11.6", "1.33.0", "v1.13.7", "", "TalosMinorSkip", "v1.12.7, then v1.13.7"},
		{"pre-release", "v1.12.4", "1.35.0", "v1.13.8-beta.0", "", "TalosVersionFinal", "pre-release"},
		{"unsupported kubernetes", "v1.12.4", "1.30.0", "v1.13.7", "", "TalosKubernetesSupported", "1.30"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 1, 1)
			for i := range spec.Machines {
				spec.Machines[i].Talos, spec.Machines[i].Kubernetes = tt.talos, tt.kubernetes
			}
			if tt.newest != "" {
				spec.Machines[len(spec.Machines)-1].Talos = tt.newest
			}
			c := newCluster(t, spec)
			c.start()
			c.create("upgrade", talosSpec(tt.target))
			op := c.waitFor("upgrade", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
			cond := meta.FindStatusCondition(op.Status.Conditions, tt.check)
			want := tt.want
			if strings.Contains(want, "%s") {
				want = fmt.Sprintf(want, c.fleet.Machines()[len(spec.Machines)-1].Name())
			}
			if cond == nil || cond.Status != metav1.ConditionFalse || !strings.Contains(cond.Message, want) {
				t.Errorf("condition %s = %+v, want a message with %q; all: %+v", tt.check, cond, want, op.Status.Conditions)
			}
			// The check's text is in its condition only: the phase message,
			// the standard conditions and the Event name it.
			if !strings.HasSuffix(op.Status.Message, ichorv1.OverrideHint) || !strings.Contains(op.Status.Message, tt.check) {
				t.Errorf("the message does not name %s and end with how to run it anyway: %q", tt.check, op.Status.Message)
			}
			for _, c := range op.Status.Conditions {
				if cond != nil && c.Type != tt.check && strings.Contains(c.Message, cond.Message) {
					t.Errorf("condition %s repeats %s's message: %q", c.Type, tt.check, c.Message)
				}
			}
			if n := c.fleet.Recorder().Calls("", "*"); n != 0 {
				t.Errorf("a refused operation made %d Talos API calls: %v", n, c.fleet.Recorder().CallCounts())
			}
			if h := c.lockHolder(); !h.Free() {
				t.Errorf("a refused operation holds the lock: %s", h.Holder)
			}
			if e := waitEvent(t, c, "upgrade", corev1.EventTypeWarning, "PreflightRefused"); e.Message != op.Status.Message {
				t.Errorf("the Event says %q, not the phase message %q", e.Message, op.Status.Message)
			}
		})
	}
}

func waitEvent(t *testing.T, c *cluster, name, eventType, reason string) corev1.Event {
	t.Helper()
	return waitEventWhere(t, c, name, "a "+eventType+" Event "+reason, func(e corev1.Event) bool {
		return e.Type == eventType && e.Reason == reason
	})
}

// waitEventWhere waits for an Event of the named operation that match
// accepts.
func waitEventWhere(t *testing.T, c *cluster, name, what string, match func(corev1.Event) bool) corev1.Event {
	t.Helper()
	var found corev1.Event
	testenv.Eventually(t, 30*time.Second, what, func(context.Context) (bool, error) {
		for _, e := range c.events(name) {
			if match(e) {
				found = e
				return true, nil
			}
		}
		return false, nil
	})
	return found
}

// eventUIDs are the Events of the named operation so far.
func eventUIDs(c *cluster, name string) map[types.UID]bool {
	uids := map[types.UID]bool{}
	for _, e := range c.events(name) {
		uids[e.UID] = true
	}
	return uids
}

// TestOverride: an ichor-admin's spec.override runs a refused upgrade and
// leaves one PreflightOverridden Warning Event naming the bypassed check; an
// ichor-operator may not set it.
func TestOverride(t *testing.T) {
	ctx := context.Background()
	// --force-conflicts: TestIchorUpgradeThroughInstaller applies the same
	// manifests as the installer Job (its own field manager) on this API server.
	if _, _, err := env.Kubectl(ctx, nil, "apply", "--server-side", "--force-conflicts", "-k", filepath.Join(env.Root, "manifests")); err != nil {
		t.Fatal(err)
	}
	c := newCluster(t, sim.Cluster("", 1, 1))
	admin := userBoundTo(t, c.ns, "ichor-admin")
	operator := userBoundTo(t, c.ns, "ichor-operator")
	c.start()

	downgrade := talosSpec("v1.12.2")
	downgrade.Override = true
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "by-operator"}, Spec: downgrade}
	// The API server loads new policies asynchronously: probe with dry runs.
	testenv.Eventually(t, 30*time.Second, "the override policy to be enforced", func(ctx context.Context) (bool, error) {
		err := operator.Create(ctx, op.DeepCopy(), client.DryRunAll)
		return err != nil, nil
	})
	err := operator.Create(ctx, op.DeepCopy())
	if err == nil || !strings.Contains(err.Error(), `needs verb "override" on "talosoperations"`) {
		t.Fatalf("an ichor-operator set override: %v", err)
	}

	op.Name = "by-admin"
	if err := admin.Create(ctx, op); err != nil {
		t.Fatalf("an ichor-admin may set override: %v", err)
	}
	got := c.waitSucceeded("by-admin", time.Minute)
	if cond := meta.FindStatusCondition(got.Status.Conditions, "TalosVersionNewer"); cond == nil || cond.Reason != "Overridden" {
		t.Errorf("the bypassed check is not recorded: %+v", cond)
	}
	ev := waitEvent(t, c, "by-admin", corev1.EventTypeWarning, "PreflightOverridden")
	if !strings.Contains(ev.Message, "TalosVersionNewer") {
		t.Errorf("the Event does not name the bypassed check: %q", ev.Message)
	}
	n := 0
	for _, e := range c.events("by-admin") {
		if e.Reason == "PreflightOverridden" {
			n += max(1, int(e.Count))
		}
	}
	if n != 1 {
		t.Errorf("%d PreflightOverridden Events, want exactly one", n)
	}
	for _, m := range c.fleet.Machines() {
		if m.Version() != "v1.12.2" {
			t.Errorf("%s runs %s after the overridden downgrade", m.Name(), m.Version())
		}
	}

	// Setting override on a Refused operation runs it that way.
	refused := talosSpec("v1.12.1")
	c.create("refused-first", refused)
	c.waitFor("refused-first", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
	if err := admin.Patch(ctx, &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: "refused-first"}},
		client.RawPatch(types.MergePatchType, []byte(`{"spec":{"override":true}}`))); err != nil {
		t.Fatalf("an ichor-admin sets override on a refused operation: %v", err)
	}
	c.waitSucceeded("refused-first", time.Minute)
	waitEvent(t, c, "refused-first", corev1.EventTypeWarning, "PreflightOverridden")
	if v := c.fleet.Machines()[0].Version(); v != "v1.12.1" {
		t.Errorf("runs %s after the override", v)
	}
}

// userBoundTo returns a client for a new user bound to a ClusterRole in ns.
func userBoundTo(t *testing.T, ns, role string) client.Client {
	t.Helper()
	user := ns + "-" + role
	rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: user},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
	if err := env.Client.Create(context.Background(), rb); err != nil {
		t.Fatal(err)
	}
	cfg, err := env.User(user)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := client.New(cfg, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	return cl
}
