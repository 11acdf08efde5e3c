package operation_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/membership"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func (c *cluster) waitLockHolder(want string) {
	c.t.Helper()
	testenv.Eventually(c.t, time.Minute, "the lock to be held by "+orNobody(want), func(context.Context) (bool, error) {
		return c.lockHolder().Holder.Identity == want, nil
	})
}

func orNobody(s string) string {
	if s == "" {
		return "nobody"
	}
	return s
}

func controlPlaneNode(name string, finalizers ...string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: finalizers,
		Labels: map[string]string{ichorv1.ControlPlaneLabel: ""}}}
}

func setReady(t *testing.T, n *corev1.Node) {
	t.Helper()
	// The node-lifecycle controller writes Node status too: write on the latest.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := env.Client.Get(context.Background(), client.ObjectKeyFromObject(n), n); err != nil {
			return err
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
		return env.Client.Status().Update(context.Background(), n)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestControlPlaneJoin: a control plane that has never been Ready holds the
// cluster lock under its own identity until it is; operations wait.
func TestControlPlaneJoin(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	c.start()
	joining := controlPlaneNode(c.ns + "-new-cp")
	if err := env.Client.Create(context.Background(), joining); err != nil {
		t.Fatal(err)
	}
	id := ichorv1.MachineIdentity(joining.Name)
	c.waitLockHolder(id)
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitFor("reboot", "to wait for the join", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	})
	setReady(t, joining)
	c.waitSucceeded("reboot", time.Minute)
	n := &corev1.Node{}
	if err := env.Client.Get(context.Background(), keyOfNode(joining.Name), n); err != nil || n.Annotations[membership.JoinedAnnotation] != "true" {
		t.Errorf("joined annotation %q (%v)", n.Annotations[membership.JoinedAnnotation], err)
	}
}

// TestControlPlaneRemoval: a control-plane Node being deleted holds the lock
// until it is gone.
func TestControlPlaneRemoval(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	c.start()
	leaving := controlPlaneNode(c.ns+"-old-cp", "test.ichor.maesh.dev/hold")
	if err := env.Client.Create(context.Background(), leaving); err != nil {
		t.Fatal(err)
	}
	setReady(t, leaving)
	id := ichorv1.MachineIdentity(leaving.Name)
	testenv.Eventually(t, time.Minute, "the control plane to be marked joined", func(ctx context.Context) (bool, error) {
		n := &corev1.Node{}
		err := env.Client.Get(ctx, keyOfNode(leaving.Name), n)
		return err == nil && n.Annotations[membership.JoinedAnnotation] == "true", err
	})
	c.waitLockHolder("")
	if err := env.Client.Delete(context.Background(), leaving); err != nil {
		t.Fatal(err)
	}
	c.waitLockHolder(id)
	c.create("reboot", rebootSpec(c.fleet.Machines()[1].Name()))
	c.waitFor("reboot", "to wait for the removal", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == id
	})
	c.patchNode(leaving.Name, `{"metadata":{"finalizers":null}}`)
	c.waitSucceeded("reboot", time.Minute)
}
