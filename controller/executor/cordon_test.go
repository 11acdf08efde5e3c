package executor

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubefake "k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// TestCordonDecidesOnTheCacheOnlyToChange: the cordon and the uncordon
// decide first on the cache's Node, but a decision to change nothing is
// only taken on the API server's: a cache that has not seen the Node's
// latest change (here the fake client as the cache, a step behind the fake
// clientset as the API server) must not skip a cordon or leave Ichor's own
// cordon in place. The guarded write itself, and the conflict it meets when
// an operator cordons meanwhile, are TestOperatorCordonsMeanwhile's, on a
// real API server.
func TestCordonDecidesOnTheCacheOnlyToChange(t *testing.T) {
	const me = "ichor-controller/op/ns/upgrade"
	node := func(unschedulable bool, by string) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w-1", ResourceVersion: "7"}, Spec: corev1.NodeSpec{Unschedulable: unschedulable}}
		if by != "" {
			n.Annotations = map[string]string{CordonedByAnnotation: by}
		}
		return n
	}
	for _, tc := range []struct {
		name         string
		step         Step
		cached, live *corev1.Node // nil: not in the cache
		want         bool         // unschedulable afterwards
		wantBy       string
	}{
		{"cordon, the cache has it cordoned by someone who lifted it since", cordonStep(), node(true, "operator"), node(false, ""), true, me},
		{"cordon, the cache has it cordoned, and so it is", cordonStep(), node(true, ""), node(true, ""), true, ""},
		{"cordon, not in the cache yet", cordonStep(), nil, node(false, ""), true, me},
		{"uncordon, the cache has not seen Ichor's cordon", uncordonStep(), node(false, ""), node(true, me), false, ""},
		{"uncordon, an operator's cordon in both", uncordonStep(), node(true, "operator"), node(true, "operator"), true, "operator"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cache := fake.NewClientBuilder()
			if tc.cached != nil {
				cache = cache.WithObjects(tc.cached)
			}
			api := kubefake.NewClientset(tc.live)
			e := &Env{Machine: ichorv1.MachineStatus{Name: "w-1"}, Kube: cache.Build(), Clientset: api, Identity: me}
			if _, err := tc.step.Run(context.Background(), e); err != nil {
				t.Fatal(err)
			}
			got, err := api.CoreV1().Nodes().Get(context.Background(), "w-1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if got.Spec.Unschedulable != tc.want || got.Annotations[CordonedByAnnotation] != tc.wantBy {
				t.Errorf("%s: unschedulable %v, %s=%q; want %v, %q", tc.step.Name, got.Spec.Unschedulable, CordonedByAnnotation,
					got.Annotations[CordonedByAnnotation], tc.want, tc.wantBy)
			}
		})
	}
}
