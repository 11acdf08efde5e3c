package sim_test

import (
	"context"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/internal/testenv"
)

// TestJoin: a machine the spec marks Joins is not part of the cluster until
// Fleet.Join: no Node, no etcd member, not an endpoint, unreachable. Joined,
// it answers, becomes an etcd member, its Node registers NotReady and
// turns Ready once its network is up, and a control plane's mirror pods
// come once its Node exists, owned by it.
func TestJoin(t *testing.T) {
	spec := fleetSpec(t, 2, 1)
	spec.Machines[1].Joins = true
	spec.Durations.NodeReady = time.Hour // NotReady for the length of the test
	logs := logLines(t, &spec)
	f := start(t, spec)
	cp, joiner := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	if eps := f.Endpoints(); len(eps) != 1 || eps[0] != cp.Endpoint() {
		t.Fatalf("endpoints %v; want only %s", eps, cp.Endpoint())
	}
	if st := f.Etcd(); len(st.Members) != 1 || st.Members[0].Name != cp.Name() {
		t.Fatalf("etcd members before the join %+v", st.Members)
	}
	if _, err := env.Kube.CoreV1().Nodes().Get(context.Background(), joiner.Name(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the joining machine has a Node before it joined (%v)", err)
	}
	if _, err := version(t, c, joiner); err == nil || !joiner.Pending() {
		t.Fatalf("a machine waiting to join answered (pending %v)", joiner.Pending())
	}

	if err := f.Join(context.Background(), joiner.Name()); err != nil {
		t.Fatal(err)
	}
	if err := f.Join(context.Background(), joiner.Name()); err == nil {
		t.Fatal("a machine joined twice")
	}
	if err := f.Join(context.Background(), "nope"); err == nil {
		t.Fatal("an unknown machine joined")
	}
	if n := node(t, joiner); nodeReady(n) {
		t.Fatal("a joining machine's Node is Ready before its network is up")
	}
	if v, err := version(t, c, joiner); err != nil || v != joiner.Version() {
		t.Fatalf("the joined machine answers %q, %v", v, err)
	}
	testenv.Eventually(t, 30*time.Second, "the joined control plane to be an etcd member", func(context.Context) (bool, error) {
		st := f.Etcd()
		return len(st.Members) == 2 && st.Leader != "", nil
	})
	if eps := f.Endpoints(); len(eps) != 2 {
		t.Fatalf("endpoints after the join %v", eps)
	}
	// Its Node came after the machine started: the mirror pods follow it,
	// owned by it as the kubelet's are.
	uid := node(t, joiner).UID
	testenv.Eventually(t, 30*time.Second, "the joined control plane's mirror pods, owned by its Node", func(context.Context) (bool, error) {
		pods := mirrorPods(t, joiner)
		for _, c := range components {
			ref := (*metav1.OwnerReference)(nil)
			if p := pods[c]; p != nil {
				ref = metav1.GetControllerOf(p)
			}
			if ref == nil || ref.Kind != "Node" || ref.UID != uid {
				return false, nil
			}
		}
		return true, nil
	})
	if failed := logs("mirror pod"); len(failed) > 0 {
		t.Errorf("the fleet failed to make mirror pods: %q", failed)
	}

	// With the default NodeReady, the Node turns Ready by itself.
	spec = fleetSpec(t, 1, 1)
	spec.Machines[1].Joins = true
	g := start(t, spec)
	w := g.Machines()[1]
	if err := g.Join(context.Background(), w.Name()); err != nil {
		t.Fatal(err)
	}
	waitNodeReady(t, w, true)
}
